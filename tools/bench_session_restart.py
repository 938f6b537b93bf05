"""Issue 16: resuming a session from host memory, and the first turn of a saved session after a
restart, each against a cold prefill of the same length.

Through `tokenpipe run --session-dir DIR` as users start it:
1. cold: `--cold` prompts of the resumed turns' length, ids no session holds (median);
2. host tier: `--sessions` named sessions of `--tokens` tokens with `--max-resident` device
   slots, so the first ones go to host memory; then each of the first `--resumes` sessions'
   next turn (its ids plus `--extra` new ones) comes back from there (TTFT, median);
3. restart: EOF (the worker saves every session), a new `tokenpipe run` on the same directory
   (its ready line lists the restored sessions), then the first turn of a restored session
   that has not been resumed yet, and one more cold prompt in that process.

    python tools/bench_session_restart.py [--tokens 1500] [--threads 2] [--workers 1]
    python tools/bench_session_restart.py --model examples/gemma4_31b --device cuda \
        --tokens 8192 --extra 64 --sessions 3 --max-resident 2 --host-cache-gb 16
    # issue 16's scale: 256 named 8k sessions sharing a 7,936-token system prompt, 32 on the
    # GPU, the host pool holding what it can (the rest's caches dropped without --session-dir)
    python tools/bench_session_restart.py --model examples/gemma4_31b --device cuda \
        --tokens 8192 --extra 64 --sessions 256 --session-prefix 7936 --max-resident 32 \
        --host-cache-gb 100 --no-restart --resume-first 210 --resumes 3 --quiet

A `--model` directory holding only a config.json gets random weights and a synthetic
tokenizer (as tools/bench_gpu.py does; `--tiny` shrinks the config for a CPU dry run).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.client import run_command  # noqa: E402


def log(message: str) -> None:
    print(f"[bench_session_restart {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Run:
    def __init__(self, flags: list[str], quiet: bool) -> None:
        start = time.perf_counter()
        self.process = subprocess.Popen(
            [*run_command(), "run", *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if quiet else None,
        )
        assert self.process.stdout is not None
        self.ready = json.loads(self.process.stdout.readline())
        log(f"ready after {time.perf_counter() - start:.1f} s: {self.ready}")

    def ask(self, request: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """The terminal event and the time to the first line, in ms."""
        assert self.process.stdin is not None and self.process.stdout is not None
        start = time.perf_counter()
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        first: float | None = None
        while True:
            event = json.loads(self.process.stdout.readline())
            if first is None:
                first = (time.perf_counter() - start) * 1000
            if event.get("event") != "token":
                return event, first

    def close(self) -> float:
        """EOF and the seconds until the process ended (it saves every session)."""
        assert self.process.stdin is not None
        start = time.perf_counter()
        self.process.stdin.close()
        self.process.wait(timeout=600)
        return time.perf_counter() - start


def ids(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(n - 1)]


def turn(session: str | None, prompt: list[int], tokens: int, rid: str) -> dict[str, Any]:
    request: dict[str, Any] = {
        "id": rid,
        "prompt_segments": [{"ids": prompt}],
        "add_prefix": False,
        "max_new_tokens": tokens,
        "temperature": 0.0,
    }
    if session is not None:
        request["session_id"] = session
    return request


def checked(event: dict[str, Any]) -> dict[str, Any]:
    if event.get("event") != "done":
        raise RuntimeError(f"request failed: {event}")
    return event


def summary(event: dict[str, Any]) -> str:
    keys = ("reused_prompt_tokens", "prefilled_prompt_tokens", "session_reset_reason",
            "prefill_ms")  # fmt: skip
    return ", ".join(f"{k}={event.get(k)}" for k in keys)


def tier_stats(run: Run) -> str:
    """The workers' tier and prefix-cache counters."""
    stats, _ = run.ask({"id": "stats", "op": "stats"})
    workers = stats.get("stats", {}).get("workers", [])
    parts = [{k: w.get("worker", {}).get(k) for k in ("tiers", "prefix_cache")} for w in workers]
    return json.dumps(parts)


def restart(args: Any, flags: list[str], history: dict[str, list[int]], length: int,
            vocab: int) -> tuple[float, dict[str, Any], float]:  # fmt: skip
    """A new `tokenpipe run` on the same --session-dir: the first turn of a restored session
    (ms, its done line) and a cold prompt's TTFT (ms) in that process."""
    second = Run(flags, args.quiet)
    restored = second.ready.get("restored_sessions") or []
    log(f"restored: {restored}")
    resumed = [f"s{i}" for i in range(args.resume_first, args.resume_first + args.resumes)]
    others = [f"s{i}" for i in range(args.sessions) if f"s{i}" not in resumed]
    # the sessions used last first (an agent comes back to those; the restart reads them
    # back first), then the oldest one (its file read when its turn comes, if not before)
    picks = (resumed[::-1] + others[:1]) or ["s0"]
    time.sleep(args.pause)
    restart_ms, restart_done = float("nan"), {}
    for pick in picks:  # in turn: the prefetch of the later ones goes on meanwhile
        prompt = history[pick] + ids(950, args.extra + 1, vocab)[1:]
        done, ms = second.ask(turn(pick, prompt, 1, f"after-restart-{pick}"))
        log(f"first turn of {pick} after the restart: {ms:.1f} ms ({summary(checked(done))})")
        if pick == picks[0]:
            restart_ms, restart_done = ms, done
    log(f"after the restart turn: {tier_stats(second)}")
    time.sleep(args.pause)
    done, cold_after = second.ask(turn(None, ids(77, length, vocab), 1, "cold-after"))
    log(f"cold in the second run: {cold_after:.1f} ms ({summary(checked(done))})")
    second.close()
    return restart_ms, restart_done, cold_after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--extra", type=int, default=3, help="new tokens of a resumed turn")
    parser.add_argument("--threads", type=int, default=2, help="CPU workers' threads")
    parser.add_argument("--workers", type=int, default=1, help="CPU workers")
    parser.add_argument("--cold", type=int, default=3, help="cold prefills to take the median of")
    parser.add_argument("--model", default=None, help="model dir (default: the default model)")
    parser.add_argument("--tiny", action="store_true", help="shrink a --model config (CPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sessions", type=int, default=1, help="named sessions to create")
    parser.add_argument("--resumes", type=int, default=1, help="host-tier resumes to time")
    parser.add_argument(
        "--resume-first",
        type=int,
        default=0,
        help="the first session resumed (s<N>; the oldest go to disk first)",
    )
    parser.add_argument(
        "--disk-resumes",
        type=int,
        default=0,
        help="also time resuming s0.. (before the host resumes; on disk when "
        "the host cache holds fewer than the sessions created)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds idle before the timed resumes (the idle saves finish)",
    )
    parser.add_argument("--max-resident", type=int, default=None)
    parser.add_argument("--host-cache-gb", type=float, default=None)
    parser.add_argument(
        "--shared", type=int, default=0, help="also time a new session sharing this many tokens"
    )
    parser.add_argument(
        "--session-prefix",
        type=int,
        default=0,
        help="the named sessions' prompts share their first N tokens (an agent's system "
        "prompt: the prefix cache makes creating many sessions cheap); each session still "
        "holds its own whole cache",
    )
    parser.add_argument("--pause", type=float, default=0.5, help="seconds before a timed turn")
    parser.add_argument("--no-restart", action="store_true",
                        help="no --session-dir and no second run (host tier only)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="drop the workers' logs")
    parser.add_argument("--worker-arg", action="append", default=[], help="extra run flag")
    args = parser.parse_args()
    if args.resume_first + args.resumes > args.sessions:
        parser.error("--resume-first + --resumes must be <= --sessions")
    if not 0 <= args.session_prefix < args.tokens:
        parser.error("--session-prefix must be below --tokens")

    with tempfile.TemporaryDirectory() as directory:
        vocab = 200_000
        # a session takes up to three turns of --extra new ids (disk or host resume, restart)
        flags = ["--max-context", str(args.tokens + 3 * (args.extra + 2) + 16),
                 "--max-sessions", str(args.sessions + args.cold + 3)]  # fmt: skip
        if not args.no_restart:
            flags += ["--session-dir", str(Path(directory) / "sessions")]
        if args.model is not None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_gpu import make_model_dir

            config = Path(args.model)
            config = config / "config.json" if config.is_dir() else config
            model_dir = make_model_dir(config, args.tiny, Path(directory) / "model")
            vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
            flags += ["--model", str(model_dir), "--tokenizer_path",
                      str(model_dir / "tokenizer.json"), "--random-weights"]  # fmt: skip
        if args.device == "cpu":
            flags += ["--workers", str(args.workers), "--threads", str(args.threads)]
        # on CUDA `tokenpipe run` starts one worker per GPU (it passes --device itself)
        if args.max_resident is not None:
            flags += ["--max-resident", str(args.max_resident)]
        if args.host_cache_gb is not None:
            flags += ["--host-cache-gb", str(args.host_cache_gb)]
        flags += args.worker_arg
        length = args.tokens + args.extra

        first = Run(flags, args.quiet)
        cold = []
        for k in range(args.cold):
            time.sleep(args.pause)
            done, ms = first.ask(turn(None, ids(50 + k, length, vocab), 1, f"cold-{k}"))
            cold.append(ms)
            log(f"cold {k}: {ms:.1f} ms ({summary(checked(done))})")
        shared_ms = None
        if args.shared:  # a new session whose prompt starts with another one's
            head = ids(60, args.shared, vocab)
            done, _ = first.ask(turn(None, head + ids(61, length - args.shared + 1, vocab)[1:], 1,
                                     "shared-first"))  # fmt: skip
            log(f"shared prefix, first prompt: {summary(checked(done))}")
            time.sleep(args.pause)
            prompt = head + ids(62, length - args.shared + 1, vocab)[1:]
            done, shared_ms = first.ask(turn("shared", prompt, 1, "shared-second"))
            log(f"shared prefix, new session: {shared_ms:.1f} ms ({summary(checked(done))})")
            first.ask({"id": "close-shared", "op": "close", "session_id": "shared"})
            log(f"after the shared prefix: {tier_stats(first)}")
        history: dict[str, list[int]] = {}
        head = ids(40, args.session_prefix, vocab) if args.session_prefix else []
        for i in range(args.sessions):
            name = f"s{i}"
            own = ids(i + 1, args.tokens - len(head) + (1 if head else 0), vocab)
            prompt = head + (own[1:] if head else own)
            done, ms = first.ask(turn(name, prompt, 1, f"make-{i}"))
            history[name] = prompt + checked(done)["generated_token_ids"]
            log(f"created {name}: {ms:.1f} ms ({summary(done)})")
        log(f"after creating: {tier_stats(first)}")
        time.sleep(args.settle)
        log(f"after settling: {tier_stats(first)}")
        for i in range(args.disk_resumes):
            name = f"s{i}"
            time.sleep(args.pause)
            prompt = history[name] + ids(800 + i, args.extra + 1, vocab)[1:]
            done, ms = first.ask(turn(name, prompt, 1, f"disk-resume-{i}"))
            history[name] = prompt + checked(done)["generated_token_ids"]
            log(f"resume {name} (disk?): {ms:.1f} ms ({summary(done)})")
        if args.disk_resumes:
            log(f"after the disk resumes: {tier_stats(first)}")
            time.sleep(args.settle)
        resumed = []
        for i in range(args.resume_first, args.resume_first + args.resumes):
            name = f"s{i}"
            time.sleep(args.pause)
            prompt = history[name] + ids(900 + i, args.extra + 1, vocab)[1:]
            done, ms = first.ask(turn(name, prompt, 1, f"resume-{i}"))
            resumed.append(ms)
            history[name] = prompt + checked(done)["generated_token_ids"]
            log(f"resume {name} from host memory: {ms:.1f} ms ({summary(done)})")
        log(f"after resuming: {tier_stats(first)}")
        log(f"first run closed in {first.close():.1f} s")
        if args.no_restart:
            restart_ms = cold_after = float("nan")
            restart_done: dict[str, Any] = {}
        else:
            restart_ms, restart_done, cold_after = restart(args, flags, history, length, vocab)

    median = statistics.median(cold)
    host = statistics.median(resumed) if resumed else float("nan")
    print(
        f"prompt {length} tokens: cold TTFT {median:.0f} ms (median of "
        f"{[round(c) for c in cold]}; {cold_after:.0f} after the restart)\n"
        f"resumed from host memory: {host:.0f} ms ({[round(r) for r in resumed]}): "
        f"{host / median:.3f} of cold (target <= 0.25)"
    )
    if restart_done:
        print(
            f"first turn after the restart: {restart_ms:.0f} ms: {restart_ms / median:.3f} of "
            f"cold (target <= 0.25; reused {restart_done.get('reused_prompt_tokens')})"
        )
    if shared_ms is not None:
        print(
            f"new session sharing {args.shared} tokens: {shared_ms:.0f} ms: "
            f"{shared_ms / median:.3f} of cold (target <= 0.1)"
        )


if __name__ == "__main__":
    main()
