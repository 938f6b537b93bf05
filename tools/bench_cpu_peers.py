"""llama.cpp's `llama-bench` and a resident tokenpipe worker on the same GGUF, side by side
(issue 20).

    tools/build_llama_cpp.sh                       # once: .peers/llama.cpp/build/bin/llama-bench
    python tools/bench_cpu_peers.py                # 5 rounds, 1 and 2 threads, --quantize auto
    python tools/bench_cpu_peers.py --rounds 9 --quantize auto --quantize none --json out.json
    python tools/bench_cpu_peers.py --rounds 1 --decode-tokens 16 --prompt-tokens 64   # smoke
    python tools/bench_cpu_peers.py --activation-bits 32   # + workers with fp32 activations

Per round and thread count, the engines run one after another, the order flipped every round
(A, B, then B, A): llama.cpp as `llama-bench -p P -n N -r 1` (its own warm-up, one repetition
of each test), ours as one worker per (threads, --quantize mode) started before the first
round and kept resident. Figures, as llama-bench defines them:

- decode tok/s: N tokens after a short prompt (ours: tokens after the first / time after the
  first token, wall-clock on the client side, so it includes the pipe and the JSON);
- prompt tok/s: a P-token prompt (ours: P / the `done` event's prefill_ms; every round's prompt
  starts with a different token, so nothing is reused from the KV cache).

Each measurement also records the CPU the other processes of the machine used while it ran
(from /proc: all busy time minus this process tree's), in cores: a number well above 0 means
the figure is not a quiet-machine figure. The table prints medians and [min-max] over rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
BUILD_SCRIPT = ROOT / "tools" / "build_llama_cpp.sh"
DEFAULT_LLAMA_BENCH = ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-bench"
PASSAGE = ROOT / "tests" / "worker" / "data" / "quality_passage.txt"
SHORT_PROMPT = "The history of the printing press begins"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Series:
    """One engine at one thread count: a figure per round, and the other processes' CPU."""

    decode: list[float] = field(default_factory=list)
    prompt: list[float] = field(default_factory=list)
    others_decode: list[float] = field(default_factory=list)
    others_prompt: list[float] = field(default_factory=list)


def find_llama_bench(path: str | None) -> Path:
    """The llama-bench binary: --llama-bench, $LLAMA_BENCH, or the build script's output."""
    candidate = Path(path or os.environ.get("LLAMA_BENCH") or DEFAULT_LLAMA_BENCH)
    if not candidate.is_file() or not os.access(candidate, os.X_OK):
        raise click.ClickException(
            f"no llama-bench at {candidate}. Build it (npm + cmake, about 3 minutes on 2 cores):"
            f"\n    {BUILD_SCRIPT.relative_to(ROOT)}\nor pass --llama-bench PATH / set LLAMA_BENCH."
        )
    return candidate


def _tree_ticks(root_pid: int) -> int:
    """utime + stime (clock ticks) of this process and every live descendant of it, children
    that were waited for included (cutime, cstime)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # fields from the state on
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, stack = 0, [root_pid]
    while stack:
        pid = stack.pop()
        fields = stats.get(pid)
        if fields is not None:  # utime stime cutime cstime are fields 14-17 of stat
            total += sum(int(v) for v in fields[11:15])
        stack.extend(children.get(pid, []))
    return total


def _busy_ticks() -> int:
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:8]) - idle


def measure_others(action: Callable[[], Any]) -> tuple[Any, float]:
    """(action's result, cores the machine's other processes used while it ran)."""
    pid = os.getpid()
    busy, ours, started = _busy_ticks(), _tree_ticks(pid), time.perf_counter()
    result = action()
    elapsed = time.perf_counter() - started
    others = (_busy_ticks() - busy) - (_tree_ticks(pid) - ours)
    return result, max(0.0, others / CLOCK_TICKS / elapsed)


def run_llama(binary: Path, gguf: Path, threads: int, prompt: int, decode: int) -> dict[str, float]:
    """One llama-bench run of its pp and tg tests: {"prompt": tok/s, "decode": tok/s}."""
    argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n",
            str(decode), "-r", "1", "-o", "json"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise click.ClickException(f"llama-bench failed ({done.returncode}): {done.stderr[-2000:]}")
    out: dict[str, float] = {}
    for test in json.loads(done.stdout):
        key = "prompt" if test["n_prompt"] > 0 and test["n_gen"] == 0 else "decode"
        out[key] = float(test["avg_ts"])
    return out


class OurWorker:
    """A resident `tokenpipe worker` (GGUF path, threads, --quantize mode)."""

    def __init__(self, gguf: Path, threads: int, mode: str, context: int, bits: int) -> None:
        from bench_worker import WorkerPipe

        env = [] if bits == 0 else ["env", f"TOKENPIPE_CPU_ACTIVATION_BITS={bits}"]
        argv = env + [sys.executable, "-m", "worker.main", "--model", str(gguf), "--device", "cpu",
                "--dtype", "float32", "--threads", str(threads), "--quantize", mode,
                "--max-sessions", "2", "--max-context", str(context)]  # fmt: skip
        self.pipe = WorkerPipe(argv)
        self.count = 0

    def _request(self, ids: list[int], new_tokens: int) -> dict[str, Any]:
        self.count += 1
        request = {
            "id": f"r{self.count}",
            "prompt_segments": [{"ids": ids}],
            "add_prefix": False,
            "max_new_tokens": new_tokens,
            "stop_token_ids": [],
        }
        return self.pipe.generate(request)

    def decode(self, ids: list[int], tokens: int) -> float:
        result = self._request(ids, tokens)
        made = result["done"]["completion_tokens"]
        return (made - 1) / (result["end"] - result["first"])

    def prompt(self, ids: list[int]) -> float:
        result = self._request(ids, 1)
        return len(ids) / (result["done"]["prefill_ms"] / 1000.0)

    def close(self) -> None:
        self.pipe.close()


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):7.1f} [{min(values):.1f}-{max(values):.1f}]"


def _load(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


@click.command()
@click.option("--rounds", type=int, default=5, show_default=True)
@click.option("--threads", "thread_counts", type=int, multiple=True, default=(1, 2),
              show_default=True)  # fmt: skip
@click.option("--quantize", "modes", multiple=True, default=("auto",), show_default=True,
              type=click.Choice(["auto", "none", "int8", "int4"]),
              help="Our worker's --quantize; repeat for several workers.")  # fmt: skip
@click.option(
    "--activation-bits",
    "bit_widths",
    multiple=True,
    type=click.Choice(["8", "16", "32"]),
    help="Also our workers with TOKENPIPE_CPU_ACTIVATION_BITS (default 16 on VNNI CPUs; 32: fp32).",
)
@click.option("--decode-tokens", type=int, default=128, show_default=True)
@click.option("--prompt-tokens", type=int, default=512, show_default=True)
@click.option("--model", "model_path", default=None, help="GGUF file (default: the default model).")
@click.option("--llama-bench", "llama_bench", default=None, help="llama-bench binary.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(
    rounds: int,
    thread_counts: tuple[int, ...],
    modes: tuple[str, ...],
    bit_widths: tuple[str, ...],
    decode_tokens: int,
    prompt_tokens: int,
    model_path: str | None,
    llama_bench: str | None,
    json_path: str | None,
) -> None:
    """Run the interleaved rounds and print the table."""
    from worker.loading.default_model import default_model_path
    from worker.loading.loader import open_model_files

    binary = find_llama_bench(llama_bench)
    gguf = Path(model_path) if model_path else default_model_path()
    _, _, tokenizer, _ = open_model_files(str(gguf), progress=False)
    short_ids = list(tokenizer.prefix_ids) + tokenizer.encode(SHORT_PROMPT)
    passage = tokenizer.encode(PASSAGE.read_text() * 4)
    if len(passage) < prompt_tokens + rounds:
        raise click.ClickException(f"the passage has fewer than {prompt_tokens} tokens")
    context = max(prompt_tokens + 64, len(short_ids) + decode_tokens + 64)
    variants = [(mode, 0) for mode in modes] + [(m, int(b)) for m in modes for b in bit_widths]
    names = {v: f"tokenpipe {v[0]}" + ("" if v[1] == 0 else f" a{v[1]}") for v in variants}
    engines = ["llama.cpp"] + list(names.values())
    series = {(engine, t): Series() for engine in engines for t in thread_counts}
    print(f"llama-bench: {binary}\nmodel: {gguf}\nstarting {len(variants) * len(thread_counts)} "
          "worker(s)...", flush=True)  # fmt: skip
    workers = {(names[v], t): OurWorker(gguf, t, v[0], context, v[1])
               for v in variants for t in thread_counts}  # fmt: skip
    try:
        for worker in workers.values():  # warm-up: first calls, kernels compiled and loaded
            worker.decode(short_ids, 8)
            worker.prompt(passage[:prompt_tokens])
        for round_index in range(rounds):
            order = engines if round_index % 2 == 0 else engines[::-1]
            prompt_ids = passage[round_index + 1 : round_index + 1 + prompt_tokens]
            for threads in thread_counts:
                for engine in order:
                    s = series[(engine, threads)]
                    if engine == "llama.cpp":
                        figures, load = measure_others(
                            lambda t=threads: run_llama(
                                binary, gguf, t, prompt_tokens, decode_tokens
                            )  # fmt: skip
                        )
                        s.decode.append(figures["decode"])
                        s.prompt.append(figures["prompt"])
                        s.others_decode.append(load)  # one process for both tests
                        s.others_prompt.append(load)
                        continue
                    worker = workers[(engine, threads)]
                    rate, load = measure_others(partial(worker.decode, short_ids, decode_tokens))
                    s.decode.append(rate)
                    s.others_decode.append(load)
                    rate, load = measure_others(partial(worker.prompt, prompt_ids))
                    s.prompt.append(rate)
                    s.others_prompt.append(load)
            print(f"round {round_index + 1}/{rounds} done", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    print(f"\n{rounds} interleaved rounds; median [min-max]; 'others' = cores the other "
          "processes used during the measurement (median)")  # fmt: skip
    head = (f"| engine | threads | decode tok/s ({decode_tokens} tokens) | others | "
            f"prompt tok/s ({prompt_tokens} tokens) | others |")  # fmt: skip
    print(head + "\n| --- | --- | --- | --- | --- | --- |")
    for threads in thread_counts:
        for engine in engines:
            s = series[(engine, threads)]
            print(f"| {engine} | {threads} | {_summary(s.decode)} | {_load(s.others_decode)} | "
                  f"{_summary(s.prompt)} | {_load(s.others_prompt)} |")  # fmt: skip
    print()
    for threads in thread_counts:
        llama = series[("llama.cpp", threads)]
        for engine in engines[1:]:
            ours = series[(engine, threads)]
            decode = statistics.median(ours.decode) / statistics.median(llama.decode)
            prompt = statistics.median(ours.prompt) / statistics.median(llama.prompt)
            print(f"{engine} / llama.cpp, {threads} thread(s): decode {decode:.2f}x, "
                  f"prompt {prompt:.2f}x")  # fmt: skip
    if json_path:
        data = {f"{engine} t{threads}": vars(s) for (engine, threads), s in series.items()}
        data["config"] = {"rounds": rounds, "decode_tokens": decode_tokens,  # type: ignore[assignment]
                          "prompt_tokens": prompt_tokens, "model": str(gguf)}  # fmt: skip
        Path(json_path).write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
