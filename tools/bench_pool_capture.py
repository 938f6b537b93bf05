"""The prefix pool's capture of one prefill chunk, by index against as a slice, side by side.

    python tools/bench_pool_capture.py [--device cuda] [--chunk 2048] [--dtypes bfloat16,fp8]

A prefill step copies its new keys and values into the shared-prefix pool, every layer
(`worker.layers.kv.PoolCapture.take`). Where the step's blocks lie on one run of pool rows the
copy is a slice (`kv.slice_copy`), else `index_copy_` (`kv.index_copy`; the only way before
session 44, and what TOKENPIPE_CAPTURE_RUNS=0 keeps). This times both for one chunk of the
Gemma 4 31B layer shapes (a sliding layer: 16 KV heads x 256; a full one: 4 x 512), K and V,
with the new keys as the attention path leaves them (a transposed view), and checks that both
write the same bytes. Prints ms for a chunk over the whole model (50 sliding + 10 full layers).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.layers.kv import index_copy, slice_copy  # noqa: E402

LAYERS = {"sliding": (16, 256, 50), "full": (4, 512, 10)}  # KV heads, head dim, count (31B)
DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "float32": torch.float32}


def seconds(fn, device: torch.device, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeat


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--pool-rows", type=int, default=8192)
    ap.add_argument("--dtypes", default="bfloat16,fp8")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    n, first = args.chunk, args.pool_rows // 4
    print("| cache | layer | index_copy (ms) | slice (ms) | same bytes |")
    print("| --- | --- | --- | --- | --- |")
    totals = {}
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        index_total = slice_total = 0.0
        for kind, (heads, dim, count) in LAYERS.items():
            pool = torch.zeros(heads, args.pool_rows, dim, dtype=dtype, device=device)
            step = torch.randn(n, heads, dim, device=device).to(torch.bfloat16)
            new = step.transpose(0, 1).clamp(-448, 448).to(dtype)  # [KVH, n, D], a view's strides
            rows = torch.arange(first, first + n, device=device)
            indexed, sliced = pool, pool.clone()

            def by_rows(p=indexed, r=rows, t=new):  # type: ignore[no-untyped-def]
                index_copy(p, 1, r, t)

            def by_run(p=sliced[:, first : first + n], t=new):  # type: ignore[no-untyped-def]
                slice_copy(p, t)

            by_index = seconds(by_rows, device, args.repeat)
            by_slice = seconds(by_run, device, args.repeat)
            same = torch.equal(indexed.view(torch.uint8), sliced.view(torch.uint8))
            same = same and bool(indexed.view(torch.uint8).any())
            print(f"| {name} | {kind} [{heads}, {n}, {dim}] | {by_index * 1e3:.3f} | "
                  f"{by_slice * 1e3:.3f} | {same} |")  # fmt: skip
            index_total += 2 * count * by_index  # K and V
            slice_total += 2 * count * by_slice
        totals[name] = (index_total, slice_total)
    for name, (by_index, by_slice) in totals.items():
        print(f"{name}: a {n}-token chunk over the 31B's 60 layers, K and V: index_copy "
              f"{by_index * 1e3:.1f} ms, slice {by_slice * 1e3:.1f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
