"""Tiers and --session-dir through a real worker process on the default model: sessions
beyond --max-resident come back warm, and after a kill -9 a new worker on the same directory
resumes them instead of re-prefilling (what the supervisor's rebuild then finds)."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest
from test_worker_process import Worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def worker(session_dir: Path) -> Worker:
    return Worker(
        [sys.executable, "-m", "worker.main", "--threads", "1", "--max-sessions", "6",
         "--max-resident", "2", "--max-context", "256", "--prefill-chunk", "64",
         "--session-dir", str(session_dir)]
    )  # fmt: skip


def saved_lengths(session_dir: Path) -> dict[str, int]:
    """How many resident ids each session's file holds (read from its header)."""
    lengths = {}
    for path in session_dir.glob("*.tpsession"):  # (files are renamed into place whole)
        raw = path.read_bytes()
        (size,) = struct.unpack("<Q", raw[8:16])
        header = json.loads(raw[16 : 16 + size])
        lengths[header["session_id"]] = len(header["resident_ids"])
    return lengths


def turn(w: Worker, sid: str, ids: list[int], rid: str) -> dict:
    _, done, _ = w.run(
        {"id": rid, "prompt_segments": [{"ids": ids}], "add_prefix": False,
         "max_new_tokens": 3, "session_id": sid}
    )  # fmt: skip
    assert "done" in done, done
    return done


def test_tiers_and_restart_from_session_dir(tmp_path: Path) -> None:
    w = worker(tmp_path)
    assert w.ready["max_sessions"] == 6 and w.ready["max_resident"] == 2
    history: dict[str, list[int]] = {}
    for i, sid in enumerate("abc"):
        prompt = [2] + [1000 + 37 * i + j for j in range(40)]
        done = turn(w, sid, prompt, f"{sid}1")
        history[sid] = prompt + done["generated_token_ids"]
    # a was pushed out of the device by c; it comes back with its cache
    done = turn(w, "a", history["a"] + [4000, 4001], "a2")
    assert done["session_reset_reason"] == "exact_prefix"
    assert done["reused_prompt_tokens"] == len(history["a"]) - 1
    history["a"] += [4000, 4001] + done["generated_token_ids"]
    w.send({"op": "stats", "id": "s"})
    stats = w.read()["stats"]
    assert stats["tiers"]["offloads"] >= 2 and stats["tiers"]["reloads"] >= 1, stats
    # idle: every session is saved by the writer thread, a as it is after a2 (not its first
    # file, which is there already: wait for the files' contents, not their number)
    deadline = time.monotonic() + 120
    want = {sid: len(ids) - 1 for sid, ids in history.items()}
    while saved_lengths(tmp_path) != want:
        assert time.monotonic() < deadline, (saved_lengths(tmp_path), want, w.tail())
        time.sleep(0.1)
    w.proc.kill()  # a crash
    w.proc.wait()

    w2 = worker(tmp_path)
    deadline = time.monotonic() + 10  # the line is read from stderr by a thread of its own
    while not any(b"restored 3 session(s)" in line for line in w2.stderr):
        assert time.monotonic() < deadline, w2.tail()
        time.sleep(0.05)
    for sid in "abc":
        done = turn(w2, sid, history[sid] + [5000], f"{sid}3")
        assert done["session_reset_reason"] == "exact_prefix", (sid, done)
        assert done["reused_prompt_tokens"] == len(history[sid]) - 1
    w2.send({"op": "close", "session_id": "b", "id": "c"})
    assert w2.read()["closed"] is True
    assert w2.close() == 0  # EOF: the remaining sessions are saved, then exit 0
    assert len(list(tmp_path.glob("*.tpsession"))) == 2
    assert not list(tmp_path.glob("*.tmp"))
