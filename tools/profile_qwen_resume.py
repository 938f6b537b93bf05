"""Where a hybrid model's (qwen3_5_moe) warm resume and decode steps spend their time, in process.

    python tools/profile_qwen_resume.py [--model examples/qwen3_5_moe] [--quantize int4]
        [--sessions 1,32] [--resident 4096] [--extra 64] [--profile] [--fla-configs]

Builds the engine as `tokenpipe run --random-weights` does (``worker.main.build_engine``: the
CUDA set-up, decode graphs, the prefill warm-up), with no worker process and no pipes, then:

- TTFT (``--resident`` > 0): bench_gpu's sequence on one named session (a resident prompt, a
  first warm turn of the same shape, a rollback to the resident prompt, then the timed turn of
  ``--extra`` new tokens) and a cold prompt of the same length; each request's wall time to its
  first token, the engine's ``prefill_ms``, and every ``engine.step()`` of the timed turns with
  a CUDA sync after it (``--profile``: torch.profiler over the timed turns: the top CUDA kernels
  and CPU ops, and the number of kernel launches);
- decode: ``--sessions`` batches of requests decoding at once, aggregate tok/s over the window
  in which all of them decode (bench_gpu's measure);
- ``--fla-configs``: the configs fla's autotuner chose in this process, as JSON (the start-up
  can read them instead of autotuning);
- ``--replay N``: the batch-1 decode graph replayed N times back to back, last (the GPU's time
  per step without the host's turn between steps).

Figures go to stdout; ``--tiny`` shrinks the config for a CPU dry run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = {  # the tests' tiny qwen3_5_moe (tests/worker/test_models_qwen3_5_moe.py)
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 32, "layer_types": None,
}  # fmt: skip


def log(message: str) -> None:
    print(f"[profile_qwen_resume {time.strftime('%H:%M:%S')}] {message}", flush=True)


def model_dir(config_path: Path, tiny: bool, where: Path) -> Path:
    import tokenizers
    from tokenizers.models import WordLevel

    config = json.loads(config_path.read_text())
    if tiny:
        text = config.get("text_config", config)
        text.update({k: v for k, v in TINY.items() if v is not None})
        text.pop("layer_types", None)
        config["vocab_size"] = TINY["vocab_size"]
    config["eos_token_id"] = []  # random weights must not end a timed generation
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(config))
    vocab = {f"<t{i}>": i for i in range(int(config.get("vocab_size") or 256))}
    tokenizers.Tokenizer(WordLevel(vocab, unk_token="<t3>")).save(str(where / "tokenizer.json"))
    return where


class Driver:
    """Requests into the engine, steps until they are done; each event with its time."""

    def __init__(self, engine: Any, sync: Any) -> None:
        self.engine, self.sync = engine, sync
        self.next_id = 0
        self.step_ms: list[float] = []

    def ask(self, msg: dict[str, Any]) -> None:
        from protocol import decode_request

        self.next_id += 1
        for event in self.engine.submit(decode_request(json.dumps({**msg, "id": self.next_id}))):
            if type(event).__name__ == "ErrorEvent" and msg.get("op") != "close":
                raise RuntimeError(f"{msg}: {event}")

    def generate(self, requests: list[dict[str, Any]], time_steps: bool = False) -> dict:
        """-> {id: [(t, event)]} and the start time under key 't0'."""
        from protocol import decode_request

        out: dict[Any, Any] = {}
        t0 = time.perf_counter()
        pending = set()
        for req in requests:
            self.next_id += 1
            rid = self.next_id
            msg = {"add_prefix": False, "temperature": 0.0, **req, "id": rid}
            out[rid] = [(time.perf_counter(), e) for e in self.engine.submit(
                decode_request(json.dumps(msg).encode()))]  # fmt: skip
            pending.add(rid)
        self.step_ms = []
        while pending:
            s = time.perf_counter()
            events = self.engine.step()
            if time_steps:
                self.sync()
                self.step_ms.append((time.perf_counter() - s) * 1000)
            now = time.perf_counter()
            for event in events:
                rid = getattr(event, "id", None)
                if rid in out:
                    out[rid].append((now, event))
                    kind = type(event).__name__
                    if kind in ("DoneEvent", "ErrorEvent"):
                        pending.discard(rid)
                        if kind == "ErrorEvent":
                            raise RuntimeError(f"request failed: {event}")
        out["t0"] = t0
        return out


def first_token_s(lines: list[tuple[float, Any]], t0: float) -> float:
    for t, event in lines:
        if type(event).__name__ == "TokenEvent":
            return t - t0
    return lines[-1][0] - t0


def ids(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def ttft(driver: Driver, args: argparse.Namespace, vocab: int, profile: Any) -> None:
    """bench_gpu's TTFT sequence, timed turn by turn."""
    base, more = ids(args.resident, vocab, 7), ids(args.extra, vocab, 8)
    driver.ask({"op": "open", "session_id": "warm"})

    def turn(name: str, prompt: list[int], new: int, timed: bool = False) -> None:
        req: dict[str, Any] = {"max_new_tokens": new, "prompt_segments": [{"ids": prompt}]}
        req["session_id"] = "warm"
        if name.startswith("cold"):  # a fresh named session each, as bench_gpu's cold runs
            driver.ask({"op": "close", "session_id": "cold"})
            driver.ask({"op": "open", "session_id": "cold"})
            req["session_id"] = "cold"
        res = driver.generate([req], time_steps=timed)
        lines = next(v for k, v in res.items() if k != "t0")
        done = lines[-1][1]
        log(
            f"{name}: {len(prompt)} ids, first token {first_token_s(lines, res['t0']) * 1000:.1f}"
            f" ms; prefilled {done.prefilled_prompt_tokens}, reused {done.reused_prompt_tokens},"
            f" reset {done.session_reset_reason}, prefill_ms {done.prefill_ms}"
            + (f"; steps (ms, synced) {[round(x, 2) for x in driver.step_ms]}" if timed else "")
        )

    turn("resident", base, 0)
    turn("first warm turn", base + ids(args.extra, vocab, 9), 0)
    turn("rollback to resident", base, 0)
    tuned = autotuned_keys()
    turn("warm (timed)", base + more, 1, timed=True)
    turn("rollback to resident again", base, 0)
    turn("warm again (timed)", base + ids(args.extra, vocab, 10), 1, timed=True)
    # the last turn's new tokens replaced by others in one request: back to the snapshot at
    # the resident prompt's end, then the new ones
    turn("rollback 64 + 64 new (timed)", base + ids(args.extra, vocab, 16), 1, timed=True)
    turn("cold (timed)", ids(args.resident + args.extra, vocab, 11), 1, timed=True)
    turn("cold again (timed)", ids(args.resident + args.extra, vocab, 12), 1, timed=True)
    log(f"fla autotune keys added by the timed turns: {autotuned_keys() - tuned}")
    if args.cprofile:
        import cProfile
        import pstats

        turn("rollback for cProfile", base, 0)
        host = cProfile.Profile()
        host.enable()
        turn("warm (cProfile)", base + ids(args.extra, vocab, 15), 1)
        host.disable()
        pstats.Stats(host).sort_stats("cumulative").print_stats(35)
    if args.cprofile_cold:  # a stateless prompt of the cold length, as bench_gpu's prefill
        import cProfile
        import pstats

        prompt = ids(args.resident + args.extra, vocab, 17)
        driver.generate([{"max_new_tokens": 0, "prompt_segments": [{"ids": prompt}]}])
        host = cProfile.Profile()
        t = time.perf_counter()
        host.enable()
        driver.generate([{"max_new_tokens": 0, "prompt_segments": [{"ids": prompt[::-1]}]}])
        host.disable()
        log(f"stateless cold (cProfile): {(time.perf_counter() - t) * 1000:.1f} ms")
        pstats.Stats(host).sort_stats("tottime").print_stats(30)
    if profile is None:
        return
    turn("rollback for the profile", base, 0)
    with profile() as prof:
        turn("warm (profiled)", base + ids(args.extra, vocab, 13), 1)
    report(prof, "warm turn")
    with profile() as prof:
        turn("cold (profiled)", ids(args.resident + args.extra, vocab, 14), 1)
    report(prof, "cold turn")


def report(prof: Any, what: str) -> None:
    averages = prof.key_averages()
    launches = sum(
        a.count for a in averages if a.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                               "cudaLaunchKernelExC", "cuLaunchKernelEx")
    )  # fmt: skip
    graphs = sum(a.count for a in averages if a.key == "cudaGraphLaunch")
    log(f"{what}: {launches} kernel launches, {graphs} graph launches")

    def gpu_us(a: Any) -> float:
        total = getattr(a, "self_device_time_total", 0) or getattr(a, "self_cuda_time_total", 0)
        return float(total)

    kernels = sorted((a for a in averages if gpu_us(a) > 0), key=gpu_us, reverse=True)
    total = sum(gpu_us(a) for a in kernels)
    count = sum(a.count for a in kernels)
    print(f"GPU ops: {count} calls, {total / 1000:.2f} ms of GPU time; top 30 (calls, ms, name):")
    for a in kernels[:30]:
        print(f"  {a.count:6d} {gpu_us(a) / 1000:8.3f}  {a.key[:90]}")
    cpu = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
    print("top self CPU (calls, ms, name):")
    for a in cpu:
        print(f"  {a.count:6d} {a.self_cpu_time_total / 1000:8.3f}  {a.key[:90]}")


def decode(driver: Driver, sessions: int, new: int, vocab: int) -> None:
    new = max(new, 2 * sessions + 32)
    reqs = [{"prompt_segments": [{"ids": ids(32, vocab, 100 + i)}], "max_new_tokens": new}
            for i in range(sessions)]  # fmt: skip
    res = driver.generate(reqs)
    firsts, ends, stamps = [], [], []
    for rid, lines in res.items():
        if rid == "t0":
            continue
        tokens = [t for t, e in lines if type(e).__name__ == "TokenEvent"]
        firsts.append(tokens[0] if tokens else lines[-1][0])
        ends.append(lines[-1][0])
        stamps.extend(tokens)
    start, end = max(firsts), min(ends)
    window = sum(1 for t in stamps if start < t <= end)
    rate = window / (end - start) if end > start else 0.0
    log(f"decode x{sessions}: {rate:.1f} tok/s aggregate ({window} tokens in {end - start:.3f} s)")


def first_config_only() -> None:
    """``--fla-first-config``: every Triton autotuner tries only its first config (one compile
    each, not dozens: fla's prefill kernels take most of a cold start's autotuning)."""
    from triton.runtime.autotuner import Autotuner

    def prune(self: Any, kwargs: dict[str, Any], *rest: Any) -> list[Any]:
        return list(self.configs[:1])

    Autotuner.prune_configs = prune  # type: ignore[method-assign]


def autotuned_keys() -> int:
    """How many (kernel, key) pairs the fla autotuners hold: one more means a new autotune."""
    return sum(len(v) for v in fla_configs().values())


def fla_configs() -> dict[str, Any]:
    """kernel name -> {autotune key: chosen config} of every fla autotuner that ran."""
    from triton.runtime.autotuner import Autotuner

    chosen: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in list(vars(module).values()):
            if not isinstance(value, Autotuner) or not value.cache:
                continue
            kernel = getattr(value, "kernel_name", None) or value.base_fn.__name__
            chosen[kernel] = {
                json.dumps(list(key), default=str): {
                    "kwargs": dict(config.kwargs),
                    "num_warps": config.num_warps,
                    "num_stages": config.num_stages,
                    "num_ctas": getattr(config, "num_ctas", 1),
                    "maxnreg": getattr(config, "maxnreg", None),
                }
                for key, config in value.cache.items()
            }
    return chosen


def replay_rate(engine: Any, replays: int) -> None:
    """The batch-1 decode graph replayed back to back (``--replay``): the GPU's time per step
    without the host's turn between steps (reading the token, the engine's bookkeeping, the
    next launch), against the engine's own decode rate. The replays decode slot 0 at position
    100 over and over (its state is garbage afterwards: run last)."""
    import torch

    runner = getattr(engine.model, "runner", None)
    graph = None if runner is None else runner._graphs.get((1, False))
    if graph is None:
        log("replay: no captured batch-1 decode graph")
        return
    runner.input_ids[:1].fill_(5)
    runner.positions[:1].fill_(100)
    runner.slots[:1].fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / replays
    log(f"replay: batch-1 decode graph back to back {per_step * 1e3:.3f} ms a step "
        f"({1 / per_step:.1f} steps/s, {replays} replays)")  # fmt: skip
    start = time.perf_counter()
    for _ in range(replays):  # the launch and the wait for it, as a step without decode ahead
        graph.replay()
        torch.cuda.synchronize()
    synced = (time.perf_counter() - start) / replays
    extra = (synced - per_step) * 1e3
    log(f"replay: each replay waited for {synced * 1e3:.3f} ms a step ({1 / synced:.1f} "
        f"steps/s): launch + sync {extra:.3f} ms over back to back")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "qwen3_5_moe"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4", "int4-experts"])
    p.add_argument("--sessions", default="", help="decode batches, e.g. 1,32")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--resident", type=int, default=4096, help="0: no TTFT")
    p.add_argument("--extra", type=int, default=64)
    p.add_argument("--context", type=int, default=0, help="default: what the cases need")
    p.add_argument("--profile", action="store_true", help="torch.profiler over timed turns")
    p.add_argument("--cprofile", action="store_true", help="cProfile of one warm turn")
    p.add_argument(
        "--cprofile-cold",
        action="store_true",
        help="cProfile of a stateless cold prompt (host time by function)",
    )
    p.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=None,
        help="the worker's --prefix-cache-gb (default: its default)",
    )
    p.add_argument("--cprofile-decode", action="store_true",
                   help="cProfile of a batch-1 decode (by own time)")  # fmt: skip
    p.add_argument("--profile-decode", action="store_true", help="torch.profiler over decode")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--replay", type=int, default=0,
                   help="then N back-to-back replays of the batch-1 decode graph")  # fmt: skip
    p.add_argument("--fla-configs", action="store_true")
    p.add_argument("--fla-first-config", action="store_true",
                   help="autotuners try their first config only (a quick start)")  # fmt: skip
    args = p.parse_args()
    if args.fla_first_config:
        first_config_only()

    import torch

    from worker.main import build_engine

    config_path = Path(args.model)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    where = model_dir(config_path, args.tiny, Path(tempfile.mkdtemp()) / "model")
    config = json.loads((where / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    sessions = [int(s) for s in args.sessions.split(",") if s]
    context = args.context or max(args.resident + args.extra + 16, 256)
    on_cuda = args.device.startswith("cuda")
    t = time.perf_counter()
    engine = build_engine(
        str(where), str(where / "tokenizer.json"), args.device,
        "bfloat16" if on_cuda else "float32", max(sessions + [2]) + 1, context, None, None,
        True, True, 0, None, cuda_graphs=not args.no_graphs, quantize=args.quantize,
        prefix_cache_gb=args.prefix_cache_gb,
    )  # fmt: skip
    log(f"engine built in {time.perf_counter() - t:.1f} s")
    if on_cuda:
        log(f"GPU memory allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB")

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    driver = Driver(engine, sync)
    profile = None
    if args.profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])

        def profile() -> Any:
            return torch_profile(activities=activities)

    if args.resident:
        ttft(driver, args, vocab, profile)
    if args.fla_configs:
        print("FLA_CONFIGS " + json.dumps(fla_configs()), flush=True)
    for s in sessions:
        decode(driver, s, args.decode_tokens, vocab)
        if args.profile_decode:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
            with torch_profile(activities=kinds) as prof:
                decode(driver, s, 32, vocab)
            report(prof, f"decode x{s} (32 new tokens after a 32-token prompt)")
    if args.cprofile_decode:
        import cProfile
        import pstats

        host = cProfile.Profile()
        host.enable()
        decode(driver, 1, 64, vocab)  # the host's side of each step (the GPU's is waited for)
        host.disable()
        pstats.Stats(host).sort_stats("tottime").print_stats(25)
    if args.replay and on_cuda:
        replay_rate(engine, args.replay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
