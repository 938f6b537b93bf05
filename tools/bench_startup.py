"""Start-up and crash recovery through `tokenpipe run`, as a user starts it.

    python tools/bench_startup.py --model examples/gemma4_31b --out OUT    # random weights
    python tools/bench_startup.py --model /models/ckpt --weights --out OUT  # a real checkpoint
    python tools/bench_startup.py --tiny --device cpu --out /tmp/st         # the CPU dry run

Spawns `tokenpipe run --model DIR [--random-weights] ...` (one worker), times spawn -> the
supervisor's `ready` line and a first short generation, then kill -9s the worker and times
kill -> the first generation served by the restarted worker (the request is sent at once, so
it waits for the restart). The worker's own start-up lines (`loaded in`, each CUDA set-up
step, `ready ... since spawn`) are copied from stderr into the report, so the restart can be
compared with the worker's load time. Writes OUT/bench_startup.json and OUT/bench_startup.log
(the whole stderr) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_global_key_value_heads": 1, "head_dim": 16,
    "global_head_dim": 32, "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64,
    "vocab_size": 512, "vocab_size_per_layer_input": 512,
}  # fmt: skip
TOKENS = 512  # the synthetic tokenizer's size (<= any config's vocabulary)
STEP_MARKERS = (
    "loaded in", "drew random", "read ", "cuda_setup", "compile_ahead", "KV cache", "ready:",
)  # fmt: skip


def log(message: str) -> None:
    print(f"[bench_startup {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def model_dir(source: Path, tiny: bool, where: Path) -> Path:
    """config.json (shrunk with --tiny; no EOS) and a small word-level tokenizer.json."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    config = json.loads((source / "config.json" if source.is_dir() else source).read_text())
    if tiny:
        config.update(TINY)
    config["eos_token_id"] = []
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(config))
    tok = tokenizers.Tokenizer(WordLevel({f"<t{i}>": i for i in range(TOKENS)}, unk_token="<t3>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(where / "tokenizer.json"))
    return where


class Supervisor:
    """`tokenpipe run` over its pipes; stderr is kept (and timestamped) for the report."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        code = "import sys; sys.argv[0] = 'tokenpipe'; from supervisor.cli import main; main()"
        cmd = [sys.executable, "-c", code, "run", *argv]
        log("starting: tokenpipe run " + " ".join(argv))
        self.spawned = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, cwd=str(REPO), env=env)  # fmt: skip
        self.stderr_lines: list[tuple[float, str]] = []
        self._log = log_path.open("w")
        threading.Thread(target=self._drain, daemon=True).start()
        self._next = 0

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            text = raw.decode(errors="replace").rstrip("\n")
            for part in text.split("\r"):  # progress bars redraw with \r
                self.stderr_lines.append((time.perf_counter() - self.spawned, part))
            self._log.write(f"{time.perf_counter() - self.spawned:8.2f} {text}\n")
            self._log.flush()

    def line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        result: list[bytes] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(timeout)
        if not result:
            raise RuntimeError(f"no line from tokenpipe run within {timeout}s")
        if not result[0]:
            raise RuntimeError(f"tokenpipe run exited ({self.proc.wait()}); see its log")
        return json.loads(result[0])

    def generate(self, new_tokens: int, timeout: float) -> dict[str, Any]:
        """One greedy generation from random ids; -> its done (raises on an error)."""
        assert self.proc.stdin is not None
        self._next += 1
        request = {"id": self._next, "prompt_segments": [{"ids": list(range(10, 42))}],
                   "max_new_tokens": new_tokens, "add_prefix": False}  # fmt: skip
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            event = self.line(timeout)
            if event.get("id") != self._next:
                continue
            if event.get("event") == "error":
                raise RuntimeError(f"generation failed: {event}")
            if event.get("event") == "done":
                return event

    def worker_pid(self) -> int:
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "worker" in child.cmdline():
                return child.pid
        raise RuntimeError("no worker process under tokenpipe run")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def worker_steps(lines: list[tuple[float, str]], since: float) -> list[str]:
    """The worker's start-up log lines after `since` seconds (load, set-up steps, ready)."""
    return [
        f"{at:7.1f}s {text.strip()}"
        for at, text in lines
        if at >= since and any(marker in text for marker in STEP_MARKERS)
    ]


def restart(sup: Supervisor, result: dict[str, Any], timeout: float) -> None:
    """kill -9 the worker, then time kill -> a generation served by the restarted one."""
    pid = sup.worker_pid()
    killed_at = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    log(f"killed worker pid {pid}")
    lost = 0
    # The supervisor sends a request that had no output yet again after the restart, so
    # `lost_before_restart` should stay 0; a `worker_lost` is counted, not hidden.
    while True:
        try:
            sup.generate(8, timeout)  # waits for the restarted worker
            break
        except RuntimeError as exc:
            if "worker_lost" not in str(exc) or lost >= 3:
                raise
            lost += 1
    result["lost_before_restart"] = lost
    result["kill_to_served_s"] = round(time.perf_counter() - killed_at, 2)
    result["restart_steps"] = worker_steps(sup.stderr_lines, killed_at - sup.spawned)
    loads = [text for _, text in sup.stderr_lines if "loaded in" in text]
    result["restart_load_line"] = loads[-1].strip() if loads else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "gemma4_31b"))
    p.add_argument("--weights", action="store_true",
                   help="load the checkpoint's weights (default: --random-weights)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="shrink the config (CPU dry run)")
    p.add_argument("--device", default="cuda", help="cuda (a worker per GPU) or cpu (one)")
    p.add_argument("--max-sessions", type=int, default=9)
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quantize", default=None, help="passed to tokenpipe run (int8, int4)")
    p.add_argument("--no-restart", action="store_true",
                   help="stop after the first generation (no kill -9 and restart)")  # fmt: skip
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(args.model)
    if args.weights:
        directory = source
        model_args = ["--model", str(directory)]
    else:
        directory = model_dir(source, args.tiny, Path(tempfile.mkdtemp(prefix="bench_st_")))
        model_args = ["--model", str(directory), "--random-weights",
                      "--tokenizer_path", str(directory / "tokenizer.json")]  # fmt: skip
    placement = ["--workers", "1"] if args.device == "cpu" else []  # cuda: one per GPU
    if args.quantize:
        placement += ["--quantize", args.quantize]
    sup = Supervisor(
        [*model_args, *placement, "--max-sessions", str(args.max_sessions),
         "--max-context", str(args.max_context)],
        out / "bench_startup.log",
    )  # fmt: skip
    result: dict[str, Any] = {
        "command": "python tools/bench_startup.py " + " ".join(argv or sys.argv[1:])
    }
    try:
        ready = sup.line(args.timeout)
        result["ready_s"] = round(time.perf_counter() - sup.spawned, 2)
        log(f"ready {result['ready_s']}s after spawn: {ready}")
        started = time.perf_counter()
        sup.generate(8, args.timeout)
        result["first_generate_s"] = round(time.perf_counter() - started, 3)
        result["start_steps"] = worker_steps(sup.stderr_lines, 0.0)
        if not args.no_restart:
            restart(sup, result, args.timeout)
    finally:
        sup.close()
    (out / "bench_startup.json").write_text(json.dumps(result, indent=1))
    print("| measure | seconds |\n| --- | --- |")
    for key in ("ready_s", "first_generate_s", "kill_to_served_s"):
        print(f"| {key} | {result.get(key)} |")
    print("\nfirst start:\n  " + "\n  ".join(result.get("start_steps", [])))
    print("after kill -9:\n  " + "\n  ".join(result.get("restart_steps", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
