"""Faults: kill -9 mid-prefill (the requests are sent again) and mid-decode (worker_lost), a
SIGSTOPped worker caught by the heartbeat, a worker whose stdout closes, an injected
out-of-memory error in a forward pass.

One `tokenpipe run` with one worker on a tiny random llama checkpoint serves the supervisor
scenarios in file order (each restart costs a worker start, not a model load of the default
model). Faults are injected through `worker/faults.py` (`python -m worker.faults` wraps the
engine's model): `sleep@forward:*:0.05` slows every step so kills land where they are aimed,
and TOKENPIPE_FAULT_FILE arms one-shot faults. In every case: each request ends exactly once,
with its own id (`worker_lost` only for one that had streamed output), and a named session is
rebuilt so that its next turn equals the same turn on a session that never crashed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.reliability.helpers import (
    TERMINAL,
    LineProcess,
    check_exactly_once,
    generated_text,
    run_argv,
    write_tiny_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LONG_PROMPT = "hello world, " * 16  # ~200 byte-level tokens: 50 prefill chunks of 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def arm_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults") / "arm"


@pytest.fixture(scope="module")
def sup(tiny: Path, arm_file: Path) -> Iterator[LineProcess]:
    proc = LineProcess(
        run_argv(
            "--model",
            str(tiny),
            "--max-sessions",
            "4",
            "--prefill-chunk",
            "4",
            "--heartbeat-timeout",
            "3",
            "--heartbeat-interval",
            "0.5",
            "--worker-command",
            f"{sys.executable} -m worker.faults",
        ),
        env={"TOKENPIPE_FAULT": "sleep@forward:*:0.05", "TOKENPIPE_FAULT_FILE": str(arm_file)},
    )
    proc.wait_ready(timeout=300)
    proc.sent_ids: list[Any] = []  # type: ignore[misc]
    yield proc
    code = proc.close()
    assert code == 0, proc.stderr_text()
    assert not proc.bad_lines, proc.bad_lines[:5]
    # The whole module's traffic: every request ended exactly once, with its own id.
    check_exactly_once(proc.sent_ids, proc.all_events)  # type: ignore[attr-defined]


def send(proc: LineProcess, request: dict[str, Any]) -> None:
    proc.sent_ids.append(request["id"])  # type: ignore[attr-defined]
    proc.send(request)


def ask(proc: LineProcess, request: dict[str, Any]) -> list[dict[str, Any]]:
    proc.sent_ids.append(request["id"])  # type: ignore[attr-defined]
    return proc.ask(request, timeout=300)


def worker_pid(proc: LineProcess, tag: str) -> int:
    stats = ask(proc, {"op": "stats", "id": f"stats-{tag}"})[-1]["stats"]
    pid = stats["workers"][0]["pid"]
    assert isinstance(pid, int), stats
    return pid


def wait_restarted(proc: LineProcess, old_pid: int, tag: str, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = ask(proc, {"op": "stats", "id": f"stats-{tag}-{time.monotonic()}"})[-1]["stats"]
        worker = stats["workers"][0]
        if worker["state"] == "ready" and worker["pid"] not in (None, old_pid):
            return int(worker["pid"])
        time.sleep(0.5)
    raise AssertionError(f"worker not restarted; stderr: {proc.stderr_text()}")


def turn(sid: str, rid: str, prompt: Any, n: int = 6) -> dict[str, Any]:
    """A generate on `sid`: `prompt` is text (turn 1) or token ids (turn 2, no prefix)."""
    if isinstance(prompt, str):
        return {"id": rid, "prompt": prompt, "max_new_tokens": n, "session_id": sid}
    return {
        "id": rid,
        "prompt_segments": [{"ids": prompt}, {"text": " world"}],
        "add_prefix": False,
        "max_new_tokens": n,
        "session_id": sid,
    }


def run_turns(
    proc: LineProcess, sid: str, crash: Any = None
) -> tuple[list[int], dict[str, Any], str]:
    """Turn 1 on `sid`, then `crash(proc, sid)` if given, then turn 2 continuing turn 1
    exactly (its prompt ids + generated ids + more text). Returns turn 1's generated ids and
    turn 2's done line and text."""
    assert ask(proc, {"op": "open", "session_id": sid, "id": f"open-{sid}"})[-1]["opened"]
    first = ask(proc, turn(sid, f"{sid}-t1", "hello"))
    assert first[-1]["event"] == "done", first[-1]
    prompt1 = ask(
        proc, {"op": "tokenize", "text": "hello", "add_prefix": True, "id": f"tok-{sid}"}
    )[-1]["tokens"]
    generated1 = first[-1]["generated_token_ids"]
    if crash is not None:
        crash(proc, sid)
    second = ask(proc, turn(sid, f"{sid}-t2", prompt1 + generated1))
    assert second[-1]["event"] == "done", second[-1]
    ask(proc, {"op": "close", "session_id": sid, "id": f"close-{sid}"})
    return generated1, second[-1], generated_text(second, f"{sid}-t2")


def crash_then_continue(proc: LineProcess, tag: str, crash: Any) -> None:
    """Session `s-tag` holds turn 1; `crash(proc, sid)` runs while a long request is in flight
    on it and an anonymous one on the same worker; turn 2 on the rebuilt session reuses the
    mirrored tokens (the rebuild happened) and equals turn 2 on a session that never crashed."""
    ref1, ref_done, ref_text = run_turns(proc, f"ref-{tag}")
    assert ref_done["session_reset_reason"] == "exact_prefix", ref_done
    got1, done, text = run_turns(proc, f"s-{tag}", crash)
    assert got1 == ref1
    assert text == ref_text and done["generated_token_ids"] == ref_done["generated_token_ids"]
    assert done["reused_prompt_tokens"] == ref_done["reused_prompt_tokens"] > 0, done
    assert done["session_reset_reason"] == "exact_prefix", done


def _lost_pair(proc: LineProcess, sid: str, tag: str, kill: Any) -> None:
    """Start a long named request and an anonymous one, run `kill(pid)` once the named one
    has streamed output: it ends once with worker_lost; the anonymous one ends once too, with
    worker_lost if it had streamed output, else with `done` (it was sent again)."""
    pid = worker_pid(proc, f"{tag}-before")
    named, anon = f"{tag}-named", f"{tag}-anon"
    send(proc, {"id": named, "prompt": "hellohello", "max_new_tokens": 200, "session_id": sid})
    send(proc, {"id": anon, "prompt": "hello", "max_new_tokens": 40})
    proc.read_until(lambda e: e.get("id") == named and e["event"] == "token", timeout=120)
    kill(pid)
    ended: dict[Any, dict[str, Any]] = {}
    proc.read_until(
        lambda e: (
            e.get("id") in (named, anon)
            and e["event"] in TERMINAL
            and ended.setdefault(e["id"], e) is e
            and len(ended) == 2
        ),
        timeout=120,
    )
    assert ended[named]["event"] == "error" and ended[named]["code"] == "worker_lost", ended
    if ended[anon]["event"] == "error":
        assert ended[anon]["code"] == "worker_lost", ended
        assert any(e.get("id") == anon and e["event"] == "token" for e in proc.all_events)
    else:
        assert ended[anon]["event"] == "done", ended
    wait_restarted(proc, pid, tag)


def test_kill_9_mid_prefill_sends_both_again(sup: LineProcess) -> None:
    """kill -9 while a named and an anonymous request are in prefill (no output yet), then a
    request sent at once (to the dead worker, or after the supervisor saw the death): all
    three end with `done`, equal to the same requests on a worker that did not crash (the
    named one on its session, rebuilt from the mirror)."""
    for sid in ("ref-prefill", "s-prefill"):
        assert ask(sup, {"op": "open", "session_id": sid, "id": f"open-{sid}"})[-1]["opened"]
        assert ask(sup, turn(sid, f"{sid}-t1", "hello"))[-1]["event"] == "done"

    def requests(tag: str, sid: str) -> list[dict[str, Any]]:
        return [
            turn(sid, f"{tag}-named", "hello" + LONG_PROMPT, n=8),
            {"id": f"{tag}-anon", "prompt": LONG_PROMPT, "max_new_tokens": 8},
            {"id": f"{tag}-late", "prompt": "hi there", "max_new_tokens": 4},
        ]

    reference = [ask(sup, r)[-1] for r in requests("ref", "ref-prefill")]
    pid = worker_pid(sup, "prefill-before")
    named, anon, late = requests("crash", "s-prefill")
    send(sup, named)
    send(sup, anon)
    time.sleep(1.0)
    assert not any(e.get("id") in (named["id"], anon["id"]) for e in sup.all_events)
    os.kill(pid, signal.SIGKILL)
    send(sup, late)
    ended: dict[Any, dict[str, Any]] = {}
    ids = {r["id"] for r in (named, anon, late)}
    sup.read_until(
        lambda e: (
            e.get("id") in ids
            and e["event"] in TERMINAL
            and ended.setdefault(e["id"], e) is e
            and len(ended) == 3
        ),
        timeout=300,
    )
    for request, ref in zip((named, anon, late), reference, strict=True):
        done = ended[request["id"]]
        assert done["event"] == "done", done
        assert done["generated_token_ids"] == ref["generated_token_ids"], (done, ref)
    assert ended[named["id"]]["reused_prompt_tokens"] > 0  # the session was rebuilt first
    wait_restarted(sup, pid, "prefill")
    for sid in ("ref-prefill", "s-prefill"):
        ask(sup, {"op": "close", "session_id": sid, "id": f"close-{sid}"})


def test_kill_9_mid_decode(sup: LineProcess) -> None:
    def crash(proc: LineProcess, sid: str) -> None:
        _lost_pair(proc, sid, "decode", lambda pid: os.kill(pid, signal.SIGKILL))

    crash_then_continue(sup, "decode", crash)


def test_sigstop_caught_by_heartbeat(sup: LineProcess) -> None:
    stopped: list[int] = []

    def stop(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    def crash(proc: LineProcess, sid: str) -> None:
        started = time.monotonic()
        _lost_pair(proc, sid, "sigstop", stop)
        assert time.monotonic() - started < 120
        assert (
            not psutil.pid_exists(stopped[0])
            or psutil.Process(stopped[0]).status() == psutil.STATUS_ZOMBIE
        ), "the stopped worker was not killed"

    crash_then_continue(sup, "sigstop", crash)
    assert any(b"heartbeat timeout" in line for line in sup.stderr), sup.stderr_text()


def test_worker_stdout_closes(sup: LineProcess, arm_file: Path) -> None:
    def crash(proc: LineProcess, sid: str) -> None:
        def close_stdout(pid: int) -> None:
            arm_file.write_text("close_stdout@forward:1")

        _lost_pair(proc, sid, "stdout", close_stdout)

    crash_then_continue(sup, "stdout", crash)


def test_injected_oom_fails_that_request_only(sup: LineProcess, arm_file: Path) -> None:
    """An out-of-memory error in a forward answers `out_of_memory` for the request in that
    step; the worker keeps serving (same pid), frees the slot, and a named session that was
    not in the step continues exactly (cache kept)."""
    pid = worker_pid(sup, "oom-before")
    reference = ask(sup, {"id": "oom-ref", "prompt": "hi", "max_new_tokens": 3})
    before = ask(sup, {"op": "stats", "id": "stats-oom-1"})[-1]["stats"]

    def oom(proc: LineProcess, sid: str) -> None:
        arm_file.write_text("oom@forward:1")  # taken by the next forward, which fails
        victim = ask(proc, {"id": "oom-victim", "prompt": "hi", "max_new_tokens": 3})
        assert victim[-1]["event"] == "error", victim
        assert victim[-1]["code"] == "out_of_memory", victim
        assert not arm_file.exists()
        after = ask(proc, {"op": "stats", "id": "stats-oom-2"})[-1]["stats"]
        assert after["workers"][0]["pid"] == pid, "the worker must survive an OOM"
        assert after["active_requests"] == 0, after
        assert after["free_slots"] == before["free_slots"] - 1, after  # only sid holds one
        again = ask(proc, {"id": "after-oom", "prompt": "hi", "max_new_tokens": 3})
        assert again[-1]["event"] == "done", again[-1]
        assert again[-1]["generated_token_ids"] == reference[-1]["generated_token_ids"]

    crash_then_continue(sup, "oom", oom)
    assert worker_pid(sup, "oom-after") == pid


def test_nothing_leaked_after_faults(sup: LineProcess) -> None:
    stats = ask(sup, {"op": "stats", "id": "stats-final"})[-1]["stats"]
    assert stats["active_requests"] == 0 and stats["queued_requests"] == 0, stats
    assert stats["sessions"] == 0 and stats["free_slots"] == 4, stats
    assert stats["workers"][0]["restarts"] >= 4, stats
