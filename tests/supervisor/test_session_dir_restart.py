"""`tokenpipe run --session-dir` with two real CPU workers on the default model (issue 16):

- each worker saves its sessions in a directory of its own (DIR/worker-N), never the other's;
- after the whole supervisor restarts, its ready line lists the restored sessions and each
  goes back to the worker that holds it on disk: the next turn reuses the saved cache;
- after a worker's kill -9, the restarted worker restores its own sessions from disk and
  their next turn is warm again (the supervisor does not rebuild them over the saved copy);
- a restored cache gives the same greedy tokens as the same prompt prefilled cold.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.supervisor.conftest import JsonlProcess, terminal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SESSIONS = ("a", "b", "c", "d")
FLAGS = ("--workers", "2", "--max-context", "256", "--threads", "1", "--max-sessions", "4")


def start(session_dir: Path) -> tuple[JsonlProcess, dict[str, Any]]:
    proc = JsonlProcess.run(*FLAGS, "--session-dir", str(session_dir))
    ready = proc.read(timeout=400)
    assert ready is not None and ready["event"] == "ready", b"".join(proc.stderr)[-3000:]
    return proc, ready


def ask(proc: JsonlProcess, request: dict[str, Any]) -> dict[str, Any]:
    proc.send(request)
    events = proc.read_until(lambda e: terminal(e) and e.get("id") == request["id"], 400)
    return events[-1]


def turn(proc: JsonlProcess, sid: str, ids: list[int], rid: str) -> dict[str, Any]:
    request = {
        "id": rid,
        "prompt_segments": [{"ids": ids}],
        "add_prefix": False,
        "max_new_tokens": 3,
    }
    if sid:
        request["session_id"] = sid
    done = ask(proc, request)
    assert done["event"] == "done", done
    return done


def workers(proc: JsonlProcess) -> list[dict[str, Any]]:
    return ask(proc, {"op": "stats", "id": f"stats-{time.monotonic()}"})["stats"]["workers"]


def placement(proc: JsonlProcess) -> dict[str, int]:
    return {s: w["index"] for w in workers(proc) for s in w["named_sessions"]}


def saved_files(root: Path) -> dict[str, set[str]]:
    return {
        d.name: {p.name for p in d.glob("*.tpsession")}
        for d in sorted(root.iterdir())
        if d.is_dir()
    }


def test_sessions_come_back_warm_on_their_worker(tmp_path: Path) -> None:
    root = tmp_path / "sessions"
    proc, ready = start(root)
    assert "restored_sessions" not in ready
    history: dict[str, list[int]] = {}
    try:
        for i, sid in enumerate(SESSIONS):
            prompt = [2] + [1000 + 37 * i + j for j in range(40)]
            history[sid] = prompt + turn(proc, sid, prompt, f"{sid}1")["generated_token_ids"]
        before = placement(proc)
        assert set(before) == set(SESSIONS) and set(before.values()) == {0, 1}, before
        proc.close_stdin()  # EOF: the workers save every session, then exit
        assert proc.proc.wait(timeout=120) == 0
    finally:
        if proc.proc.poll() is None:
            proc.kill()
    files = saved_files(root)
    assert set(files) == {"worker-0", "worker-1"} and not list(root.glob("*.tpsession"))
    assert len(files["worker-0"]) + len(files["worker-1"]) == 4
    assert len(files["worker-0"]) == sum(1 for w in before.values() if w == 0)

    # the whole supervisor restarts: every session goes back to the worker holding it
    proc, ready = start(root)
    try:
        assert sorted(ready["restored_sessions"]) == list(SESSIONS)
        assert placement(proc) == before
        for sid in SESSIONS:
            done = turn(proc, sid, history[sid] + [5000], f"{sid}2")
            assert done["session_reset_reason"] == "exact_prefix", (sid, done)
            assert done["reused_prompt_tokens"] == len(history[sid]) - 1, (sid, done)
            cold = turn(proc, "", history[sid] + [5000], f"{sid}-cold")
            assert cold["reused_prompt_tokens"] < done["reused_prompt_tokens"]
            assert done["generated_token_ids"] == cold["generated_token_ids"], sid
            history[sid] += [5000] + done["generated_token_ids"]
        assert placement(proc) == before

        # kill -9 worker 0 once it has saved the new turns: its restart finds its own files
        victim = next(w for w in workers(proc) if w["index"] == 0)
        deadline = time.monotonic() + 60
        while victim["worker"]["tiers"]["disk_writes"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            victim = next(w for w in workers(proc) if w["index"] == 0)
        assert victim["worker"]["tiers"]["disk_writes"] >= 2, victim
        time.sleep(0.5)  # the last write's rename
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            now = next(w for w in workers(proc) if w["index"] == 0)
            if now["restarts"] == 1 and now["state"] == "ready":
                break
            time.sleep(0.5)
        assert now["restarts"] == 1, now
        for sid in SESSIONS:
            done = turn(proc, sid, history[sid] + [6000], f"{sid}3")
            assert done["session_reset_reason"] == "exact_prefix", (sid, done)
            assert done["reused_prompt_tokens"] == len(history[sid]) - 1, (sid, done)
        assert placement(proc) == before
        assert any(b"restored 2 session(s)" in line for line in proc.stderr) or any(
            b"restored" in line and b"worker-0" in line for line in proc.stderr
        )
        assert ask(proc, {"op": "close", "session_id": "a", "id": "close-a"})["closed"] is True
        proc.close_stdin()
        assert proc.proc.wait(timeout=120) == 0
    finally:
        if proc.proc.poll() is None:
            proc.kill()
    files = saved_files(root)
    assert sum(len(f) for f in files.values()) == 3  # close deleted a's file
