"""The event loop `tokenpipe run` serves on (uvloop where installed, asyncio otherwise), and
the relay's ordering guarantees on each: a request's events in order, exactly one terminal
event per request, id-less requests answered in arrival order."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
from typing import Any

import pytest

from protocol import DoneEvent, ErrorEvent, GenerateRequest
from supervisor import eventloop
from supervisor.client import AsyncClient
from tests.supervisor.conftest import FAKE_WORKER, JsonlProcess, fake_config, terminal

pytestmark = pytest.mark.timeout(60)

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
LOOPS = [
    "asyncio",
    pytest.param(
        "uvloop", marks=pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop is not installed")
    ),
]


async def _running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_falls_back_to_asyncio_when_uvloop_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(eventloop.ENV_VAR, raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_running_loop_module()).startswith("asyncio")


def test_env_var_forces_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV_VAR, "asyncio")
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_running_loop_module()).startswith("asyncio")


@pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop is not installed")
def test_uses_uvloop_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(eventloop.ENV_VAR, raising=False)
    assert eventloop.loop_name() == "uvloop"
    assert eventloop.run(_running_loop_module()).startswith("uvloop")


def _check_stream(events: list[dict[str, Any]], tokens: int) -> None:
    """Tokens, then one done whose generated ids spell exactly the relayed token text (a
    burst's done has no ids: its tokens are all "x")."""
    assert [e["event"] for e in events] == ["token"] * tokens + ["done"], events
    text = "".join(e["token"] for e in events[:-1])
    done = events[-1]
    assert done["completion_tokens"] == tokens
    ids = done.get("generated_token_ids")
    assert text == ("x" * tokens if ids is None else "".join(chr(i - 10) for i in ids))


@pytest.mark.parametrize("loop", LOOPS)
def test_run_relay_order_on_each_loop(loop: str) -> None:
    """Interleaved id'd requests (paced and burst: tokens and done in one pipe read) and
    id-less ones (with a bad line among them) through `tokenpipe run` on `loop`."""
    proc = JsonlProcess.run(
        "--workers", "2", "--worker-command",
        " ".join([*FAKE_WORKER, "--fake-burst", "--fake-token-delay", "0.001"]),
        env={eventloop.ENV_VAR: loop})  # fmt: skip
    try:
        ready = proc.read()
        assert ready is not None and ready["ready"] is True
        sizes = {"a": 40, "b": 3, "c": 2000, "d": 1, "e": 500, "f": 0}
        for rid, n in sizes.items():
            prompt = "BURST" if rid in ("c", "e") else f"prompt {rid}"
            proc.send({"prompt": prompt, "max_new_tokens": n, "id": rid})
        anonymous = [("aaa", 7), ("BURST", 300), (None, 0), ("bbb", 5), ("BURST", 2)]
        for prompt, n in anonymous:
            if prompt is None:
                proc.send({"op": "nope"})
            else:
                proc.send({"prompt": prompt, "max_new_tokens": n})
        by_id: dict[str, list[dict[str, Any]]] = {rid: [] for rid in sizes}
        answers: list[list[dict[str, Any]]] = [[]]
        while len(answers) <= len(anonymous) or any(
            not by_id[r] or by_id[r][-1]["event"] == "token" for r in sizes
        ):
            event = proc.read()
            assert event is not None, b"".join(proc.stderr)[-2000:]
            if "id" in event:
                assert not by_id[event["id"]] or not terminal(by_id[event["id"]][-1]), (
                    f"an event after {event['id']}'s terminal event: {event}"
                )
                by_id[event["id"]].append(event)
            else:
                answers[-1].append(event)
                if terminal(event):
                    answers.append([])
        for rid, n in sizes.items():
            _check_stream(by_id[rid], n)
        assert answers[-1] == []
        for (prompt, n), answer in zip(anonymous, answers, strict=False):
            if prompt is None:
                assert [e["code"] for e in answer] == ["unknown_op"]
            else:
                _check_stream(answer, n)
        proc.send({"op": "stats", "id": "s"})
        stats = proc.read_until(lambda e: e.get("id") == "s")[-1]
        assert stats["stats"]["supervisor"]["event_loop"] == loop
        proc.close_stdin()
        assert proc.proc.wait(20) == 0
        assert proc.read() is None  # nothing after the last answer
    finally:
        if proc.proc.poll() is None:
            proc.kill()


@pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop is not installed")
def test_in_process_crash_recovery_on_uvloop() -> None:
    """The pool's pipe and exit callbacks under uvloop: a worker killed mid-generation ends its
    request with exactly one worker_lost, restarts, and its session is rebuilt."""
    import uvloop

    async def main() -> None:
        client = await AsyncClient.in_process(fake_config(1), stderr_sink=lambda _: None)
        try:
            sup = client.supervisor
            assert sup is not None
            events: list[Any] = [
                e
                async for e in client.generate(
                    GenerateRequest(prompt="warm", max_new_tokens=2, session_id="k")
                )
            ]
            assert isinstance(events[-1], DoneEvent)
            events = []
            async for event in client.generate(
                GenerateRequest(prompt="warm more", max_new_tokens=10_000, session_id="k")
            ):
                events.append(event)
                if len(events) == 3:
                    os.kill(sup.slots[0].process.pid, signal.SIGKILL)  # type: ignore[union-attr]
            errors = [e for e in events if isinstance(e, ErrorEvent)]
            assert len(errors) == 1 and errors[0].code == "worker_lost"
            assert events[-1] is errors[0]
            events = [
                e
                async for e in client.generate(
                    GenerateRequest(prompt="warm again", max_new_tokens=2, session_id="k")
                )
            ]
            assert isinstance(events[-1], DoneEvent)
            assert events[-1].reused_prompt_tokens >= len("warm") + 1
            assert sup.slots[0].restarts == 1
        finally:
            await client.aclose()

    uvloop.run(main())
