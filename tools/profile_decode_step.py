"""Where a decode step's GPU time goes, per kernel, at a given batch (in process; qwen3_5_moe
by default, any model with --model: a dense one has no expert or DeltaNet bytes).

    python tools/profile_decode_step.py [--model examples/qwen3_5_moe] [--sizes 1,32]
        [--quantize none,int4-experts] [--replays 30] [--profiled 10] [--kernels DIR]

For each ``--quantize`` recipe (one engine after the other, in one process): builds the engine
as `tokenpipe run --random-weights` does (``worker.main.build_engine``, via
tools/profile_qwen_resume.py), measures the engine's own decode rate at each size (bench_gpu's
measure, in process), then replays the captured greedy decode graph of each size with distinct
random token ids (so the rows route to different experts, as real sessions do):

- back to back (``--replays``): the GPU's time per step, no host turn;
- under torch.profiler (``--profiled`` replays): each kernel's calls and time per step, grouped
  (routed experts, routing, dense matmuls, DeltaNet, attention, norms, ...);
- ``--graph-events``: the engine's decode again with a CUDA event around each graph's replay
  (no profiler, whose host cost makes a decode look host-bound): GPU time a graph, the GPU's
  idle time between graphs, the host's time to launch one;
- ``--variant RECIPE:ENV=VALUE``: after that, the same engine's graphs captured again with
  the variable set (a kernel path chosen at trace time), measured and profiled again;
- the bytes a step must read: the routed experts hit (``E * (1 - (1 - k/E)^T)`` of E per layer
  with uniform routing, the random weights' case), the other weights (embedding rows aside),
  and the DeltaNet states (fp32, read and written per row), and the routed-expert kernels'
  effective TB/s over the experts' distinct bytes.

Figures go to stdout; ``--tiny`` shrinks the config for a CPU dry run (no graphs: the profile
needs CUDA).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

GROUPS = [  # (group, kernel-name pattern), first match wins
    ("experts", r"_gate_up_kernel|_down_kernel|_pair_gemv|_gated_sum_kernel|_expert|_small_m"),
    ("routing+combine", r"_route|_align|_combine_kernel"),
    ("deltanet", r"_gated_delta|_conv_step|_delta_|_gated_rms_norm"),
    ("attention", r"_decode_split|_decode_combine|_store_kv|attn|flash"),
    ("dense matmul", r"_gemv|_qgemv|_reduce_kernel|gemm|nvjet|sm90|cutlass|cublas|_mm_"),
    ("norms", r"norm"),
    ("sampling/argmax", r"argmax|reduce|sample"),
]


def log(message: str) -> None:
    print(f"[profile_decode_step {time.strftime('%H:%M:%S')}] {message}", flush=True)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


def step_bytes(model: Any, config: dict[str, Any], batch: int) -> dict[str, float]:
    """The bytes one decode step of ``batch`` rows must read (random, uniform routing)."""
    import torch

    text = config.get("text_config", config)
    # a dense model (Gemma): no experts, no DeltaNet states
    experts, top_k = int(text.get("num_experts") or 1), int(text.get("num_experts_per_tok") or 1)
    expert_bytes = dense = embed = 0
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not isinstance(t, torch.Tensor) or id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        size = t.numel() * t.element_size()
        if ".experts." in name:
            expert_bytes += size
        elif "embed" in name:
            embed += size
        else:
            dense += size
    for module in model.modules():  # quantized dense weights (K-major, packed for the GPU)
        packed = getattr(module, "device_packed", None)
        if packed is not None and id(packed) not in seen and hasattr(packed, "nbytes"):
            seen.add(id(packed))
            dense += int(packed.nbytes)
    hit = experts * (1 - (1 - top_k / experts) ** batch)
    layers = [t for t in text.get("layer_types") or [] if t == "linear_attention"]
    n_linear = len(layers) or 3 * int(text["num_hidden_layers"]) // 4
    dims = ("num_value_heads", "key_head_dim", "value_head_dim")
    heads, key, value = (int(text.get(f"linear_{name}") or 0) for name in dims)
    state = heads * key * value * 4
    return {
        "experts_hit_per_layer": hit,
        "expert_bytes_all": float(expert_bytes),
        "expert_bytes_step": expert_bytes * hit / experts,
        "dense_bytes": float(dense),
        "embedding_bytes_unread": float(embed),
        "deltanet_state_bytes_rw": 2.0 * state * n_linear * batch,
    }


def effective_times(kernels: list[tuple[str, float, float]]) -> dict[str, tuple[int, float]]:
    """name -> (calls, us) with each kernel counted from when the kernels before it had all
    ended (or its own start, if later) to its end: the step's span shared out without
    overlap, so a kernel launched early that waits is charged only after its predecessor.
    Sorted by time, largest first."""
    total: dict[str, list[float]] = {}
    done = None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        begin = start if done is None else max(start, done)
        entry = total.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += max(0.0, end - begin)
        done = end if done is None else max(done, end)
    ordered = sorted(total.items(), key=lambda kv: -kv[1][1])
    return {name: (int(calls), us) for name, (calls, us) in ordered}


def replay_profile(engine: Any, size: int, args: argparse.Namespace, vocab: int,
                   need: dict[str, float]) -> None:  # fmt: skip
    import torch
    from torch.profiler import ProfilerActivity, profile

    runner = getattr(engine.model, "runner", None)
    graph = None if runner is None else runner._graphs.get((size, False))
    if graph is None:
        log(f"size {size}: no captured greedy decode graph")
        return
    gen = torch.Generator(device="cpu").manual_seed(size)
    runner.input_ids[:size].copy_(torch.randint(10, vocab, (size,), generator=gen))
    runner.positions[:size].fill_(64)
    runner.slots[:size].copy_(torch.arange(size))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / args.replays
    log(f"size {size}: decode graph back to back {step_ms:.3f} ms a step "
        f"({size * 1000 / step_ms:.1f} tok/s of GPU time alone)")  # fmt: skip
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profiled):
            graph.replay()
        torch.cuda.synchronize()
    if args.kernels:  # every kernel of the profiled replays: name, start, end (us)
        kernels = sorted(
            (
                (e.name, e.time_range.start, e.time_range.end)
                for e in prof.events()
                if str(getattr(e, "device_type", "")).endswith("CUDA")
            ),
            key=lambda k: k[1],
        )
        out = Path(args.kernels) / f"kernels_{size}_{int(time.time())}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(kernels))
        log(f"size {size}: {len(kernels)} kernels written to {out}")
        print(f"size {size}: each kernel's time once the kernel before it ended (a dependent "
              "launch starts early and waits: its own span overlaps the one before)")  # fmt: skip
        for name, (calls, us) in effective_times(kernels).items():
            print(f"    {calls / args.profiled:6.0f} {us / args.profiled / 1000:8.3f} "
                  f"{us / max(calls, 1):8.2f}  {name[:100]}")  # fmt: skip
    rows = []
    for a in prof.key_averages():
        us = float(getattr(a, "self_device_time_total", 0) or getattr(a, "self_cuda_time_total", 0))
        if us > 0:
            rows.append((a.key, a.count / args.profiled, us / args.profiled))
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    calls = sum(r[1] for r in rows)
    print(f"size {size}: {calls:.0f} kernels a step, {total / 1000:.3f} ms of kernel time a step "
          f"(replay {step_ms:.3f} ms)")  # fmt: skip
    groups: dict[str, list[float]] = {}
    for key, count, us in rows:
        g = groups.setdefault(group_of(key), [0.0, 0.0])
        g[0] += count
        g[1] += us
    print("  by group (calls a step, ms a step, share):")
    for g, (count, us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"    {g:18s} {count:6.0f} {us / 1000:8.3f}  {100 * us / total:5.1f}%")
    print("  kernels (calls a step, ms a step, us each, name):")
    for key, count, us in rows[:40]:
        print(f"    {count:6.0f} {us / 1000:8.3f} {us / max(count, 1):8.1f}  {key[:100]}")
    experts_us = groups.get("experts", [0.0, 0.0])[1]
    if experts_us:
        tbs = need["expert_bytes_step"] / (experts_us * 1e-6) / 1e12
        print(
            f"  routed-expert kernels: {experts_us / 1000:.3f} ms a step over "
            f"{need['expert_bytes_step'] / 1e9:.2f} GB of distinct expert weights "
            f"({need['experts_hit_per_layer']:.1f} of the experts a layer): {tbs:.2f} TB/s"
        )
    floor = need["expert_bytes_step"] + need["dense_bytes"] + need["deltanet_state_bytes_rw"]
    print(
        f"  bytes a step: experts {need['expert_bytes_step'] / 1e9:.2f} GB + other weights "
        f"{need['dense_bytes'] / 1e9:.2f} GB + DeltaNet states r+w "
        f"{need['deltanet_state_bytes_rw'] / 1e9:.2f} GB = {floor / 1e9:.2f} GB: "
        f"{floor / 4.0e12 * 1e3:.2f} ms at 4.0 TB/s ({size / (floor / 4.0e12):.0f} tok/s), "
        f"{floor / 4.4e12 * 1e3:.2f} ms at 4.4 TB/s ({size / (floor / 4.4e12):.0f} tok/s)"
    )
    sys.stdout.flush()


def graph_events(engine: Any, driver: Any, size: int, vocab: int) -> None:
    """The engine's own decode of ``size`` sessions (bench_gpu's measure) with a CUDA event
    before and after each decode graph's replay (no profiler: its host cost distorts the
    picture): each graph's GPU time, the GPU's idle time between graphs, the host's time to
    launch one. The middle half of the biggest bucket's graphs."""
    import torch
    from profile_qwen_resume import decode

    lanes = getattr(engine.model, "_lanes", None)
    if not lanes:
        log(f"x{size}: no decode graph runners (CUDA graphs off)")
        return
    marks: list[tuple[int, Any, Any, float, float]] = []

    def timed_run(run: Any) -> Any:
        def wrapped(bucket: int, sample: bool) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            out = run(bucket, sample)
            end.record()
            marks.append((bucket, start, end, t0, time.perf_counter()))
            return out

        return wrapped

    originals = [lane._run for lane in lanes]
    for lane in lanes:
        lane._run = timed_run(lane._run)
    try:
        decode(driver, size, 64, vocab)
        torch.cuda.synchronize()
    finally:
        for lane, run in zip(lanes, originals, strict=True):
            lane._run = run
    biggest = max(m[0] for m in marks)
    kept = [m for m in marks if m[0] == biggest]
    first = kept[0][1]
    spans = sorted(
        (first.elapsed_time(a), first.elapsed_time(b), t0, t1) for _, a, b, t0, t1 in kept
    )
    spans = spans[len(spans) // 4 : len(spans) * 3 // 4]
    if len(spans) < 2:
        log(f"x{size}: too few graphs of bucket {biggest} to measure")
        return
    gpu = [b - a for a, b, _, _ in spans]
    idle = [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
    launch = [1e3 * (t1 - t0) for _, _, t0, t1 in spans]
    print(f"== x{size} graph events (bucket {biggest}, {len(spans)} graphs): GPU a graph "
          f"{sum(gpu) / len(gpu):.3f} ms (min {min(gpu):.3f}); GPU idle between graphs "
          f"{sum(idle) / len(idle):.3f} ms (max {max(idle):.3f}); host launch "
          f"{sum(launch) / len(launch):.3f} ms", flush=True)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "qwen3_5_moe"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quantize", default="none,int4-experts", help="recipes, one engine each")
    p.add_argument("--sizes", default="1,32", help="decode batches (captured buckets)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--profiled", type=int, default=10)
    p.add_argument("--engine-rate", action="store_true", default=True)
    p.add_argument("--no-engine-rate", dest="engine_rate", action="store_false")
    p.add_argument("--kernels", default="", help="a folder: each profiled kernel's name, "
                   "start and end (us) as JSON, for a timeline")  # fmt: skip
    p.add_argument("--graph-events", action="store_true",
                   help="the engine's decode with CUDA events around each graph: GPU time a "
                   "graph, GPU idle between graphs, host launch time (no profiler)")  # fmt: skip
    p.add_argument("--variant", action="append", default=[],
                   help="RECIPE:ENV=VALUE: that recipe's graphs captured again with the "
                   "variable set, then measured and profiled again (repeatable)")  # fmt: skip
    args = p.parse_args()

    import torch
    from profile_qwen_resume import Driver, decode, model_dir

    from worker.main import build_engine

    config_path = Path(args.model)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    where = model_dir(config_path, args.tiny, Path(tempfile.mkdtemp()) / "model")
    config = json.loads((where / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    sizes = [int(s) for s in args.sizes.split(",") if s]
    on_cuda = args.device.startswith("cuda")
    for recipe in [r for r in args.quantize.split(",") if r]:
        t = time.perf_counter()
        engine: Any = build_engine(
            str(where), str(where / "tokenizer.json"), args.device,
            "bfloat16" if on_cuda else "float32", max(sizes) + 1, args.context, None, None,
            True, True, 0, None, cuda_graphs=on_cuda, quantize=recipe,
        )  # fmt: skip
        log(f"{recipe}: engine built in {time.perf_counter() - t:.1f} s")
        if on_cuda:
            log(f"{recipe}: GPU memory allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
        driver = Driver(engine, torch.cuda.synchronize if on_cuda else (lambda: None))
        if args.engine_rate:
            for s in sizes:
                decode(driver, s, 64, vocab)
        if args.graph_events and on_cuda:
            for s in sizes:
                graph_events(engine, driver, s, vocab)
        model = getattr(engine.model, "inner", engine.model)
        for s in sizes:
            need = step_bytes(model, config, s)
            if on_cuda:
                print(f"== {recipe}, {s} rows")
                replay_profile(engine, s, args, vocab, need)
            else:
                log(f"{recipe} x{s}: bytes {need}")
        for variant in args.variant:
            name, _, setting = variant.partition(":")
            if name != recipe or not on_cuda:
                continue
            key, _, value = setting.partition("=")
            os.environ[key] = value
            runner = engine.model.runner
            for s in sizes:  # the decode graphs captured again under the setting
                runner._graphs.pop((s, False), None)
                runner.capture(False, [s])
            log(f"{recipe} with {setting}: graphs captured again")
            if args.engine_rate:
                for s in sizes:
                    decode(driver, s, 64, vocab)
            for s in sizes:
                print(f"== {recipe} with {setting}, {s} rows")
                replay_profile(engine, s, args, vocab, step_bytes(model, config, s))
        del engine, driver, model
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
