"""Profile a short prefill on top of a long resident context (the warm TTFT case) on CUDA.

python tools/profile_gpu_prefill.py [--config examples/gemma4_31b/config.json] [--resident 4096]
Prints wall time per prefill and the top CUDA kernels / CPU ops of one warm prefill.

python tools/profile_gpu_prefill.py --kv-dtypes auto,fp8 [--prompt 16384] [--chunk 2048]
is a same-process A/B of KV cache formats: one model, one cache of each format, a cold
chunked prefill of the whole prompt timed in each in turn (rounds alternate the order), then
one profiled prompt each and the kernels whose GPU time differs most between them.

Weights are random bf16; `--quantize int4|int8` draws them quantized through the worker's own
load path instead (what `tokenpipe run --random-weights --quantize` and bench_gpu load), so
the A/B can be taken on the weights a worker measurement had.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from worker.device.cuda_setup import prepare_model_for_device
from worker.device.kernels.random_weights import init_random_weights_on_device
from worker.models.config import ModelConfig
from worker.models.registry import build_model
from worker.models.step import StepInput


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="examples/gemma4_31b/config.json")
    parser.add_argument("--resident", type=int, default=4096)
    parser.add_argument("--extra", type=int, default=64)
    parser.add_argument("--decode", type=int, default=0, help="also time N batch-1 decode steps")
    parser.add_argument("--kv-dtypes", default="", help="e.g. auto,fp8: the A/B of cache formats")
    parser.add_argument("--prompt", type=int, default=16384, help="the A/B's prompt tokens")
    parser.add_argument("--chunk", type=int, default=2048, help="the A/B's prefill chunk")
    parser.add_argument("--rounds", type=int, default=3, help="the A/B's timed prompts a format")
    parser.add_argument(
        "--quantize", default="none", choices=("none", "int8", "int4"),
        help="random weights drawn quantized (the worker's load path), not bf16",
    )  # fmt: skip
    args = parser.parse_args()
    dev = torch.device("cuda")
    cfg = ModelConfig.from_hf(json.load(open(args.config)))
    model = random_model(Path(args.config), dev, args.quantize)
    model = prepare_model_for_device(SimpleNamespace(model=model), dev, True, 0)
    if args.kv_dtypes:
        cache_dtype_ab(model, args.kv_dtypes.split(","), args.prompt, args.chunk, args.rounds)
        return
    kv = model.make_kv_cache(2, args.resident + args.extra + 16)
    vocab = cfg.vocab_size if hasattr(cfg, "vocab_size") else 1000
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, vocab, (args.resident,), generator=gen)
    extra = torch.randint(0, vocab, (args.extra,), generator=gen)

    def step(ids: torch.Tensor, cached: int) -> None:
        model(StepInput.single(ids.tolist(), 0, cached, dev), kv)

    for start in range(0, args.resident, 2048):
        step(base[start : start + 2048], start)
    torch.cuda.synchronize()
    for _ in range(5):
        t = time.perf_counter()
        step(extra, args.resident)
        torch.cuda.synchronize()
        print(
            f"warm prefill of {args.extra} on {args.resident}: "
            f"{(time.perf_counter() - t) * 1000:.1f} ms",
            flush=True,
        )
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(extra, args.resident)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    if args.decode:
        profile_decode(model, kv, args.resident + args.extra, args.decode)
    time_prefill_graphs(model, args.resident)


def random_model(config: Path, device: torch.device, quantize: str) -> Any:
    """The config's model with random weights: bf16 drawn on the device (``none``), or int4 /
    int8 drawn quantized by ``load_model(random_weights=True, quantize=...)``, the worker's own
    path, from a directory with the config and bench_gpu's synthetic tokenizer."""
    if quantize == "none":
        model = build_model(ModelConfig.from_hf(json.loads(config.read_text())), device,
                            torch.bfloat16)  # fmt: skip
        init_random_weights_on_device(model, 0)
        return model
    from bench_gpu import make_model_dir

    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions

    with tempfile.TemporaryDirectory() as tmp:
        where = make_model_dir(config, False, Path(tmp) / "model")
        loaded = load_model(where, device, torch.bfloat16, random_weights=True,
                            quantize=QuantizeOptions(quantize))  # fmt: skip
    return loaded.model


def cache_dtype_ab(model: Any, names: list[str], prompt: int, chunk: int, rounds: int) -> None:
    """The same cold chunked prefill into a cache of each format, eager as a worker runs a
    long prompt's chunks (a cache that is not the graphs' own goes to the eager model)."""
    from torch.profiler import ProfilerActivity, profile

    from worker.layers.kv import kv_cache_dtype

    inner = getattr(model, "inner", model)
    dev = inner.device
    cuda = dev.type == "cuda"  # the CPU runs it too (its test)
    caches = {n: inner.make_kv_cache(1, prompt + 16, kv_dtype=kv_cache_dtype(n)) for n in names}
    vocab = getattr(inner.config, "vocab_size", 1000)
    ids = torch.randint(0, vocab, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def run(kv: Any) -> float:
        sync()
        start = time.perf_counter()
        for first in range(0, prompt, chunk):
            inner(StepInput.single(ids[first : first + chunk], 0, first, dev), kv)
        sync()
        return time.perf_counter() - start

    for kv in caches.values():
        run(kv)  # compiles, allocator
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            times[n].append(run(caches[n]))
    base = min(times[names[0]])
    for n in names:
        best = min(times[n])
        print(
            f"kv {n}: {prompt} tokens in chunks of {chunk}: best {best * 1000:.1f} ms "
            f"({prompt / best:,.0f} tok/s, {best / base - 1:+.1%} against {names[0]}); "
            f"all {', '.join(f'{t * 1000:.1f}' for t in times[n])} ms",
            flush=True,
        )
    # the GPU's kernels; on the CPU, its ops' own time
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    kernels: dict[str, dict[str, float]] = {}
    for n in names:
        with profile(activities=[activity]) as prof:
            run(caches[n])
        for event in prof.key_averages():
            us = event.device_time_total if cuda else event.self_cpu_time_total
            kernels.setdefault(event.key, {})[n] = us / 1000  # ms
    totals = {n: sum(k.get(n, 0.0) for k in kernels.values()) for n in names}
    print("kernel GPU time a prompt (ms): " + ", ".join(f"{n} {t:.1f}" for n, t in totals.items()))
    a, b = names[0], names[-1]
    rows = sorted(kernels.items(), key=lambda item: -abs(item[1].get(b, 0.0) - item[1].get(a, 0.0)))
    print(f"| kernel | {' | '.join(names)} | {b} - {a} |")
    for key, ms in rows[:16]:
        cells = " | ".join(f"{ms.get(n, 0.0):.2f}" for n in names)
        print(f"| {key[:90]} | {cells} | {ms.get(b, 0.0) - ms.get(a, 0.0):+.2f} |")


def time_prefill_graphs(model: object, cached: int, steps: int = 10) -> None:
    """GPU time of each captured prefill graph: one call of each size sets its inputs (slot
    0, `cached` tokens resident), then replays alone."""
    runner = getattr(model, "prefill", None)
    if runner is None:
        print("no prefill graphs")
        return
    for size, graph in sorted(runner._graphs.items()):
        if cached + size > runner.kv.max_context:
            continue
        runner.logits(StepInput.single([5] * size, 0, cached, runner.device))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1000 / steps
        print(f"prefill graph {size} over {cached}: {ms:.2f} ms per replay")


def profile_decode(model: object, kv: object, cached: int, steps: int) -> None:
    """Batch-1 decode: the graph replay alone (GPU time per step) against the model call the
    engine makes (StepInput built on the host, inputs copied, replay, argmax, one sync)."""
    runner = getattr(model, "runner", None)
    if runner is None:
        print("no graph runner: skipping the decode timing")
        return
    dev = runner.device
    runner.logits(StepInput.single([5], 0, cached, dev))
    graph = runner._graphs[(1, False)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - start) * 1000 / steps
    start = time.perf_counter()
    for i in range(steps):
        logits = model(StepInput.single([5], 0, cached + i, dev), kv)  # type: ignore[operator]
        torch.argmax(logits, dim=-1).tolist()
    call_ms = (time.perf_counter() - start) * 1000 / steps
    print(
        f"decode batch 1: graph replay {replay_ms:.2f} ms/step ({1000 / replay_ms:.1f} tok/s); "
        f"model call + argmax + sync {call_ms:.2f} ms/step ({1000 / call_ms:.1f} tok/s)"
    )


if __name__ == "__main__":
    main()
