"""Issue 16: the shared-prefix cache through the real worker, on and off.

Two workers in turn (as `tokenpipe run` starts them, random weights, the config's shape):
the default (prefix cache on) and `--prefix-cache-gb 0`. Each measures prefills of fresh ids
(nothing shared, so with the cache on they only pay for filling it: its cost) and a cold
time to first token; the first also times a new session whose `--prompt`-token prompt shares
its first `--shared` tokens with a prompt another request prefilled just before (target: <= 0.1
of cold).

    python tools/bench_prefix_cache.py --model examples/gemma4_31b --device cuda
    python tools/bench_prefix_cache.py --model examples/qwen3_5_moe --random-weights --skip-off
    python tools/bench_prefix_cache.py --tiny --device cpu --prompt 1024 --shared 768

The weights are always random (``--random-weights`` is accepted for the other tools' command
lines). On a hybrid model (qwen3_5_moe) the reuse also needs a DeltaNet state at 7,936: the
first prompt's prefill keeps one there (its last block end before its final token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu import WorkerProcess, make_model_dir, random_ids  # noqa: E402


def log(message: str) -> None:
    print(f"[bench_prefix_cache {time.strftime('%H:%M:%S')}] {message}", flush=True)


def request(ids: list[int], new: int, session: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_segments": [{"ids": ids}], "max_new_tokens": new}
    if session is not None:
        out["session_id"] = session
    return out


def timed(worker: WorkerProcess, req: dict[str, Any], timeout: float) -> tuple[float, dict]:
    """Seconds to the first token (or the done line) and the done line."""
    t0, lines = worker.generate([req], timeout)
    got = next(iter(lines.values()))
    first = next((ln.t for ln in got if ln.msg.get("event") == "token"), got[-1].t)
    return first - t0, got[-1].msg


def prefills(worker: WorkerProcess, sizes: list[int], reps: int, vocab: int, seed: int,
             timeout: float) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {}
    for n in sizes:
        engine_ms = []
        for r in range(reps):
            _, done = timed(worker, request(random_ids(n, vocab, seed + 97 * r + n), 0), timeout)
            engine_ms.append(float(done["prefill_ms"]))
        out[f"prefill_{n}_ms"] = statistics.median(engine_ms)
        out[f"prefill_{n}_runs_ms"] = engine_ms
        log(f"prefill {n}: {engine_ms} ms ({n / statistics.median(engine_ms) * 1000:.0f} tok/s)")
    return out


def shared_ttft(worker: WorkerProcess, prompt: int, shared: int, reps: int, vocab: int,
                timeout: float) -> dict[str, Any]:  # fmt: skip
    runs, colds, reused = [], [], []
    for r in range(reps):
        head = random_ids(shared, vocab, 2000 + r)
        first = head + random_ids(prompt - shared, vocab, 3000 + r)
        timed(worker, request(first, 0), timeout)  # the scratch session fills the cache
        sid = f"shared-{r}"
        worker.ask({"op": "open", "session_id": sid})
        second = head + random_ids(prompt - shared, vocab, 5000 + r)
        seconds, done = timed(worker, request(second, 1, sid), timeout)
        worker.ask({"op": "close", "session_id": sid})
        runs.append(seconds)
        reused.append(done.get("reused_prompt_tokens"))
        cold_s, _ = timed(worker, request(random_ids(prompt, vocab, 7000 + r), 1), timeout)
        colds.append(cold_s)
        log(f"shared {seconds * 1000:.1f} ms ({summary(done)}); cold {cold_s * 1000:.1f} ms")
    return {
        "shared_ttft_ms": statistics.median(runs) * 1000,
        "cold_ttft_ms": statistics.median(colds) * 1000,
        "shared_runs_ms": [round(s * 1000, 1) for s in runs],
        "cold_runs_ms": [round(s * 1000, 1) for s in colds],
        "reused": reused,
    }


def summary(done: dict[str, Any]) -> str:
    keys = ("reused_prompt_tokens", "prefilled_prompt_tokens", "session_reset_reason",
            "prefill_ms")  # fmt: skip
    return ", ".join(f"{k}={done.get(k)}" for k in keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "examples" /
                                          "gemma4_31b"))  # fmt: skip
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--random-weights", action="store_true", help="always so (accepted)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--shared", type=int, default=7936)
    p.add_argument("--prefill", default="2048,8192")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--skip-off", action="store_true", help="only the worker with the cache on")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(args.model)
        config = config / "config.json" if config.is_dir() else config
        model_dir = make_model_dir(config, args.tiny, Path(tmp) / "model")
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        on_gpu = args.device.startswith("cuda")
        common = ["--model", str(model_dir), "--tokenizer_path", str(model_dir / "tokenizer.json"),
                  "--random-weights", "--device", args.device,
                  "--dtype", "bfloat16" if on_gpu else "float32", "--max-sessions", "4",
                  "--max-context", str(max(args.prompt, 2048) + 64)]  # fmt: skip
        sizes = [int(s) for s in args.prefill.split(",") if s]
        results: dict[str, Any] = {}
        for name, extra in (("on", []), ("off", ["--prefix-cache-gb", "0"])):
            if name == "off" and args.skip_off:
                continue
            worker = WorkerProcess(common + extra)
            try:
                worker.wait_ready(args.timeout * 3)
                info = worker.ask({"op": "info"})["info"]
                log(f"cache {name}: prefix_cache_bytes {info.get('prefix_cache_bytes')}, "
                    f"prefill chunk {info.get('prefill_chunk')}")  # fmt: skip
                res = prefills(worker, sizes, args.reps, vocab, 11, args.timeout)
                if name == "on":
                    res.update(shared_ttft(worker, args.prompt, args.shared, args.reps, vocab,
                                           args.timeout))  # fmt: skip
                    stats = worker.ask({"op": "stats"})["stats"]
                    log(f"prefix cache: {stats.get('prefix_cache')}")
                else:
                    cold_s, _ = timed(worker, request(random_ids(args.prompt, vocab, 7000), 1),
                                      args.timeout)  # fmt: skip
                    res["cold_ttft_ms"] = cold_s * 1000
                results[name] = res
            finally:
                worker.close()
    print(json.dumps(results, indent=1))
    on, off = results.get("on", {}), results.get("off", {})
    for n in sizes:
        if f"prefill_{n}_ms" in off:
            cost = on[f"prefill_{n}_ms"] / off[f"prefill_{n}_ms"] - 1
            print(f"prefill {n}: {on[f'prefill_{n}_ms']:.1f} ms with the cache, "
                  f"{off[f'prefill_{n}_ms']:.1f} without ({cost * 100:+.1f}%)")  # fmt: skip
    if "shared_ttft_ms" in on:
        ratio = on["shared_ttft_ms"] / on["cold_ttft_ms"]
        print(f"new session sharing {args.shared} of {args.prompt}: {on['shared_ttft_ms']:.1f} ms"
              f" vs cold {on['cold_ttft_ms']:.1f} ms: {ratio:.3f} (target <= 0.1; reused "
              f"{on['reused']})")  # fmt: skip


if __name__ == "__main__":
    main()
