"""`tokenpipe run` stops at once when nobody is left to read its answers, with real processes
on the default model: the death of its parent process, or a closed stdout (EPIPE), cancels
everything in flight within a second; EOF on stdin still lets in-flight requests finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor.client import run_command

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENPIPE_THREADS": "1"}
RUN_ARGS = ["run", "--max-context", "2048", "--max-sessions", "2"]
LONG = {  # greedy counting: the model keeps going far beyond what the test waits for
    "id": "long",
    "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
    "max_new_tokens": 1500,
    "temperature": 0,
}

PARENT = """
import subprocess, sys, time
own_pipe = sys.argv[1] == "own"  # the parent holds stdin's write end: its death is also EOF
with open(sys.argv[2], "wb") as out, open(sys.argv[3], "wb") as err:
    stdin = subprocess.PIPE if own_pipe else 0
    child = subprocess.Popen(sys.argv[4:], stdin=stdin, stdout=out, stderr=err)
print(child.pid, flush=True)
if own_pipe:
    child.stdin.write(sys.stdin.readline().encode())
    child.stdin.flush()
time.sleep(3600)
"""


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_until(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("stdin_of", ["test", "own"])
def test_parent_death_cancels_everything_within_a_second(tmp_path: Path, stdin_of: str) -> None:
    out, err = tmp_path / "out.jsonl", tmp_path / "err.txt"
    # stdout is a file (no EPIPE). "test": the test holds stdin's write end, so only the
    # parent's death itself happens; "own": the parent holds it, so its death is also EOF
    # (which alone would let the request run on), as when pi dies.
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, stdin_of, str(out), str(err), *run_command(), *RUN_ARGS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=ENV,
    )
    assert parent.stdin is not None and parent.stdout is not None
    run = psutil.Process(int(parent.stdout.readline()))
    try:
        assert _wait_until(lambda: out.exists() and out.read_text().strip(), 300), err.read_text()
        parent.stdin.write(json.dumps(LONG).encode() + b"\n")
        parent.stdin.flush()
        assert _wait_until(lambda: len(_lines(out)) > 6, 120), err.read_text()[-2000:]
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        killed = time.monotonic()

        def cancelled() -> bool:
            return any(
                e.get("event") == "done" and e.get("finish_reason") == "cancelled"
                for e in _lines(out)
            )

        assert _wait_until(cancelled, 1.0), err.read_text()[-2000:]
        assert time.monotonic() - killed < 1.2
        run.wait(timeout=10)
        assert "parent process exited" in err.read_text()
    finally:
        for process in [run, *(run.children(recursive=True) if run.is_running() else [])]:
            if process.is_running():
                process.kill()
        parent.stdin.close()


def test_closed_stdout_cancels_and_exits(tmp_path: Path) -> None:
    err = (tmp_path / "err.txt").open("wb")
    proc = subprocess.Popen(
        [*run_command(), *RUN_ARGS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        env=ENV,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert json.loads(proc.stdout.readline())["event"] == "ready"
        proc.stdin.write(json.dumps(LONG).encode() + b"\n")
        proc.stdin.flush()
        for _ in range(4):
            assert json.loads(proc.stdout.readline())["event"] == "token"
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.stdout.close()  # EPIPE on the next answer; stdin stays open
        closed = time.monotonic()
        proc.wait(timeout=10)
        assert time.monotonic() - closed < 5
        assert not [w for w in workers if w.is_running() and w.status() != "zombie"]
        assert "stdout closed" in (tmp_path / "err.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdin.close()


def test_eof_still_finishes_in_flight_requests() -> None:
    request = {**LONG, "max_new_tokens": 24}
    done = subprocess.run(
        [*run_command(), *RUN_ARGS],
        input=json.dumps(request).encode() + b"\n",
        capture_output=True,
        env=ENV,
        timeout=300,
    )
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert events[-1]["event"] == "done", done.stderr.decode()[-2000:]
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 24
