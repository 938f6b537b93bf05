"""Shared helpers for the reliability suite: a raw JSONL process driver, tiny checkpoints,
and the accounting that checks "every request ends exactly once, with its own id"."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[2]
TOKENPIPE = (
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'tokenpipe'; from supervisor.cli import main; main()",
)
FAULTY_WORKER = (sys.executable, "-m", "worker.faults")  # `tokenpipe worker` + TOKENPIPE_FAULT
TERMINAL = frozenset(
    {"done", "error", "opened", "closed", "reset", "pong", "info", "stats", "tokens", "text"}
)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class LineProcess:
    """A child speaking JSONL. Every stdout line is kept raw and parsed (a line that is not a
    JSON object with an `event` is recorded in `bad_lines`, which tests assert empty)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **CHILD_ENV, **(env or {})},
            cwd=REPO,
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.all_events: list[dict[str, Any]] = []  # every event line, in order
        self.bad_lines: list[bytes] = []
        self.stderr: list[bytes] = []
        self._threads = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                self.bad_lines.append(line)
                continue
            if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                self.bad_lines.append(line)
                continue
            self.all_events.append(event)
            self.events.put(event)
        self.events.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def stderr_text(self, tail: int = 4000) -> str:
        return b"".join(self.stderr)[-tail:].decode(errors="replace")

    def send_raw(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, obj: dict[str, Any]) -> None:
        self.send_raw(orjson.dumps(obj) + b"\n")

    def read(self, timeout: float = 120.0) -> dict[str, Any] | None:
        return self.events.get(timeout=timeout)

    def read_until(
        self, done: Callable[[dict[str, Any]], bool], timeout: float = 120.0
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.read(max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"timed out; got {out[-20:]}; stderr: {self.stderr_text()}"
                ) from None
            assert event is not None, f"EOF; got {out[-20:]}; stderr: {self.stderr_text()}"
            out.append(event)
            if done(event):
                return out

    def ask(self, request: dict[str, Any], timeout: float = 300.0) -> list[dict[str, Any]]:
        """Send a request with an id; return its lines up to its terminal one (others dropped
        into `self.stray`)."""
        rid = request["id"]
        self.send(request)
        lines = self.read_until(lambda e: e.get("id") == rid and e["event"] in TERMINAL, timeout)
        return [e for e in lines if e.get("id") == rid]

    def wait_ready(self, timeout: float = 400.0) -> dict[str, Any]:
        try:
            ready = self.read(timeout)
        except queue.Empty:
            raise AssertionError(f"no ready line; stderr: {self.stderr_text()}") from None
        assert ready is not None and ready.get("event") == "ready", (ready, self.stderr_text())
        return ready

    def close(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.proc.returncode)

    def kill(self) -> None:
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.kill()
        self.proc.wait()


def worker_argv(*args: str) -> list[str]:
    return [*TOKENPIPE, "worker", "--device", "cpu", "--threads", "1", *args]


def run_argv(*args: str) -> list[str]:
    return [*TOKENPIPE, "run", "--workers", "1", "--threads", "1", *args]


# --------------------------------------------------------------------------- checkpoints


def write_tiny_checkpoint(
    directory: Path, vocab_size: int = 263, seed: int = 0, **config_overrides: Any
) -> Path:
    """A tiny random llama checkpoint (byte-level tokenizer, 2 layers): loads in a blink."""
    import torch
    from safetensors.torch import save_file

    from tests.conftest import byte_level_tokenizer_json, llama_tensor_shapes, tiny_config

    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config("llama", vocab_size, max_position_embeddings=1024, **config_overrides)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.randn(shape, generator=generator) * 0.5
        for name, shape in llama_tensor_shapes(config).items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


# --------------------------------------------------------------------------- accounting


def terminal_count(events: Iterable[dict[str, Any]]) -> Counter[Any]:
    """Terminal lines per id (None for id-less ones)."""
    return Counter(e.get("id") for e in events if e["event"] in TERMINAL)


def check_exactly_once(sent_ids: Iterable[Any], events: Sequence[dict[str, Any]]) -> None:
    """Every id in `sent_ids` has exactly one terminal line and nothing else answers with an
    id that was never sent; no token line follows its request's terminal line."""
    sent = list(sent_ids)
    # An `unknown_id` answer to a cancel that raced the request's end answers the cancel.
    events = [e for e in events if not (e["event"] == "error" and e.get("op") == "cancel")]
    counts = terminal_count(events)
    missing = [i for i in sent if counts[i] == 0]
    twice = {i: n for i, n in counts.items() if n > 1}
    foreign = {i for i in counts if i is not None and i not in set(sent)}
    assert not missing, f"no terminal line for {missing[:10]}"
    assert not twice, f"answered more than once: {twice}"
    assert not foreign, f"answers with ids never sent: {foreign}"
    ended: set[Any] = set()
    for event in events:
        rid = event.get("id")
        if event["event"] == "token":
            assert rid not in ended, f"token line after the terminal line of {rid!r}"
        elif event["event"] in TERMINAL:
            ended.add(rid)


def generated_text(events: Iterable[dict[str, Any]], rid: Any) -> str:
    return "".join(e["token"] for e in events if e.get("id") == rid and e["event"] == "token")
