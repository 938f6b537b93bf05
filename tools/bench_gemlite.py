"""gemlite (mobiusml's Triton low-bit matmuls, ``pip install gemlite``) side by side with our
int4 kernels and torch's tinygemm on the Gemma 4 31B matrices, all three over the SAME int4 g32
codes, scales and offsets (issue 14: a kept library or our own kernels?).

Per matrix and row count M: our product path (``quant_linear`` with the tiles the worker's
start-up would time and pick, ``choose_configs``), gemlite's ``GemLiteLinearTriton`` (A16W4,
its own kernel choice by M and its own autotuning: GEMV_REVSPLITK at M <= 4, GEMM_SPLITK up to
63), gemlite again with fp32 split-K atomics (``set_native_atomic_bfp16(False)``; its default
adds the K-splits' partial sums into the bf16 output), and tinygemm
(``aten._weight_int4pack_mm``; bf16 scales and zeros, its only format). Each time is a CUDA
graph replay of one call per weight copy, as many copies as make > 200 MB (no call finds its
weight in the 50 MB L2, as in a decode step); TB/s counts our int4 bytes (codes + fp16
scales + offsets, the same for gemlite). Errors: max |y - y_fp32| / max |y_fp32| against the
fp32 product of the dequantized weight. CUDA only (gemlite imports CUDA state at import).

    python tools/bench_gemlite.py [--rows 1,32] [--shape I,J] [--warm] [--out DIR]

``--warm`` only compiles and autotunes (one call per path and M, no timing): the device script
runs one such process per matrix in parallel first, so the timed run finds every Triton binary
in the disk cache and its autotuning costs only the benchmarks.

The format conversion (``gemlite_tensors``) is plain torch and tested on the CPU
(tests/worker/test_gemlite_format.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.layers import quant as Q  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ROTATE_BYTES = 200_000_000  # weight copies per matrix: past the H200's 50 MB L2 four times
# gemlite with fp32 atomics only on its GEMV (M <= 4): there its bf16 atomics put 15-25x our
# error on the output (round s11r2); at 32 rows its bf16 split-K sums give 1.2-1.35x ours
F32_ATOMIC_MAX_ROWS = 4


def gemlite_tensors(qw: Q.QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our int4 weight as gemlite's A16W4 tensors (W_group_mode 4: ``w = fma(q, scale, zero)``
    per group, that is our ``q * scale + offset`` with zero = our offset), values untouched:

    - W_q int32 [K / 8, N]: word (j, n) holds the codes k = 8j .. 8j + 7 of output n, code k
      at bits 4 (k % 8). Our uint8 [N, K / 2] rows (low nibble the even k) read as
      little-endian int32 are exactly those words, so this is a view and a transpose.
    - scales, zeros fp16 [K / g, N]: ours transposed."""
    if qw.kind != Q.INT4 or qw.offsets is None:
        raise ValueError(f"gemlite's A16W4 takes our int4 weights, got {qw.kind}")
    n, k = qw.shape
    if k % 8:
        raise ValueError(f"gemlite packs 8 codes a word: K {k} is not a multiple of 8")
    words = qw.qdata.contiguous().view(torch.int32)  # [N, K / 8]
    return words.t().contiguous(), qw.scales.t().contiguous(), qw.offsets.t().contiguous()


def gemlite_dequantize(
    words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """gemlite's dequantization of ``gemlite_tensors`` in fp32 -> [N, K] (its kernels do the
    same per tile: ``(word >> 4 (k % 8)) & 15``, then ``q * scale + zero``; on the GPU the
    fma runs in the scales' dtype, fp16)."""
    k = words.shape[0] * 8
    shifts = (4 * (torch.arange(k, device=words.device) % 8)).to(torch.int32)
    codes = (words.repeat_interleave(8, dim=0) >> shifts[:, None]) & 15  # [K, N]
    scale = scales.float().repeat_interleave(group, dim=0)
    zero = zeros.float().repeat_interleave(group, dim=0)
    return (codes.float() * scale + zero).t()


def gemlite_layer(qw: Q.QuantizedWeight) -> Any:
    """A GemLiteLinearTriton (bf16 in and out, fp16 scales and zeros) over ``qw``'s values."""
    from gemlite.core import DType, GemLiteLinearTriton

    n, k = qw.shape
    layer = GemLiteLinearTriton(
        4, group_size=qw.group_size, in_features=k, out_features=n,
        input_dtype=DType.BF16, output_dtype=DType.BF16,
    )  # fmt: skip
    # gemlite packs the codes itself; its zeros (-z * scale) are replaced by our offsets
    assert qw.offsets is not None
    layer.pack(Q.unpack_nibbles(qw.qdata), qw.scales, torch.zeros_like(qw.offsets), fma_mode=True)
    words, scales, zeros = gemlite_tensors(qw)
    if not torch.equal(layer.W_q, words) or not torch.equal(layer.scales, scales):
        raise RuntimeError("gemlite packed the codes or scales differently from gemlite_tensors")
    if layer.W_group_mode != 4:
        raise RuntimeError(f"gemlite chose W_group_mode {layer.W_group_mode}, expected 4 (fma)")
    layer._promote_to_parameter("zeros", zeros)
    return layer


def gemlite_choice(m: int) -> tuple[str, str]:
    """The kernel gemlite runs at M rows (4-bit weights) and its autotuned config, as text."""
    from gemlite import core

    kind = core.get_matmul_type(m, 4)
    tuner = core.GEMLITE_TRITON_MAPPING[kind].kernel[0]
    best = getattr(tuner, "best_config", None)
    return kind, "" if best is None else str(best)


def bench_matrix(
    name: str, n: int, k: int, rows_list: list[int], group: int, warm: bool
) -> list[dict[str, Any]]:
    import gemlite

    import tools.bench_quant_kernels as bq
    from worker.device.kernels import quant_matmul as qm

    dev = torch.device("cuda")
    weight = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    qw = Q.quantize(weight, Q.QuantFormat("int4", group), search=False)
    del weight
    packed = qm.KMajorWeight.pack(qw)
    qm.choose_configs([packed], torch.bfloat16, cache=None, remember=False)
    copies = 1 if warm else max(1, -(-ROTATE_BYTES // packed.nbytes))
    ours = [packed] + [qm.KMajorWeight.pack(qw) for _ in range(copies - 1)]
    for other in ours[1:]:
        other.gemv_config, other.gemm_config = packed.gemv_config, packed.gemm_config
    glite = [gemlite_layer(qw) for _ in range(copies)]
    tiny = []
    try:
        tiny = [bq.tinygemm(qw) for _ in range(copies)]
    except Exception as exc:  # noqa: BLE001
        print(f"tinygemm unavailable: {exc!r:.100}", flush=True)
    reference = qw.dequantize(torch.float32)  # [N, K]
    int4_bytes = packed.nbytes
    print(f"{name} [{n}, {k}]: {int4_bytes / 1e6:.1f} MB, {copies} copies; our tiles GEMV "
          f"{packed.gemv_config} GEMM {packed.gemm_config}", flush=True)  # fmt: skip

    def native_atomics(on: bool) -> None:
        gemlite.set_native_atomic_bfp16(on)

    out = []
    for m in rows_list:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        want = x.float() @ reference.t()
        scale = want.abs().max().item()
        paths: dict[str, tuple[list[Any], Any]] = {
            "ours": (ours, lambda w, x=x: qm.quant_linear(x, w)),
            "gemlite": (glite, lambda w, x=x: (native_atomics(True), w(x))[1]),
        }
        if m <= F32_ATOMIC_MAX_ROWS:
            paths["gemlite_f32atomic"] = (glite, lambda w, x=x: (native_atomics(False), w(x))[1])
        if tiny:
            paths["tinygemm"] = (tiny, lambda w, x=x: w(x))
        row: dict[str, Any] = {"matrix": name, "N": n, "K": k, "M": m, "MB": int4_bytes / 1e6}
        for key, (weights, call) in paths.items():
            start = time.perf_counter()
            try:
                y = call(weights[0])  # gemlite autotunes here, on its first call for (M, N, K)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - e.g. tinygemm refuses a shape
                row[f"{key}_failed"] = repr(exc)[:160]
                continue
            row[f"{key}_first_s"] = round(time.perf_counter() - start, 2)
            if key == "gemlite":
                row["gemlite_kernel"], row["gemlite_config"] = gemlite_choice(m)
            row[f"{key}_err"] = (y.float() - want).abs().max().item() / scale
            if warm:
                continue
            seconds, graphed = bq.timed(lambda ws=weights, c=call: [c(w) for w in ws])
            us = seconds / len(weights) * 1e6
            row[f"{key}_us"] = round(us, 2)
            row[f"{key}_TBps"] = round(int4_bytes / (us * 1e-6) / 1e12, 3)
            if not graphed:
                row[f"{key}_plain_timing"] = True
        native_atomics(True)
        out.append(row)
        print(json.dumps(row), flush=True)
        print("  " + "  ".join(
            f"{key} {row[f'{key}_us']:.1f} us ({row[f'{key}_TBps']:.2f} TB/s, err "
            f"{row[f'{key}_err']:.1e})" for key in paths if f"{key}_us" in row
        ), flush=True)  # fmt: skip
    del ours, glite, tiny
    torch.cuda.empty_cache()
    return out


PATHS = ("ours", "gemlite", "gemlite_f32atomic", "tinygemm")


def step_sums(table: list[dict[str, Any]], counts: dict[tuple[int, int], int]) -> list[str]:
    """Lines: per M and path, the matmul time of one decode step (every layer's matrices)."""
    lines = []
    for m in sorted({r["M"] for r in table}):
        rows = [r for r in table if r["M"] == m]
        parts = []
        for key in PATHS:
            if all(f"{key}_us" in r for r in rows):
                ms = sum(r[f"{key}_us"] * counts[(r["N"], r["K"])] for r in rows) / 1e3
                parts.append(f"{key} {ms:.2f} ms")
        lines.append(f"M {m}: {len(rows)} matrices, a step's layers: " + ", ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    import tools.bench_quant_kernels as bq

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "gemma4_31b" / "config.json"))
    p.add_argument("--rows", default="1,32")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--shape", default="", help="only these layer matrices (indices: 0,2)")
    p.add_argument("--warm", action="store_true", help="compile and autotune only, no timing")
    p.add_argument("--configs", default="", help="write gemlite's tuned configs to this JSON")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    # the layers' matrices (the LM head is not among issue 14's int4 matrices)
    shapes = [s for s in bq.model_shapes(Path(args.model)) if s[0] != "lm_head"]
    counts = {(n, k): c for _, n, k, c in shapes}
    if args.shape:
        shapes = [shapes[int(i)] for i in args.shape.split(",")]
    table: list[dict[str, Any]] = []
    for name, n, k, _ in shapes:
        table.extend(bench_matrix(name, n, k, rows_list, args.group, args.warm))
    if not args.warm:
        for line in step_sums(table, counts):
            print(line, flush=True)
    if args.configs:
        import gemlite

        gemlite.cache_config(args.configs)
    if args.out:
        Path(args.out).write_text(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
