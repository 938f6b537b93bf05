"""`tokenpipe run` with real CPU workers on the default model (Gemma 3 270M).

Slow by nature (each worker loads the model), so one two-worker supervisor serves most
tests of this module (in file order), and generations are a few tokens long.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from supervisor.client import run_command
from tests.supervisor.conftest import REPO, JsonlProcess, gone, terminal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER_FLAGS = ("--max-context", "256", "--threads", "1")


@pytest.fixture(scope="module")
def two() -> Iterator[JsonlProcess]:
    proc = JsonlProcess.run(
        "--workers", "2", "--max-sessions", "3", "--max-queue", "2", *WORKER_FLAGS
    )
    ready = proc.read(timeout=400)
    assert ready is not None, b"".join(proc.stderr)[-3000:]
    assert ready["max_sessions"] == 6 and ready["max_named_sessions"] == 4
    assert ready["workers"] == 2
    yield proc
    if proc.proc.poll() is None:
        proc.kill()


def ask(proc: JsonlProcess, request: dict[str, Any]) -> list[dict[str, Any]]:
    proc.send(request)
    return proc.read_until(lambda e: terminal(e) and e.get("id") == request.get("id"), timeout=400)


def stats(proc: JsonlProcess) -> dict[str, Any]:
    events = ask(proc, {"op": "stats", "id": f"stats-{time.monotonic()}"})
    return events[-1]["stats"]


def test_sessions_land_on_both_workers_and_stay(two: JsonlProcess) -> None:
    for sid in ("a", "b", "c", "d"):
        assert ask(two, {"op": "open", "session_id": sid, "id": f"open-{sid}"})[-1]["opened"]
    placed = {w["index"]: set(w["named_sessions"]) for w in stats(two)["workers"]}
    assert placed[0] and placed[1] and placed[0] | placed[1] == {"a", "b", "c", "d"}
    for sid in ("a", "d"):
        done = ask(two, {"prompt": "Hello", "max_new_tokens": 1, "session_id": sid, "id": sid})
        assert done[-1]["event"] == "done", done
    s = stats(two)
    assert {w["index"]: set(w["named_sessions"]) for w in s["workers"]} == placed  # affinity
    assert s["sessions"] == 4 == sum(w["worker"]["sessions"] for w in s["workers"])
    assert s["rss_bytes"] == sum(w["rss_bytes"] for w in s["workers"]) > 100_000_000
    assert all(w["restarts"] == 0 and w["uptime_s"] > 0 for w in s["workers"])
    for sid in ("a", "b", "c", "d"):
        assert ask(two, {"op": "close", "session_id": sid, "id": f"close-{sid}"})[-1]["closed"]
    assert stats(two)["sessions"] == 0


def test_kill_9_mid_generation_then_same_greedy_continuation(two: JsonlProcess) -> None:
    # x and y hold the same conversation on different workers; x's worker dies mid-turn.
    for sid in ("x", "y"):
        ask(two, {"op": "open", "session_id": sid, "id": f"open-{sid}"})
    workers = {w["index"]: w for w in stats(two)["workers"]}
    x_worker = next(i for i, w in workers.items() if "x" in w["named_sessions"])
    assert "y" in workers[1 - x_worker]["named_sessions"]
    first = {}
    for sid in ("x", "y"):
        done = ask(
            two, {"prompt": "My name is", "max_new_tokens": 2, "session_id": sid, "id": f"t1-{sid}"}
        )[-1]
        first[sid] = done["generated_token_ids"]
    assert first["x"] == first["y"]
    two.send(
        {"prompt": "My name is Anna and", "max_new_tokens": 60, "session_id": "x", "id": "doomed"}
    )
    token = two.read(timeout=400)
    assert token is not None and token["event"] == "token" and token["id"] == "doomed"
    os.kill(workers[x_worker]["pid"], signal.SIGKILL)
    events = two.read_until(lambda e: terminal(e) and e.get("id") == "doomed", timeout=60)
    answers = [e for e in events if e.get("id") == "doomed" and terminal(e)]
    assert [e["code"] for e in answers] == ["worker_lost"]
    second = {}
    for sid in ("x", "y"):
        done = ask(
            two,
            {
                "prompt": "My name is Anna and",
                "max_new_tokens": 3,
                "session_id": sid,
                "id": f"t2-{sid}",
            },
        )[-1]
        assert done["event"] == "done", done
        second[sid] = done
    assert second["x"]["generated_token_ids"] == second["y"]["generated_token_ids"]
    # The rebuilt cache was reused, not re-prefilled from scratch.
    assert second["x"]["reused_prompt_tokens"] == second["y"]["reused_prompt_tokens"] > 0
    after = {w["index"]: w for w in stats(two)["workers"]}
    assert after[x_worker]["restarts"] == 1 and after[x_worker]["pid"] != workers[x_worker]["pid"]
    # Nothing else arrived for the lost request.
    two.send({"op": "ping", "id": "p"})
    assert two.read_until(lambda e: e.get("id") == "p")[-1]["event"] == "pong"


def test_flood_beyond_max_queue(two: JsonlProcess) -> None:
    ids = [f"flood-{i}" for i in range(10)]
    for rid in ids:
        two.send({"prompt": "Count: one, two,", "max_new_tokens": 2, "id": rid})
    finals: dict[str, dict[str, Any]] = {}
    while len(finals) < len(ids):
        event = two.read(timeout=400)
        assert event is not None
        if terminal(event):
            finals[event["id"]] = event
    overloaded = [r for r in ids if finals[r].get("code") == "overloaded"]
    done = [r for r in ids if finals[r]["event"] == "done"]
    assert overloaded and len(done) >= 2 and len(done) + len(overloaded) == len(ids)
    assert all(finals[r]["completion_tokens"] == 2 for r in done)


def test_eof_finishes_in_flight_and_leaves_no_children(two: JsonlProcess) -> None:
    children = [p.pid for p in two.descendants()]
    assert len(children) >= 2
    two.send({"prompt": "The sky is", "max_new_tokens": 2, "id": "last"})
    two.close_stdin()
    events = two.read_until(lambda e: terminal(e) and e.get("id") == "last", timeout=400)
    assert events[-1]["event"] == "done"
    assert two.proc.wait(120) == 0
    assert two.read(timeout=5) is None
    assert gone(children)


# ------------------------------------------------------------------ one worker, a socket


@pytest.fixture(scope="module")
def listening(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[JsonlProcess, str]]:
    sock = str(tmp_path_factory.mktemp("sock") / "tp.sock")
    proc = JsonlProcess.run("--workers", "1", "--listen", sock, *WORKER_FLAGS)
    ready = proc.read(timeout=400)
    assert ready is not None and ready["ready"], b"".join(proc.stderr)[-3000:]
    deadline = time.monotonic() + 10
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield proc, sock
    if proc.proc.poll() is None:
        proc.kill()


def tokenpipe(*args: str, stdin: str = "", timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*run_command(), *args],
        input=stdin.encode(),
        capture_output=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_generate_streams_text_and_json(listening: tuple[JsonlProcess, str]) -> None:
    _, sock = listening
    plain = tokenpipe(
        "generate", "The capital of France is", "--max-new-tokens", "3", "--connect", sock
    )
    assert plain.returncode == 0, plain.stderr
    text = plain.stdout.decode()
    assert 0 < len(text) and "{" not in text
    as_json = tokenpipe(
        "generate",
        "-",
        "--json",
        "--max-new-tokens",
        "3",
        "--connect",
        sock,
        stdin="The capital of France is",
    )
    assert as_json.returncode == 0, as_json.stderr

    lines = [orjson.loads(line) for line in as_json.stdout.splitlines()]
    assert [e["event"] for e in lines] == ["token", "token", "token", "done"]
    assert "".join(e["token"] for e in lines[:-1]) == text  # greedy: the same text
    # Sessions persist across invocations through the socket.
    one = tokenpipe(
        "generate",
        "Once upon a time",
        "--max-new-tokens",
        "2",
        "--json",
        "--connect",
        sock,
        "--session",
        "story",
    )
    two = tokenpipe(
        "generate",
        "Once upon a time, there",
        "--max-new-tokens",
        "2",
        "--json",
        "--connect",
        sock,
        "--session",
        "story",
    )
    done_two = orjson.loads(two.stdout.splitlines()[-1])
    assert one.returncode == 0 and two.returncode == 0
    assert done_two["reused_prompt_tokens"] > 0


def test_generate_in_process_and_exit_status() -> None:
    ok = tokenpipe("generate", "Hello", "--max-new-tokens", "2", "-q", *WORKER_FLAGS)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout and b"worker" not in ok.stdout
    # An invalid model path: non-zero status and a message on stderr.
    bad = tokenpipe(
        "generate", "Hello", "--model", "/nonexistent/model", "-q", *WORKER_FLAGS, timeout=120
    )
    assert bad.returncode != 0 and bad.stdout == b""
    assert b"tokenpipe generate" in bad.stderr


def test_chat_in_a_pseudo_terminal(listening: tuple[JsonlProcess, str]) -> None:
    pexpect = pytest.importorskip("pexpect")
    _, sock = listening
    child = pexpect.spawn(
        run_command()[0],
        [
            *run_command()[1:],
            "chat",
            "--connect",
            sock,
            "--max-new-tokens",
            "3",
            "--session",
            "tty",
        ],
        cwd=str(REPO),
        timeout=300,
        encoding="utf-8",
    )
    try:
        child.expect("> ")
        child.sendline("Hi there")
        child.expect("> ")
        reply = child.before.strip()
        assert reply  # streamed a reply
        child.sendline("/reset")
        child.expect("conversation reset")
        child.expect("> ")
        child.sendeof()  # Ctrl-D
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_sigterm_leaves_no_children(listening: tuple[JsonlProcess, str]) -> None:
    proc, sock = listening
    children = [p.pid for p in proc.descendants()]
    assert children
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(60) == 0
    assert gone(children)
    assert not Path(sock).exists()
