"""6-bit weights (a GGUF's Q6_K kept as int6 g16) against the int8 g16 they were packed as
before, on the Q6_K matrices of a Gemma 4 31B Q4_K_M file, one GPU, in one run.

    python tools/bench_int6.py [--rows 1,8,32] [--sweep]

Per matrix and row count: microseconds a call and the weight bytes streamed per second of
each path (weights past L2: each call reads the next of several copies, as a decode step
reads every matrix once), from CUDA-graph replays. int8 g16 runs the tiles the worker's
start-up would time and pick (``quant_matmul.choose_configs``). ``--sweep`` also times the
int6 GEMV's (word columns a program, warps, programs) candidates at one row and the GEMM's
(word columns of the one-dot kernel, warps, programs) at 8 and 32, and prints the fastest per
matrix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench_quant_kernels import rotated  # noqa: E402
from worker.device.kernels import int6_matmul as six  # noqa: E402
from worker.device.kernels import quant_matmul as qm  # noqa: E402
from worker.layers import quant as Q  # noqa: E402

# the Q6_K tensors of a Gemma 4 31B Q4_K_M file (tools/gguf_stub.py's type choices)
SHAPES = [("lm_head / embedding", 262144, 5376), ("down_proj", 5376, 21504),
          ("v_proj (sliding)", 4096, 5376)]  # fmt: skip
ROTATE_BYTES = 400_000_000  # copies of a matrix until their bytes are well past any L2
# (word columns a program, warps, programs the K split aims at)
GEMV_SWEEP = [(32, 8, 264), (32, 4, 264), (32, 8, 528), (64, 8, 264), (64, 8, 528)]
# GEMM (word columns a program of the one-dot kernel, 0: a dot a position; warps; programs)
GEMM_SWEEP = [(0, 4, 264), (32, 4, 264), (32, 8, 264), (64, 4, 264), (64, 8, 264),
              (32, 4, 132), (64, 8, 132)]  # fmt: skip


def _int6_weight(n: int, k: int) -> Q.QuantizedWeight:
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, device="cuda")
    scales = (torch.rand(n, k // 16, device="cuda") * 0.01 + 1e-3).half()
    return Q.QuantizedWeight(Q.INT6, (n, k), 16, codes, scales)


def bench(name: str, n: int, k: int, rows_list: list[int], sweep: bool) -> list[dict[str, Any]]:
    qw = _int6_weight(n, k)
    as_int8 = Q.QuantizedWeight(Q.INT8, qw.shape, 16, qw.qdata, qw.scales)
    eight = qm.KMajorWeight.pack(as_int8)
    qm.choose_configs([eight], torch.bfloat16, cache=None, remember=False)
    copies8 = max(1, -(-ROTATE_BYTES // eight.nbytes))
    eights = [eight] + [qm.KMajorWeight.pack(as_int8) for _ in range(copies8 - 1)]
    for other in eights[1:]:
        other.gemv_config, other.gemm_config = eight.gemv_config, eight.gemm_config
    sixes = [six.SixBitWeight.pack(qw)]
    copies6 = max(1, -(-ROTATE_BYTES // sixes[0].nbytes))
    sixes += [six.SixBitWeight.pack(qw) for _ in range(copies6 - 1)]
    reference = qw.dequantize(torch.float32)
    del qw, as_int8
    print(f"{name} [{n}, {k}]: int6 {sixes[0].nbytes / 1e6:.1f} MB ({len(sixes)} copies), "
          f"int8 g16 {eight.nbytes / 1e6:.1f} MB; int8 tiles GEMV {eight.gemv_config} GEMM "
          f"{eight.gemm_config}", flush=True)  # fmt: skip
    out = []
    for rows in rows_list:
        x = (torch.randn(rows, k, device="cuda") * 0.5).to(torch.bfloat16)
        want = x.float() @ reference.T
        got = six.int6_linear(x, sixes[0]).float()
        error = float((got - want).norm() / want.norm())
        t6 = rotated(lambda w, x=x: six.int6_linear(x, w), sixes)
        t8 = rotated(lambda w, x=x: qm.quant_linear(x, w), eights)
        row = {"matrix": name, "rows": rows, "int6_us": t6 * 1e6, "int8_us": t8 * 1e6,
               "int6_tbs": sixes[0].nbytes / t6 / 1e12, "int8_tbs": eight.nbytes / t8 / 1e12,
               "rel_error": error}  # fmt: skip
        out.append(row)
        print(f"  {rows:>3} rows: int6 {t6 * 1e6:8.1f} us ({row['int6_tbs']:.2f} TB/s)  int8 g16 "
              f"{t8 * 1e6:8.1f} us ({row['int8_tbs']:.2f} TB/s)  int6/int8 time {t6 / t8:.2f}  "
              f"rel. error vs fp32 {error:.1e}", flush=True)  # fmt: skip
    if sweep:
        x = (torch.randn(1, k, device="cuda") * 0.5).to(torch.bfloat16)
        kept = (six.GEMV_BLOCK_C, six.GEMV_WIDE_C, six.GEMV_WARPS, six.GEMV_PROGRAMS)
        timings = []
        for config in GEMV_SWEEP:
            six.GEMV_BLOCK_C, six.GEMV_WARPS, six.GEMV_PROGRAMS = config
            six.GEMV_WIDE_C = config[0]
            t = rotated(lambda w: six.int6_linear(x, w), sixes)
            timings.append((t, config))
            print(f"  sweep GEMV {config}: {t * 1e6:8.1f} us "
                  f"({sixes[0].nbytes / t / 1e12:.2f} TB/s)", flush=True)  # fmt: skip
        six.GEMV_BLOCK_C, six.GEMV_WIDE_C, six.GEMV_WARPS, six.GEMV_PROGRAMS = kept
        print(f"  fastest: {min(timings)[1]}", flush=True)
        for rows in (8, 32):
            x = (torch.randn(rows, k, device="cuda") * 0.5).to(torch.bfloat16)
            kept = (six.GEMM_WIDE, six.GEMM_WARPS, six.GEMM_PROGRAMS)
            timings = []
            for config in GEMM_SWEEP:
                six.GEMM_WIDE, six.GEMM_WARPS, six.GEMM_PROGRAMS = config
                t = rotated(lambda w, x=x: six.int6_linear(x, w), sixes)
                timings.append((t, config))
                print(f"  sweep GEMM {rows} rows {config}: {t * 1e6:8.1f} us "
                      f"({sixes[0].nbytes / t / 1e12:.2f} TB/s)", flush=True)  # fmt: skip
            six.GEMM_WIDE, six.GEMM_WARPS, six.GEMM_PROGRAMS = kept
            print(f"  fastest at {rows} rows: {min(timings)[1]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_int6: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    table = []
    for name, n, k in SHAPES:
        table += bench(name, n, k, rows, args.sweep)
        torch.cuda.empty_cache()
    print("\n| matrix | rows | int6 us | int8 g16 us | int6 TB/s | int8 g16 TB/s | int6 / int8 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(
            f"| {r['matrix']} | {r['rows']} | {r['int6_us']:.1f} | {r['int8_us']:.1f} | "
            f"{r['int6_tbs']:.2f} | {r['int8_tbs']:.2f} | {r['int6_us'] / r['int8_us']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
