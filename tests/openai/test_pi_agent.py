"""The real pi coding agent (npm `@mariozechner/pi-coding-agent`, installed by `.ci/run` into
.ci/pi/) against tokenpipe, set up as examples/pi/README.md says, on the default model.

Both paths: `tokenpipe serve` + models.json, and the extension starting `tokenpipe run`. On
each, in `pi --mode rpc`: two turns (the second reads the first from the KV cache), an abort
that stops the worker at once; and `pi -p "say hello"` with the README's settings, within 60 s.
Without pi the module is skipped, unless `TOKENPIPE_REQUIRE_PI=1` (`.ci/run` sets it once npm
installed pi): then it fails.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from supervisor.client import run_command

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXTENSION = REPO / "examples" / "pi" / "tokenpipe-provider.ts"
MODEL_ID = "gemma-3-270m"
README_MAX_TOKENS = 512  # examples/pi/README.md's --max-tokens / TOKENPIPE_MAX_TOKENS
TURN_MAX_TOKENS = 48  # the rpc turns: short replies keep the test fast
TURN_TIMEOUT_S = 90


def find_pi() -> str | None:
    for candidate in (
        os.environ.get("TOKENPIPE_PI"),
        str(REPO / ".ci" / "pi" / "node_modules" / ".bin" / "pi"),
        shutil.which("pi"),
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@pytest.fixture(scope="module")
def pi() -> str:
    found = find_pi()
    if found is None:
        reason = (
            "pi is not installed (npm --prefix .ci/pi install "
            "@mariozechner/pi-coding-agent@0.73.1; .ci/run does, where npm is reachable)"
        )
        if os.environ.get("TOKENPIPE_REQUIRE_PI") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `tokenpipe` executable running this checkout, first on the PATH pi and the
    extension see (the README's "tokenpipe on pi's PATH")."""
    directory = tmp_path_factory.mktemp("bin")
    script = directory / "tokenpipe"
    command = " ".join(shlex.quote(part) for part in run_command())
    script.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    script.chmod(0o755)
    return directory


def child_env(bin_dir: Path, agent_dir: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PI_CODING_AGENT_DIR": str(agent_dir),
        "PI_OFFLINE": "1",
        "PI_SKIP_VERSION_CHECK": "1",
        "OMP_NUM_THREADS": "2",
        "TOKENPIPE_THREADS": "2",
        **extra,
    }


def pi_settings(bin_dir: Path, agent_dir: Path, base_url: str | None, max_tokens: int) -> None:
    """The README's step: settings.json (compaction) and, for serve, models.json written by
    make_models_json.py (the extension registers its provider itself)."""
    merge = ["--merge", str(agent_dir / "models.json")] if base_url else []
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "pi" / "make_models_json.py")]
        + ["--model-id", MODEL_ID, "--base-url", base_url or "http://127.0.0.1:8000/v1"]
        + ["--max-tokens", str(max_tokens), *merge]
        + ["--settings", str(agent_dir / "settings.json")],
        check=True,
        env=child_env(bin_dir, agent_dir, TOKENPIPE=str(bin_dir / "tokenpipe")),
        capture_output=True,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, bin_dir: Path) -> Iterator[tuple[str, Any]]:
    """`tokenpipe serve --model-id gemma-3-270m` (default context), and its process."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(bin_dir / "tokenpipe"), "serve", "--port", str(port), "--model-id", MODEL_ID]
            + ["--max-sessions", "3", "--log-level", "warning"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(bin_dir, tmp_path_factory.mktemp("unused")),
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    yield base, proc
    proc.terminate()
    proc.wait(timeout=30)


class RpcPi:
    """`pi --mode rpc`: commands on stdin, events read by a thread into a queue."""

    def __init__(self, pi: str, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [pi, "--mode", "rpc", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                continue

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        self.proc.stdin.flush()

    def wait_for(self, predicate: Any, timeout: float = TURN_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "pi did not send the awaited event in time"
            event = self.events.get(timeout=left)
            if event.get("type") == "response" and not event.get("success", True):
                raise AssertionError(f"pi refused a command: {event}")
            if predicate(event):
                return event

    def turn(self, message: str) -> dict[str, Any]:
        """One prompt to the end of the agent's run: its last assistant message."""
        self.send({"type": "prompt", "message": message})
        end = self.wait_for(lambda e: e.get("type") == "agent_end")
        return [m for m in end["messages"] if m.get("role") == "assistant"][-1]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def worker_processes(root: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(root).children(recursive=True)
        if "worker" in " ".join(p.cmdline())
    ]


def busy_seconds(processes: list[psutil.Process], window_s: float) -> float:
    """CPU seconds the processes used during the next `window_s` seconds."""

    def total() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes if p.is_running())

    before = total()
    time.sleep(window_s)
    return total() - before


def two_turns_and_abort(rpc: RpcPi, workers: Any) -> None:
    first = rpc.turn("Reply with one word: hello.")
    assert first["stopReason"] in ("stop", "length", "toolUse"), first
    second = rpc.turn("Now reply with one word: bye.")
    assert second["stopReason"] in ("stop", "length", "toolUse"), second
    # the second prompt starts with the first turn: read from the KV cache
    assert second["usage"]["cacheRead"] > 0, second["usage"]
    assert second["usage"]["cacheRead"] >= first["usage"]["input"] // 2, (first, second)

    for _ in range(3):  # a reply that ends by itself before the abort lands is tried again
        rpc.send({"type": "prompt", "message": "Write a very long story about a lighthouse."})
        rpc.wait_for(
            lambda e: (
                e.get("type") == "message_start" and e.get("message", {}).get("role") == "assistant"
            )
        )
        time.sleep(0.3)  # generating (text may be held back while it looks like tool markup)
        rpc.send({"type": "abort"})
        end = rpc.wait_for(lambda e: e.get("type") == "agent_end", timeout=10)
        aborted = [m for m in end["messages"] if m.get("role") == "assistant"][-1]
        if aborted["stopReason"] != "stop":
            break
    assert aborted["stopReason"] == "aborted", aborted
    time.sleep(0.5)  # the cancel reaches the worker; then it must be idle
    processes = workers()
    assert processes, "no worker process found"
    assert busy_seconds(processes, 1.0) < 0.25


def test_pi_rpc_over_serve(pi: str, bin_dir: Path, serve: Any, tmp_path: Path) -> None:
    base, proc = serve
    pi_settings(bin_dir, tmp_path / "agent", f"{base}/v1", TURN_MAX_TOKENS)
    rpc = RpcPi(
        pi,
        ["--provider", "tokenpipe", "--model", MODEL_ID, "--session-dir", str(tmp_path / "s")],
        child_env(bin_dir, tmp_path / "agent"),
        tmp_path,
    )
    try:
        cancelled = _metric(base, "tokenpipe_cancelled_requests_total")
        two_turns_and_abort(rpc, lambda: worker_processes(proc.pid))
        assert _metric(base, "tokenpipe_cancelled_requests_total") == cancelled + 1
    finally:
        rpc.close()


def test_pi_rpc_over_extension(pi: str, bin_dir: Path, tmp_path: Path) -> None:
    env = child_env(
        bin_dir,
        tmp_path / "agent",
        TOKENPIPE_MAX_TOKENS=str(TURN_MAX_TOKENS),
        TOKENPIPE_ARGS="--max-sessions 2",
    )
    args = ["-e", str(EXTENSION), "--provider", "tokenpipe", "--model", MODEL_ID]
    rpc = RpcPi(pi, [*args, "--session-dir", str(tmp_path / "s")], env, tmp_path)
    try:
        two_turns_and_abort(rpc, lambda: worker_processes(rpc.proc.pid))
    finally:
        rpc.close()


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _say_hello(pi: str, args: list[str], env: dict[str, str], cwd: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [pi, *args, "--provider", "tokenpipe", "--model", MODEL_ID, "-p", "say hello"],
        env=env,
        cwd=cwd,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.strip(), done.stderr.decode()[-2000:]
    assert time.monotonic() - started < 60


def test_pi_print_over_serve_with_readme_settings(
    pi: str, bin_dir: Path, serve: Any, tmp_path: Path
) -> None:
    base, _ = serve
    pi_settings(bin_dir, tmp_path / "agent", f"{base}/v1", README_MAX_TOKENS)
    settings = json.loads((tmp_path / "agent" / "settings.json").read_text())
    assert settings["compaction"]["reserveTokens"] == README_MAX_TOKENS
    _say_hello(pi, ["--no-session"], child_env(bin_dir, tmp_path / "agent"), tmp_path)


def test_pi_print_over_extension_with_readme_settings(
    pi: str, bin_dir: Path, tmp_path: Path
) -> None:
    pi_settings(bin_dir, tmp_path / "agent", None, README_MAX_TOKENS)
    env = child_env(bin_dir, tmp_path / "agent", TOKENPIPE_MAX_TOKENS=str(README_MAX_TOKENS))
    _say_hello(pi, ["--no-session", "-e", str(EXTENSION)], env, tmp_path)
