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

from worker.kernels.prefill_attention import CONFIGS, prefill_attention_triton  # noqa: E402
from worker.models.attention import _sdpa  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2048,8192")
    args = parser.parse_args()
    print("| layer | tokens | kernel | config (M, N, warps, stages) | ms | TFLOP/s | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, hq, hkv, dim, window in SHAPES:
        for n in (int(x) for x in args.lengths.split(",")):
            bench_shape(name, hq, hkv, dim, window, n)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
