"""Decode attention on the Gemma 4 31B layer shapes: the Triton split kernel at its chosen
config (``decode_attention._split_config``) and a sweep of other configs, beside the torch
reference it replaces (``reference.decode_attention_reference``: a gather of each row's
entries, then SDPA), at 1 and 32 rows and a few context lengths. Each row's KV lies in its
own slot, and the calls cycle over several sets of slots so L2 does not hold them. Ours
timed in a CUDA graph, torch's launched one by one (it reads the lengths on the host); us a
call and the KV bytes read per us (TB/s). CUDA only.

    python tools/bench_decode_attention.py [--rows 1,32] [--contexts 90,512,1000]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [  # name, Hq, Hkv, D, ring capacity, window
    ("sliding", 32, 16, 256, 1024, 1024),
    ("full", 32, 4, 512, 8192, 0),
]
SWEEP = [(bn, 4, st) for bn in (16, 32, 64) for st in (2, 3, 4)] + [(32, 8, 2), (32, 8, 3)]


def graph_us(fn: Any, slot_sets: list[torch.Tensor], reps: int = 5) -> float:
    """us a call: the calls over every slot set, captured 5 times in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for slots in slot_sets:
            fn(slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(5):
            for slots in slot_sets:
                fn(slots)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * 5 * len(slot_sets))


def eager_us(fn: Any, slot_sets: list[torch.Tensor], reps: int = 5) -> float:
    """us a call, launched one by one (wall time over the calls, synchronized at the ends)."""
    for slots in slot_sets:
        fn(slots)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        for slots in slot_sets:
            fn(slots)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / (reps * len(slot_sets))


def call(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
         window: int, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return fn(q, k, v, slots, lens, sm_scale=q.shape[-1] ** -0.5, window=window)


def bench_shape(shape: tuple[Any, ...], rows: int, contexts: list[int], sweep: bool) -> None:
    from worker.device.kernels import decode_attention as da
    from worker.device.kernels.reference import decode_attention_reference

    name, hq, hkv, dim, capacity, window = shape
    chosen = da._split_config
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copies = max(4, 48 // rows)
    gen = torch.Generator(device=dev).manual_seed(rows)
    k = torch.randn(rows * copies + 1, hkv, capacity, dim, device=dev, dtype=torch.bfloat16,
                    generator=gen)  # fmt: skip
    v = torch.randn(k.shape, device=dev, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(rows, hq, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    sets = [torch.arange(c * rows, (c + 1) * rows, device=dev) for c in range(copies)]
    for context in contexts:
        lens = torch.randint(max(1, context - 40), context + 41, (rows,), device=dev,
                             generator=gen)  # fmt: skip
        kv = sum(min(int(n), capacity) for n in lens.tolist()) * hkv * dim * 2 * 2
        ours = functools.partial(call, da.decode_attention_triton, q, k, v, lens, window)
        ref = functools.partial(call, decode_attention_reference, q, k, v, lens, window)
        err = (ours(sets[0]).float() - ref(sets[0]).float()).abs().max().item()
        t_ours = graph_us(ours, sets)
        t_torch = eager_us(ref, sets)  # it reads the lengths on the host: no graph
        best = ""
        if sweep:
            timings = []
            for config in SWEEP:
                da._split_config = lambda _d, _b, c=config: c  # type: ignore[assignment]
                try:
                    timings.append((graph_us(ours, sets), config))
                except Exception:  # noqa: BLE001 - a config over the shared memory
                    continue
                finally:
                    da._split_config = chosen
            t, c = min(timings)
            best = f"{c}: {t:.2f} ({kv / t / 1e6:.2f})"
        splits = da.choose_num_splits(rows, hkv, capacity, sms)
        note = "" if err < 0.02 else f" max difference {err:.3g}"
        print(f"| {name} | {rows} | ~{context} | {splits} | {chosen(dim, rows)} | "
              f"{t_ours:.2f} ({kv / t_ours / 1e6:.2f}) | {t_torch:.2f} | {best} |{note}",
              flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,32")
    p.add_argument("--contexts", default="90,512,1000", help="rows' mean length (+-40)")
    p.add_argument("--no-sweep", action="store_true", help="the chosen config and torch only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention: needs CUDA")
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"# {torch.cuda.get_device_name()}; (BLOCK_N, warps, stages): us a call (TB/s)")
    print("| shape | rows | context | splits | chosen config | chosen | torch | best of sweep |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape, rows in itertools.product(SHAPES, [int(r) for r in args.rows.split(",")]):
        bench_shape(shape, rows, contexts, not args.no_sweep)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
