"""Prefill attention on the Gemma 4 31B layer shapes: the Triton flash kernel (a sweep of
tile configs) against the torch path it replaces (SDPA with a band mask / repeated KV
heads), with the largest difference between the two. CUDA only.

    python tools/bench_gpu_kernels.py [--lengths 2048,8192]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.device.kernels.prefill_attention import CONFIGS, prefill_attention_triton  # noqa: E402
from worker.layers.attention import _sdpa  # noqa: E402

SHAPES = [  # name, Hq, Hkv, D, window
    ("sliding", 32, 16, 256, 1024),
    ("full", 32, 4, 512, 0),
]
SWEEP = {
    256: [(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2)],
    512: [(64, 32, 8, 1), (64, 32, 8, 2), (32, 32, 4, 2), (64, 64, 8, 1), (128, 32, 8, 1)],
}


def timed(fn: Any, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def flops(n: int, hq: int, dim: int, window: int) -> float:
    """2 matmuls x 2 FLOPs per (query, visible key, head, dim)."""
    visible = sum(min(i + 1, window) if window else i + 1 for i in range(n))
    return 4.0 * visible * hq * dim


def bench_shape(name: str, hq: int, hkv: int, dim: int, window: int, n: int) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n)
    q = torch.randn(n, hq, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(n, hkv, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(n, hkv, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    scale = dim**-0.5
    work = flops(n, hq, dim, window)
    pos = torch.arange(n, device=dev)
    mask = None
    if window:
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))

    def torch_path() -> torch.Tensor:
        return _sdpa(q4, k4, v4, mask, mask is None, scale)

    ref = torch_path()[0].transpose(0, 1)
    seconds = timed(torch_path)
    print(f"| {name} | {n} | torch SDPA | - | {seconds * 1e3:.2f} | "
          f"{work / seconds / 1e12:.0f} | - |", flush=True)  # fmt: skip
    out = torch.empty_like(q)
    for config in SWEEP[dim]:

        def run(config: Any = config) -> torch.Tensor:
            return prefill_attention_triton(
                q, k, v, out, cached=0, sm_scale=scale, window=window, config=config
            )

        try:
            seconds = timed(run)
            diff = (run().float() - ref.float()).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a config that does not fit
            print(f"| {name} | {n} | triton | {config} | failed: {type(exc).__name__} | | |",
                  flush=True)  # fmt: skip
            continue
        chosen = " (default)" if CONFIGS.get(dim) == config else ""
        print(f"| {name} | {n} | triton | {config}{chosen} | {seconds * 1e3:.2f} | "
              f"{work / seconds / 1e12:.0f} | {diff:.3g} |", flush=True)  # fmt: skip


def bench_warm(name: str, hq: int, hkv: int, dim: int, window: int, n: int, cached: int) -> None:
    """A short prompt over a long resident prefix (the warm-resume case): the kernel as
    shipped, a copy specialised on lengths, smaller query tiles, and the torch path."""
    import triton

    from worker.device.kernels import prefill_attention as pa
    from worker.layers.attention import ring_positions

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n + cached)
    q = torch.randn(n, hq, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(n, hkv, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(n, hkv, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    prev = cached if not window else window + 16
    kp = torch.randn(hkv, prev, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    vp = torch.randn(hkv, prev, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    pos = ring_positions(cached, prev, dev).to(torch.int32) if window else None
    out = torch.empty_like(q)
    base = pa.fit_config(pa.CONFIGS[dim], dim, 2)
    kwargs = dict(cached=cached, sm_scale=dim**-0.5, window=window, k_prev=kp, v_prev=vp,
                  prev_pos=pos)  # fmt: skip
    rows = []
    for block_m in (base[0], 32, 16):
        config = (block_m, *base[1:])
        seconds = timed(lambda c=config: pa.prefill_attention_triton(q, k, v, out, **kwargs,
                                                                       config=c))  # fmt: skip
        rows.append((f"triton M={block_m}", seconds))
    shipped = pa._prefill_kernel
    pa._prefill_kernel = triton.jit(shipped.fn)  # specialised on every integer argument
    try:
        seconds = timed(lambda: pa.prefill_attention_triton(q, k, v, out, **kwargs))
        rows.append(("triton, length-specialised", seconds))
    finally:
        pa._prefill_kernel = shipped
    for label, seconds in rows:
        print(f"| {name}, {n} new over {cached} | {label} | {seconds * 1e6:.0f} us |", flush=True)


GEMV_SHAPES = [  # name, K, N (the 31B layer matrices, merged as on the GPU)
    ("qkv sliding", 5376, 16384), ("qk full", 5376, 18432), ("o sliding", 8192, 5376),
    ("o full", 16384, 5376), ("gate_up", 5376, 43008), ("down", 21504, 5376),
    ("lm head", 5376, 262144),
]  # fmt: skip
GEMV_SWEEP = [(16, 256, 4, 4), (8, 512, 4, 4), (32, 128, 4, 4), (16, 512, 8, 3),
              (4, 1024, 4, 3), (8, 256, 4, 6), (32, 256, 8, 3), (64, 128, 8, 3)]  # fmt: skip


def bench_gemv(rows: int) -> None:
    from worker.device.kernels.gemv import gemv_triton
    from worker.device.kernels.gemv import graph_seconds as graph_time

    dev = torch.device("cuda")
    print(f"| matrix (rows={rows}) | kernel | us | TB/s | max diff |")
    print("| --- | --- | --- | --- | --- |")
    for name, k, n in GEMV_SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        seconds = graph_time(lambda w=w, x=x: torch.nn.functional.linear(x, w))
        rate = w.numel() * 2 / seconds / 1e12
        print(f"| {name} | F.linear | {seconds * 1e6:.1f} | {rate:.2f} | - |", flush=True)
        for config in GEMV_SWEEP:
            try:
                seconds = graph_time(lambda w=w, x=x, c=config: gemv_triton(x, w, c))
                diff = (gemv_triton(x, w, config).float() - ref.float()).abs().max().item()
            except Exception as exc:  # noqa: BLE001
                print(f"| {name} | {config} | failed: {type(exc).__name__} | | |", flush=True)
                continue
            print(f"| {name} | {config} | {seconds * 1e6:.1f} | "
                  f"{w.numel() * 2 / seconds / 1e12:.2f} | {diff:.3g} |", flush=True)  # fmt: skip
        del w, x, ref
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--warm-only", action="store_true")
    parser.add_argument("--gemv", action="store_true", help="only the decode GEMV sweep")
    args = parser.parse_args()
    if args.gemv:
        bench_gemv(1)
        bench_gemv(4)
        return
    print("| case | kernel | time |\n| --- | --- | --- |")
    bench_warm("full", 32, 4, 512, 0, 64, 4096)
    bench_warm("sliding", 32, 16, 256, 1024, 64, 4096)
    if args.warm_only:
        return
    print("| layer | tokens | kernel | config (M, N, warps, stages) | ms | TFLOP/s | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, hq, hkv, dim, window in SHAPES:
        for n in (int(x) for x in args.lengths.split(",")):
            bench_shape(name, hq, hkv, dim, window, n)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
