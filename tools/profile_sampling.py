"""Where a sampled decode step's extra time goes: the sampler alone on [B, vocab] float32
logits, in process, before (the per-row sorting sampler this replaced) and now.

    python tools/profile_sampling.py --device cuda --vocab 262144 --batches 1,32

Per case: host wall time of one call up to its ids on the host (`.tolist()`, the engine's
one sync), and the GPU time between CUDA events around the call (median of --repeat).
`--kernel-slots 0,1024` adds the GPU time of the Triton kernel alone per candidate-slot count
(0: top-k by bisection, the kernel before compaction; 1024: the default); "N/wW" runs W
warps a row (default 16).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.device.kernels.batched_sampling import (  # noqa: E402
    RowSampling,
    sample_rows_triton,
    sampling_tensors,
)
from worker.engine.sampling import SamplingParams, make_generator, sample  # noqa: E402

CASES = {
    "greedy": SamplingParams(),
    "t0.8 p0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "t0.8 k40": SamplingParams(temperature=0.8, top_k=40),
    "t0.8 m0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "t1": SamplingParams(temperature=1.0),
}


def sample_before(logits: torch.Tensor, params: list[SamplingParams], gens: list) -> torch.Tensor:  # type: ignore[type-arg]
    """The sampler before issue 21 (worker/engine/sampling.py at c832e09): a Python loop over
    rows, each sorting its whole row for top-p, noise from a torch.Generator."""
    logits = logits.float()
    out = torch.argmax(logits, dim=-1)
    for row, (p, gen) in enumerate(zip(params, gens, strict=True)):
        if p.greedy:
            continue
        scaled = logits[row] / p.temperature
        vocab = scaled.shape[-1]
        if 0 < p.top_k < vocab:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, -math.inf)
        if p.min_p > 0.0:
            scaled = scaled.masked_fill(scaled < scaled.max() + math.log(p.min_p), -math.inf)
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            scaled = scaled.masked_fill(drop, -math.inf)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=gen)
        out[row] = torch.argmax(probs / noise)
    return out


def kernel_ms(logits: torch.Tensor, params: SamplingParams, variant: str, repeat: int) -> float:
    """Median GPU ms of the Triton kernel alone: variant "N" or "N/wW"."""
    slots, _, warps = variant.partition("/")
    batch = logits.shape[0]
    row = RowSampling(params.temperature, params.top_k, params.top_p, params.min_p, seed=5)
    tensors = sampling_tensors([row] * batch, list(range(batch)), logits.device)
    times = []
    for i in range(repeat + 3):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        sample_rows_triton(logits, *tensors, slots=int(slots), warps=int(warps[1:] or 0))
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=262_144)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--scale", type=float, default=1.5, help="std of the random logits")
    p.add_argument("--kernel-slots", default="", help="e.g. 0,1024: kernel-alone GPU columns")
    args = p.parse_args()
    slot_counts = [n for n in args.kernel_slots.split(",") if n]
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    print(f"device {torch.cuda.get_device_name(dev) if cuda else 'cpu'}, vocab {args.vocab}")
    extra = "".join(f" kernel {n}: GPU ms |" for n in slot_counts)
    head = "| batch | case | before: wall ms | before: GPU ms | now: wall ms | now: GPU ms |"
    print(head + extra)
    print("| --- " * (6 + len(slot_counts)) + "|")
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, args.vocab, device=dev) * args.scale
        for name, params in CASES.items():
            figures = []
            gens = list(range(batch))
            for before in (True, False):
                walls, gpus = [], []
                for i in range(args.repeat + 3):
                    if before:
                        gens = [torch.Generator(device=dev) for _ in range(batch)]
                        args_ = (logits, [params] * batch, gens)
                    else:
                        args_ = (logits, [params] * batch, [make_generator(0) for _ in gens])
                    fn = sample_before if before else sample
                    if cuda:
                        torch.cuda.synchronize(dev)
                        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                        start.record()
                    t0 = time.perf_counter()
                    ids = fn(*args_)  # type: ignore[operator]
                    if cuda:
                        end.record()
                    ids.tolist()
                    wall = time.perf_counter() - t0
                    if i >= 3:
                        walls.append(wall * 1e3)
                        if cuda:
                            gpus.append(start.elapsed_time(end))
                figures += [statistics.median(walls), statistics.median(gpus) if gpus else math.nan]
            figures += [kernel_ms(logits, params, n, args.repeat) for n in slot_counts]
            print(f"| {batch} | {name} | " + " | ".join(f"{f:.3f}" for f in figures) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
