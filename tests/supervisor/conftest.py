"""Shared helpers for the supervisor tests: the fake worker, a JSONL child process driver."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psutil

from supervisor.client import run_command
from supervisor.core import SupervisorConfig

FAKE_WORKER = (sys.executable, str(Path(__file__).with_name("fake_worker.py")))
REPO = Path(__file__).resolve().parents[2]


def fake_config(workers: int = 1, *args: str, **kwargs: Any) -> SupervisorConfig:
    kwargs.setdefault("ready_timeout", 30.0)
    kwargs.setdefault("restart_base_s", 0.05)
    return SupervisorConfig(worker_command=FAKE_WORKER, workers=workers, worker_args=args, **kwargs)


class JsonlProcess:
    """A child speaking JSONL on stdin/stdout, read by a background thread."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            cwd=REPO,
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.stderr: list[bytes] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    @classmethod
    def run(cls, *args: str, env: dict[str, str] | None = None) -> JsonlProcess:
        return cls([*run_command(), "run", *args], env)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(orjson.loads(line))
        self.lines.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(orjson.dumps(obj) + b"\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 60.0) -> dict[str, Any] | None:
        return self.lines.get(timeout=timeout)

    def read_until(
        self, done: Callable[[dict[str, Any]], bool], timeout: float = 60.0
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            event = self.read(max(0.01, deadline - time.monotonic()))
            assert event is not None, f"EOF; got {out}; stderr: {b''.join(self.stderr)[-2000:]!r}"
            out.append(event)
            if done(event):
                return out

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        for child in self.descendants():
            child.kill()
        self.proc.kill()
        self.proc.wait()


def terminal(event: dict[str, Any]) -> bool:
    return event.get("event") != "token"


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(
            psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
            for p in pids
        ):
            return True
        time.sleep(0.05)
    return False
