"""Quantized matmuls on the Gemma 4 31B matrix shapes (after the q/k/v and gate/up merge),
side by side in one run: bf16 cuBLAS and our bf16 GEMV (the float baseline), our Triton
W4A16 / W8A16 kernels (worker/device/kernels/quant_matmul.py; a config sweep for the GEMV),
torch's built-in int4 kernel ``aten._weight_int4pack_mm`` (tinygemm: what torchao's
Int4WeightOnlyConfig runs on CUDA) and, when importable, torchao's own int8 weight-only path.
Times are CUDA-graph replays (the way decode runs); GB/s is the weight bytes read per second.
CUDA only.

    python tools/bench_quant_kernels.py [--rows 1,2,4,8,16,32,64,2048] [--out DIR]
    python tools/bench_quant_kernels.py --gemm 8,32,64 [--only o_proj] [--gemm-tiles 0,1] [--warm]
    python tools/bench_quant_kernels.py --tiles int4 --layouts 0,32   # weight layouts side by side
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.device.kernels import quant_matmul as qm  # noqa: E402
from worker.device.kernels.gemv import choose_config, gemv_triton  # noqa: E402
from worker.device.kernels.gemv import graph_seconds as graph_time  # noqa: E402
from worker.layers import quant as Q  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# the error table (--partials-error) also runs on the CPU, in Triton's interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# GEMV (BLOCK_C words, programs wanted, num_warps, rows unrolled); GEMM (BLOCK_C, BLOCK_K,
# num_warps, num_stages): quant_matmul's config tuples
GEMV_SWEEP = [
    (c, p, w, u) for c, w in ((128, 1), (256, 1), (256, 2), (512, 4)) for p in (132, 264, 528)
    for u in (8, 32)
]  # fmt: skip
GEMM_SWEEP = [(c, k, w, s) for c in (16, 32, 64) for k in (32, 64) for w in (4, 8) for s in (2, 3)]


def model_shapes(config_path: Path) -> list[tuple[str, int, int, int]]:
    """(name, N, K, count per model) of every distinct matrix of the merged model, head too."""
    import worker.layers.deltanet as deltanet
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    model = build_model(config, "meta", torch.bfloat16)
    # qwen3_5_moe's layers merge only on the devices that do (CUDA); merge them here too
    deltanet.FUSED_PROJECTION_DEVICES = (*deltanet.FUSED_PROJECTION_DEVICES, "meta")
    model.fuse_projections()
    counts: dict[tuple[str, int, int], int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            key = (name.rsplit(".", 1)[-1], *module.weight.shape)
            counts[key] = counts.get(key, 0) + 1
    emb = model.model.embed_tokens.weight
    counts[("lm_head", emb.shape[0], emb.shape[1])] = 1
    return [(name, n, k, c) for (name, n, k), c in counts.items()]


def timed(fn: Any) -> tuple[float, bool]:
    """(seconds per call, True if timed as CUDA-graph replays; False: plain launches)."""
    try:
        return graph_time(fn), True
    except Exception as exc:  # noqa: BLE001 - some paths cannot be captured: plain timing
        print(f"  (graph capture failed: {exc!r:.100}; plain timing)", flush=True)
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20, False


def seconds(fn: Any) -> float:
    return timed(fn)[0]


def tinygemm(qw: Q.QuantizedWeight) -> Any:
    """torch's int4 kernel over the same codes: dequant (q - 8) * s + z with z = offset + 8 s,
    bf16 scales and zeros (tinygemm's only format)."""
    n, k = qw.shape
    codes = Q.unpack_nibbles(qw.qdata).to(torch.int32)  # [N, K]
    packed_in = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)  # aten's own packing
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_in, 8)
    scales = qw.scales.to(torch.bfloat16)
    zeros = (qw.offsets.float() + 8 * qw.scales.float()).to(torch.bfloat16)  # type: ignore[union-attr]
    sz = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()  # [K / g, N, 2]

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(x, packed, qw.group_size, sz)

    return run


def bench_shape(
    name: str, n: int, k: int, count: int, rows_list: list[int], group: int, sweep: bool
) -> list[dict[str, Any]]:
    """Every path on one [n, k] matrix at each M in `rows_list`; one row per M."""
    dev = torch.device("cuda")
    weight = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    canonical = Q.quantize(weight, Q.QuantFormat("int4", group), search=False)
    int4 = qm.KMajorWeight.pack(canonical)
    int8 = qm.KMajorWeight.pack(Q.quantize(weight, Q.QuantFormat("int8", group), search=False))
    try:
        tiny = tinygemm(canonical)
    except Exception as exc:  # noqa: BLE001
        print(f"tinygemm unavailable: {exc!r}", file=sys.stderr)
        tiny = None
    stored = {"bf16": 2.0, "int4": 0.5 + 4 / group, "int8": 1 + 2 / group}
    out = []
    for m in rows_list:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref4 = F.linear(x, canonical.dequantize(torch.bfloat16)).float()
        row: dict[str, Any] = {"matrix": name, "N": n, "K": k, "count": count, "M": m}
        paths: dict[str, Any] = {
            "bf16_cublas": lambda x=x: F.linear(x, weight),
            "int4_ours": lambda x=x: qm.quant_linear(x, int4),
            "int8_ours": lambda x=x: qm.quant_linear(x, int8),
        }
        if m <= 4:  # the config the worker's start-up would choose (None: cuBLAS is as fast)
            config = choose_config(weight)
            row["bf16_gemv_config"] = config
            paths["bf16_gemv"] = lambda x=x, c=config: (
                gemv_triton(x, weight, c) if c is not None else F.linear(x, weight)
            )
        if tiny is not None:
            paths["int4_tinygemm"] = lambda x=x: tiny(x)
        if qm.GEMV_MAX_ROWS < m <= qm.GEMM_MAX_ROWS:
            paths["int4_dequant_cublas"] = lambda x=x: F.linear(
                x, qm.dequantize_triton(int4, torch.bfloat16).t()
            )
        if m >= 512:
            paths["int4_qgemm"] = lambda x=x: qm.qgemm(x, int4)
        for key, fn in paths.items():
            try:
                row[f"{key}_us"] = seconds(fn) * 1e6
            except RuntimeError as exc:  # tinygemm takes only some N (1,281 outputs: not)
                row[f"{key}_failed"] = repr(exc)[:120]
                continue
            if key.startswith("int4"):
                row[f"{key}_maxerr"] = (fn().float() - ref4).abs().max().item()
            kind = key.split("_")[0]
            row[f"{key}_GBps"] = n * k * stored[kind] / (row[f"{key}_us"] * 1e-6) / 1e9
        if sweep and m <= qm.GEMV_MAX_ROWS:
            for kind, qw in (("int4", int4), ("int8", int8)):
                timed = []
                for cfg in GEMV_SWEEP:
                    try:
                        timed.append((seconds(lambda c=cfg, q=qw, x=x: qm.qgemv(x, q, c)), cfg))
                    except Exception:  # noqa: BLE001 - a config this GPU cannot run
                        continue
                best = min(timed)
                row[f"{kind}_best_gemv_us"], row[f"{kind}_best_gemv_cfg"] = best[0] * 1e6, best[1]
        if sweep and qm.GEMV_MAX_ROWS < m <= qm.GEMM_MAX_ROWS:
            timed_gemm = []
            for cfg in GEMM_SWEEP:
                try:
                    timed_gemm.append((seconds(lambda c=cfg, x=x: qm.qgemm(x, int4, c)), cfg))
                except Exception:  # noqa: BLE001 - out of shared memory, say
                    continue
            best = min(timed_gemm)
            row["int4_best_gemm_us"], row["int4_best_gemm_cfg"] = best[0] * 1e6, best[1]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


# --tiles: the GEMV tiles timed at one row (5th field: group slots; 6th: L2 prefetch steps
# ahead, quant_matmul's GEMV_CONFIG comment) and the GEMM tiles at 32 rows (5th: joined store;
# 6th: the K split's program target, 0 for GEMM_PROGRAMS; 7th: L2 prefetch K tiles ahead):
# session 16's set (BENCHMARKS "the blocked weight layout"), with --layouts 0,32
TILE_GEMVS = [
    (32, 264, 8, 8), (64, 264, 8, 8), (64, 264, 4, 8, 8), (32, 264, 4, 8, 8), (128, 264, 4, 8),
    (32, 132, 8, 8), (32, 396, 8, 8),
]  # fmt: skip
TILE_GEMM_PROGRAMS = (132, 264)  # --gemm: the K split's targets
# session 13's chosen 32-row tile and its neighbours
TILE_GEMMS = [(32, 32, 2, 3, 1, 528), (32, 32, 2, 3, 1, 264), (64, 32, 4, 3, 1, 264)]


def rotated(fn: Any, weights: list[Any]) -> float:
    """Seconds per call of ``fn(w)`` over copies of one matrix, each call on the next copy, so
    no call finds its weight in L2 (a decode step reads every matrix once)."""
    return seconds(lambda: [fn(w) for w in weights]) / len(weights)


def bench_tiles(
    name: str, n: int, k: int, group: int, kind: str, layouts: list[int] | None = None
) -> None:
    """One line per tile and weight layout (``layouts``: block widths, 0 the plain [K, C]
    order; None: the default): us per call (weights past L2), TB/s of the weight bytes, the
    max error against the torch reference, and whether the bits equal the first layout's; the
    first GEMV / GEMM line is the default tile."""
    dev = torch.device("cuda")
    weight = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    qw = Q.quantize(weight, Q.QuantFormat(kind, group), search=False)
    meta = qm.meta_dtype_for(kind, torch.bfloat16)  # as a bf16 model's weights
    layouts = [qm.BLOCK_WORDS] if layouts is None else layouts
    first = qm.KMajorWeight.pack(qw, meta, layouts[0])
    more = max(0, -(-200_000_000 // first.nbytes) - 1)
    for m in (1, 32):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        want = F.linear(x, qw.dequantize(torch.bfloat16)).float()
        if m == 1:
            runs = [(f"gemv {c}", lambda w, c=c, x=x: qm.qgemv(x, w, c)) for c in TILE_GEMVS]
        else:
            runs = [(f"gemm32 {c}", lambda w, c=c, x=x: qm.qgemm(x, w, c)) for c in TILE_GEMMS]
        for block in layouts:
            packed = qm.KMajorWeight.pack(qw, meta, block)
            copies = [packed] + [qm.KMajorWeight.pack(qw, meta, block) for _ in range(more)]
            layout = f"blocks of {block}" if block else "plain"
            for label, fn in runs:
                try:
                    us = rotated(fn, copies) * 1e6
                    got = fn(packed)
                    same = torch.equal(got, fn(first))
                    err = (got.float() - want).abs().max().item() / want.abs().max().item()
                except Exception as exc:  # noqa: BLE001 - a tile this GPU cannot run
                    print(f"{kind} {name} [{n}, {k}] {label} {layout}: failed {exc!r:.80}")
                    continue
                tbps = packed.nbytes / (us * 1e-6) / 1e12
                print(f"{kind} {name} [{n}, {k}] {label} {layout}: {us:.1f} us {tbps:.2f} TB/s "
                      f"err {err:.1e} bits as {layouts[0]}: {same}", flush=True)  # fmt: skip
            del copies, packed
            torch.cuda.empty_cache()


# --gemm: session 7's GEMM tiles and the same with the joined store (5th field), at each row
# count and K-split target (TILE_GEMM_PROGRAMS); the last: one more pipeline stage (the joined
# store frees 37 registers). Session 11's comparison; --tiles times today's candidates.
GEMM_STORE_TILES = [(64, 32, 4, 3), (64, 32, 4, 3, 1), (128, 32, 8, 3), (128, 32, 8, 3, 1),
                    (64, 32, 4, 4, 1)]  # fmt: skip


def bench_gemm_rows(
    name: str, n: int, k: int, group: int, rows_list: list[int], tiles: list[tuple[int, ...]],
    warm: bool,
) -> None:  # fmt: skip
    """One line per (rows, tile, K-split target): us per call (weights past L2), TB/s of the
    weight bytes, max error relative to the largest output (int4). ``warm``: one call each,
    nothing timed (compiles into Triton's disk cache)."""
    dev = torch.device("cuda")
    weight = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    qw = Q.quantize(weight, Q.QuantFormat("int4", group), search=False)
    meta = qm.meta_dtype_for("int4", torch.bfloat16)  # as a bf16 model's int4 weights
    packed = qm.KMajorWeight.pack(qw, meta)
    copies = [packed]
    if not warm:
        more = max(0, -(-200_000_000 // packed.nbytes) - 1)
        copies += [qm.KMajorWeight.pack(qw, meta) for _ in range(more)]
    for m in rows_list:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        want = F.linear(x, qw.dequantize(torch.bfloat16)).float()
        for programs in TILE_GEMM_PROGRAMS:
            qm.GEMM_PROGRAMS = programs
            for tile in tiles:
                if len(tile) > 5 and tile[5] and programs != TILE_GEMM_PROGRAMS[0]:
                    continue  # the tile names its own K split's target: timed once
                label = f"int4 {name} [{n}, {k}] rows {m} gemm {tile} programs {programs}"
                try:
                    err = (qm.qgemm(x, packed, tile).float() - want).abs().max().item()
                    if warm:
                        continue
                    us = rotated(lambda w, t=tile, x=x: qm.qgemm(x, w, t), copies) * 1e6
                except Exception as exc:  # noqa: BLE001 - a tile this GPU cannot run
                    print(f"{label}: failed {exc!r:.80}", flush=True)
                    continue
                tbps = packed.nbytes / (us * 1e-6) / 1e12
                rel = err / want.abs().max().item()
                print(f"{label}: {us:.1f} us {tbps:.2f} TB/s err {rel:.1e}", flush=True)
    qm.GEMM_PROGRAMS = TILE_GEMM_PROGRAMS[0]
    del copies
    torch.cuda.empty_cache()


def partials_error(name: str, n: int, k: int, group: int, rows: int) -> None:
    """The K-split GEMM's error with fp32 and with bf16 partials (``PARTIALS_BF16``): rms and
    max of (y - the float64 product of the same bf16-pair weights) relative to the product's
    rms and max, at 1, 8 and 25 splits (the tile of the 32-row default)."""
    gen = torch.Generator().manual_seed(0)
    qw = Q.quantize(torch.randn(n, k, generator=gen) * 0.02, Q.QuantFormat("int4", group),
                    search=False).to(DEVICE)  # fmt: skip
    packed = qm.KMajorWeight.pack(qw, torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, torch.bfloat16)
    codes = Q.unpack_nibbles(qw.qdata).double()
    scales = qw.scales.to(torch.bfloat16).double().repeat_interleave(group, dim=1)
    offsets = qw.offsets.to(torch.bfloat16).double().repeat_interleave(group, dim=1)
    want = x.double() @ (codes * scales + offsets).to(torch.bfloat16).double().T
    kept = qm.PARTIALS_BF16
    try:
        for split in (1, 8, 25):
            cells = []
            for bf16 in (False, True):
                qm.PARTIALS_BF16 = bf16
                err = qm.qgemm(x, packed, (32, 32, 2, 3, 1), split=split).double() - want
                rms = err.pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
                cells.append(f"{100 * rms:.3f}% / {100 * err.abs().max() / want.abs().max():.3f}%")
            print(f"| {name} [{n}, {k}] x {rows} | {split} | {cells[0]} | {cells[1]} |")
    finally:
        qm.PARTIALS_BF16 = kept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "gemma4_31b" / "config.json"))
    p.add_argument("--rows", default="1,2,4,8,16,32,64,512,2048")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--sweep", action="store_true", help="sweep GEMV/GEMM tile configs")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    tiles_help = "kinds (int4,int8): only time the tiles of bench_tiles per matrix"
    p.add_argument("--tiles", default="", help=tiles_help)
    p.add_argument("--only", default="", help="with --tiles: matrix names (qkv,o_proj,...)")
    layouts_help = "with --tiles: weight layouts side by side, block widths (0: plain), e.g. 0,32"
    p.add_argument("--layouts", default="", help=layouts_help)
    gemm_help = "rows (8,32,64): only time GEMM_STORE_TILES per matrix (with --only)"
    p.add_argument("--gemm", default="", help=gemm_help)
    p.add_argument("--gemm-tiles", default="", help="with --gemm: GEMM_STORE_TILES indices")
    list_help = "with --gemm: tiles to time, as 'c,k,w,s[,j,programs,ahead];...'"
    p.add_argument("--gemm-list", default="", help=list_help)
    p.add_argument("--warm", action="store_true", help="with --gemm: compile only, no timing")
    errors_help = "rows: the K-split GEMM's error with fp32 and bf16 partials (with --only)"
    p.add_argument("--partials-error", type=int, default=0, help=errors_help)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.partials_error:
        only = set(args.only.split(",")) if args.only else {"o_proj"}
        print("| matrix x rows | split | fp32 partials: rms / max | bf16 partials: rms / max |")
        print("| --- | --- | --- | --- |")
        seen = set()
        for name, n, k, _ in model_shapes(Path(args.model)):
            if name in only and name not in seen:
                partials_error(name, n, k, args.group, args.partials_error)
            seen.add(name)
        return 0
    if args.gemm:  # each name's first matrix (the sliding layers' o and qkv), no head
        only = set(args.only.split(",")) if args.only else None
        rows = [int(r) for r in args.gemm.split(",")]
        tiles = GEMM_STORE_TILES
        if args.gemm_tiles:
            tiles = [GEMM_STORE_TILES[int(i)] for i in args.gemm_tiles.split(",")]
        if args.gemm_list:
            tiles = [tuple(int(v) for v in t.split(",")) for t in args.gemm_list.split(";")]
        seen = {"lm_head"}
        for name, n, k, _ in model_shapes(Path(args.model)):
            if name not in seen and (only is None or name in only):
                bench_gemm_rows(name, n, k, args.group, rows, tiles, args.warm)
            seen.add(name)
        return 0
    if args.tiles:
        only = set(args.only.split(",")) if args.only else None
        layouts = [int(b) for b in args.layouts.split(",")] if args.layouts else None
        for kind in args.tiles.split(","):
            for name, n, k, _ in model_shapes(Path(args.model)):
                if only is None or name in only:
                    bench_tiles(name, n, k, args.group, kind, layouts)
        return 0
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = model_shapes(Path(args.model))
    table: list[dict[str, Any]] = []
    for name, n, k, count in shapes:
        table.extend(bench_shape(name, n, k, count, rows_list, args.group, args.sweep))
        torch.cuda.empty_cache()
    # per decode step (M rows): every matrix once per layer that has it
    summary = {}
    for m in rows_list:
        for key in ("bf16_cublas_us", "bf16_gemv_us", "int4_ours_us", "int8_ours_us",
                    "int4_tinygemm_us", "int4_best_gemv_us", "int8_best_gemv_us"):  # fmt: skip
            rows = [r for r in table if r["M"] == m]
            if rows and all(key in r for r in rows):
                summary[f"M{m} {key}"] = sum(r[key] * r["count"] for r in rows) / 1e3
    print("\nper-step matmul time (ms), all layers:", file=sys.stderr)
    for key, ms in summary.items():
        print(f"  {key:32s} {ms:8.2f}", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_kernels.json").write_text(json.dumps({"rows": table, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
