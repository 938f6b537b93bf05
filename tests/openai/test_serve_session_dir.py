"""`tokenpipe serve --session-dir` end to end (issue 16) with the official `openai` client, two
real CPU workers on the default model:

- chat sessions (x-session-affinity) saved at shutdown resume warm after the server restarts:
  the whole previous conversation is `cached_tokens` on the first turn after the restart
  (the workers restored the caches, the router sent each session to its worker, and the
  assistant turns were spliced back as their saved ids);
- the restored sessions count as the server's own: when every session slot is taken, a new
  session closes the least recently used restored one (and its files) instead of failing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from supervisor.client import run_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


class Serve:
    def __init__(self, session_dir: Path, port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.proc = subprocess.Popen(
            [*run_command(), "serve", "--port", str(port), "--workers", "2",
             "--max-sessions", "2", "--max-context", "512", "--session-dir", str(session_dir),
             "--worker-arg=--threads=1", "--log-level", "warning"],
            stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0)
        self.model = self.client.models.list().data[0].id

    def chat(self, session: str, messages: list[dict[str, Any]]) -> Any:
        return self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
            extra_headers={"x-session-affinity": session},
        )  # fmt: skip

    def stop(self) -> int:
        """SIGTERM: uvicorn shuts down gracefully (the workers save their sessions), then
        raises the signal again, so a clean stop exits by SIGTERM."""
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture
def port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_sessions_resume_warm_after_a_restart(tmp_path: Path, port: int) -> None:
    root = tmp_path / "sessions"
    log = tmp_path / "serve.log"
    conversations: dict[str, list[dict[str, Any]]] = {
        s: [{"role": "user", "content": f"Say a word about the colour {c}."}]
        for s, c in (("s1", "red"), ("s2", "blue"))
    }
    server = Serve(root, port, log)
    last: dict[str, Any] = {}
    try:
        for turn in range(2):
            for session, messages in conversations.items():
                answer = server.chat(session, messages)
                if turn:
                    assert answer.usage.prompt_tokens_details.cached_tokens > 0, answer.usage
                messages += [
                    {"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": "And one more?"},
                ]
                last[session] = answer.usage
    finally:
        assert server.stop() in (0, -signal.SIGTERM), log.read_text()[-3000:]
    saved = files(root)
    assert sum(f.startswith("worker-0/") for f in saved) == 1, saved  # one session per worker
    assert sum(f.startswith("worker-1/") for f in saved) == 1, saved
    assert sum(f.startswith("openai-turns/") for f in saved) == 2, saved

    server = Serve(root, port, log)
    try:
        for session, messages in conversations.items():
            answer = server.chat(session, messages)
            cached = answer.usage.prompt_tokens_details.cached_tokens
            # the whole conversation before this turn: the last prompt and its spliced reply
            assert cached >= last[session].prompt_tokens + last[session].completion_tokens - 1, (
                session,
                answer.usage,
                last[session],
            )
        # every slot holds a restored session: a new one closes the least recently used (s1)
        fresh = server.chat("s3", [{"role": "user", "content": "Hello"}])
        assert fresh.choices[0].message.content is not None
        saved = files(root)
        assert not [f for f in saved if f.endswith(".turns.jsonl") and "s1" in f]
        turns_left = [f for f in saved if f.startswith("openai-turns/")]
        assert len(turns_left) == 2, saved  # s2's and s3's
    finally:
        assert server.stop() in (0, -signal.SIGTERM), log.read_text()[-3000:]
