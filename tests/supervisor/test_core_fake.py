"""The supervisor against the fake worker (real child processes, no model): multiplexing,
routing, cancel, crash recovery, backpressure, start-up failures."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from protocol import DoneEvent, ErrorEvent, GenerateRequest, TokenEvent
from supervisor.client import AsyncClient, Client, TokenpipeError
from supervisor.core import SupervisorConfig
from supervisor.pool import WorkerStartError
from tests.supervisor.conftest import JsonlProcess, fake_config, gone, terminal

pytestmark = pytest.mark.timeout(60)


def run(config: SupervisorConfig, body: Callable[[AsyncClient], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        client = await AsyncClient.in_process(config, stderr_sink=lambda _: None)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


async def generate(client: AsyncClient, **fields: Any) -> tuple[str, Any]:
    text = []
    last = None
    async for event in client.generate(GenerateRequest(**fields)):
        if isinstance(event, TokenEvent):
            text.append(event.token)
        last = event
    return "".join(text), last


def test_sessions_spread_affinity_and_stats() -> None:
    async def body(client: AsyncClient) -> None:
        assert client.ready.max_sessions == 8 and client.ready.max_named_sessions == 6
        assert client.ready.workers == 2
        for sid in ("a", "b", "c", "d"):
            await client.open_session(sid)
        sup = client.supervisor
        assert sup is not None
        on = {sid: sup.placements[sid] for sid in "abcd"}
        assert set(on.values()) == {0, 1}
        for sid in "abcd":
            _, done = await generate(client, prompt=f"hi {sid}", max_new_tokens=3, session_id=sid)
            assert isinstance(done, DoneEvent) and done.completion_tokens == 3
            assert sup.placements[sid] == on[sid]
            assert done.resident_keep is None  # stripped: the client did not ask for it
        stats = await client.stats()
        assert stats["sessions"] == 4
        assert sum(len(w["named_sessions"]) for w in stats["workers"]) == 4
        assert all(w["worker"]["sessions"] == len(w["named_sessions"]) for w in stats["workers"])
        assert stats["rss_bytes"] == sum(w["rss_bytes"] for w in stats["workers"]) > 0
        await client.close_session("a")
        assert "a" not in sup.placements

    run(fake_config(2), body)


def test_concurrent_ids_interleave_and_duplicates_are_rejected() -> None:
    async def body(client: AsyncClient) -> None:
        results = await asyncio.gather(
            *(generate(client, prompt=f"p{i}", max_new_tokens=5) for i in range(6))
        )
        assert all(isinstance(done, DoneEvent) for _, done in results)
        events: list[Any] = []

        async def consume(rid: str) -> None:
            async for event in client.generate(
                GenerateRequest(prompt="x", max_new_tokens=20, id=rid)
            ):
                events.append(event)

        task = asyncio.ensure_future(consume("same"))
        await asyncio.sleep(0.02)
        _, dup = await generate(client, prompt="y", max_new_tokens=2, id="same")
        assert isinstance(dup, ErrorEvent) and dup.code == "duplicate_id"
        await task
        assert isinstance(events[-1], DoneEvent) and events[-1].completion_tokens == 20

    run(fake_config(1), body)


def test_cancel_and_leaving_the_loop_cancel() -> None:
    async def body(client: AsyncClient) -> None:
        events = []
        async for event in client.generate(
            GenerateRequest(prompt="x", max_new_tokens=10_000, id="long")
        ):
            events.append(event)
            if len(events) == 2:
                await client.cancel("long")
        assert isinstance(events[-1], DoneEvent) and events[-1].finish_reason == "cancelled"
        assert len(events) < 2_000  # not all 10,000 (a token each 2 ms: a stalled box is slow)
        async for _event in client.generate(GenerateRequest(prompt="x", max_new_tokens=10_000)):
            break
        sup = client.supervisor
        assert sup is not None
        for _ in range(500):
            if not sup.slots[0].inflight:
                break
            await asyncio.sleep(0.02)
        assert not sup.slots[0].inflight  # the worker's cancelled done came back
        with pytest.raises(TokenpipeError) as err:
            await client.request({"op": "cancel", "id": "nothing"})
        assert err.value.code == "unknown_id"

    run(fake_config(1), body)


def _conversation(client: AsyncClient, crash: Callable[[], Awaitable[None]] | None):
    async def body() -> tuple[str, str]:
        first, _ = await generate(client, prompt="once upon", max_new_tokens=6, session_id="s")
        if crash is not None:
            await crash()
        second, done = await generate(
            client, prompt="once upon" + first + " then", max_new_tokens=6, session_id="s"
        )
        assert isinstance(done, DoneEvent), done
        return first, second

    return body()


def test_crash_on_cue_loses_one_request_and_session_survives() -> None:
    """A request that kills its worker before any output is sent again once; when it kills
    the restarted worker too, it ends with exactly one `worker_lost`."""

    async def crash_body(client: AsyncClient) -> tuple[str, str]:
        sup = client.supervisor
        assert sup is not None

        async def crash() -> None:
            pid = sup.slots[0].process.pid  # type: ignore[union-attr]
            events = [
                e
                async for e in client.generate(
                    GenerateRequest(prompt="CRASH now", max_new_tokens=5, session_id="s")
                )
            ]
            assert len(events) == 1 and isinstance(events[0], ErrorEvent)
            assert events[0].code == "worker_lost"
            for _ in range(200):
                if sup.slots[0].restarts == 2 and sup.slots[0].process is not None:
                    break
                await asyncio.sleep(0.02)
            assert sup.slots[0].restarts == 2 and sup.slots[0].process.pid != pid  # type: ignore[union-attr]

        return await _conversation(client, crash)

    crashed = run(fake_config(1, "--fake-crash-on", "CRASH"), crash_body)
    clean = run(fake_config(1), lambda c: _conversation(c, None))
    assert crashed == clean


def test_requests_without_output_are_sent_again_after_a_crash() -> None:
    """One request sent just before the worker is killed, one sent to the dead worker before
    the supervisor noticed: neither had output, both are served by the restarted worker (a
    named session's request on the session rebuilt from the mirror)."""

    async def body(client: AsyncClient) -> dict[Any, list[dict[str, Any]]]:
        sup = client.supervisor
        assert sup is not None
        await generate(client, prompt="once upon", max_new_tokens=3, session_id="s")
        answers: dict[Any, list[dict[str, Any]]] = {}
        ended = asyncio.Event()

        def emit(event: dict[str, Any]) -> None:
            answers.setdefault(event.get("id"), []).append(event)
            if sum(e["event"] != "token" for lines in answers.values() for e in lines) == 2:
                ended.set()

        channel = sup.open_channel(emit)
        pid = sup.slots[0].process.pid  # type: ignore[union-attr]
        # stopped first: with a core free, the worker could otherwise read the request and
        # write a token into the pipe between the submit and the kill (seen under load)
        os.kill(pid, signal.SIGSTOP)
        channel.submit({"id": 1, "prompt": "once upon a", "max_new_tokens": 4, "session_id": "s"})
        os.kill(pid, signal.SIGKILL)  # no loop turn in between: nothing of it was read back
        channel.submit({"id": 2, "prompt": "xyz", "max_new_tokens": 4})
        await asyncio.wait_for(ended.wait(), 20)
        assert sup.slots[0].restarts == 1
        stats = await client.stats()
        assert stats["supervisor"]["requests_in_flight"] == 0 and stats["active_requests"] == 0
        assert all(w["queue_depth"] == 0 for w in stats["workers"]), stats
        return answers

    crashed = run(fake_config(1), body)

    async def clean_body(client: AsyncClient) -> tuple[str, str]:
        await generate(client, prompt="once upon", max_new_tokens=3, session_id="s")
        first, _ = await generate(client, prompt="once upon a", max_new_tokens=4, session_id="s")
        second, _ = await generate(client, prompt="xyz", max_new_tokens=4)
        return first, second

    clean = run(fake_config(1), clean_body)
    for rid, text in zip((1, 2), clean, strict=True):
        lines = crashed[rid]
        assert lines[-1]["event"] == "done" and lines[-1]["completion_tokens"] == 4, lines
        assert "".join(e["token"] for e in lines[:-1]) == text
    assert crashed[1][-1]["reused_prompt_tokens"] > 0  # the session was rebuilt first


def test_kill_mid_generation_gives_exactly_one_worker_lost() -> None:
    async def body(client: AsyncClient) -> None:
        sup = client.supervisor
        assert sup is not None
        await generate(client, prompt="warm", max_new_tokens=2, session_id="k")
        events: list[Any] = []
        async for event in client.generate(
            GenerateRequest(prompt="warm more", max_new_tokens=10_000, session_id="k")
        ):
            events.append(event)
            if len(events) == 3:
                os.kill(sup.slots[0].process.pid, signal.SIGKILL)  # type: ignore[union-attr]
        errors = [e for e in events if isinstance(e, ErrorEvent)]
        assert len(errors) == 1 and errors[0].code == "worker_lost" and events[-1] is errors[0]
        _, done = await generate(client, prompt="warm again", max_new_tokens=2, session_id="k")
        assert isinstance(done, DoneEvent)
        # The rebuilt session kept what the first turn left: "warm" + 2 tokens.
        assert done.reused_prompt_tokens >= len("warm") + 1

    run(fake_config(1), body)


def test_flood_beyond_max_queue_is_overloaded_and_the_rest_completes() -> None:
    async def body(client: AsyncClient) -> None:
        results = await asyncio.gather(
            *(generate(client, prompt=f"f{i}", max_new_tokens=5) for i in range(12))
        )
        codes = [done.code if isinstance(done, ErrorEvent) else "ok" for _, done in results]
        assert codes.count("ok") >= 3 and codes.count("overloaded") >= 1
        assert set(codes) == {"ok", "overloaded"}
        for (text, done), code in zip(results, codes, strict=True):
            if code == "ok":
                assert len(text) == 5 and done.completion_tokens == 5

    run(fake_config(1, max_queue=3), body)


def test_repeated_fast_failures_give_up(tmp_path: Path) -> None:
    marker = tmp_path / "fail"

    async def body(client: AsyncClient) -> None:
        sup = client.supervisor
        assert sup is not None
        marker.write_text("x")
        os.kill(sup.slots[0].process.pid, signal.SIGKILL)  # type: ignore[union-attr]
        for _ in range(300):
            if sup.slots[0].state.value == "failed":
                break
            await asyncio.sleep(0.02)
        assert sup.slots[0].state.value == "failed"
        _, done = await generate(client, prompt="x", max_new_tokens=2)
        assert isinstance(done, DoneEvent)  # worker 1 still serves
        assert sup.slots[1].state.value == "ready"

    config = fake_config(2, "--fake-fail-start-if-exists", str(marker), max_fast_failures=2)
    run(config, body)


def test_worker_that_never_gets_ready_is_named_with_its_stderr() -> None:
    config = fake_config(1, "--fake-hang-on-start", ready_timeout=1.5)
    with pytest.raises(WorkerStartError) as err:
        run(config, lambda c: asyncio.sleep(0))
    assert "worker 0" in str(err.value) and "fake worker pid" in str(err.value)


def test_blocking_client_twin() -> None:
    with Client(config=fake_config(1), stderr_sink=lambda _: None) as client:
        events = list(client.generate(GenerateRequest(prompt="abc", max_new_tokens=4)))
        assert [type(e) for e in events] == [TokenEvent] * 4 + [DoneEvent]
        assert client.tokenize("ab", add_prefix=True) == [1, 107, 108]
        assert client.detokenize([107, 108]) == "ab"
        assert client.info()["workers"] == 1
        for _event in client.generate(GenerateRequest(prompt="abc", max_new_tokens=1000)):
            break  # closing the iterator cancels


def test_run_stdio_seed_order_and_errors_in_place() -> None:
    proc = JsonlProcess.run(
        "--workers",
        "2",
        "--worker-command",
        " ".join(["python", "tests/supervisor/fake_worker.py"]),
    )
    try:
        ready = proc.read()
        assert ready is not None and ready["ready"] is True and ready["max_sessions"] == 8
        proc.send({"prompt": "x", "max_new_tokens": 50, "id": 5})
        proc.send({"prompt": "y", "max_new_tokens": 2, "id": 5})
        events = proc.read_until(lambda e: e.get("event") == "done")
        dup = [e for e in events if e["event"] == "error"]
        assert dup == [
            {
                "event": "error",
                "error": "id 5 is already in flight",
                "code": "duplicate_id",
                "id": 5,
                "op": "generate",
            }
        ]
        assert events[-1]["id"] == 5 and events[-1]["completion_tokens"] == 50
        proc.send({"prompt": "aaa", "max_new_tokens": 8})
        proc.send({"op": "nope"})
        proc.send({"prompt": "bbb", "max_new_tokens": 3})
        first = proc.read_until(terminal)
        second = proc.read_until(terminal)
        third = proc.read_until(terminal)
        assert [e["event"] for e in first] == ["token"] * 8 + ["done"]
        assert second == [
            {
                "event": "error",
                "error": "op: unknown operation 'nope'",
                "code": "unknown_op",
                "op": "nope",
            }
        ]
        assert [e["event"] for e in third] == ["token"] * 3 + ["done"]
        assert all("id" not in e for e in first + third)
        proc.close_stdin()
        assert proc.proc.wait(20) == 0
    finally:
        if proc.proc.poll() is None:
            proc.kill()


def test_second_sigint_exits_at_once_without_orphans() -> None:
    """The first SIGINT drains (a long generation keeps going); the second exits at once."""
    proc = JsonlProcess.run("--workers", "1", "--drain-timeout", "60", "--worker-command",
                            f"{sys.executable} tests/supervisor/fake_worker.py",
                            "--fake-token-delay", "0.05")  # fmt: skip
    try:
        ready = proc.read()
        assert ready is not None and ready["ready"] is True
        children = [p.pid for p in proc.descendants()]
        assert children
        proc.send({"prompt": "x", "max_new_tokens": 100000, "id": "long"})
        assert proc.read_until(lambda e: e.get("event") == "token")[-1]["id"] == "long"
        proc.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.proc.poll() is None  # draining: the long request is still running
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGINT)
        proc.proc.wait(10)
        assert time.monotonic() - started < 5
        assert gone(children)
    finally:
        if proc.proc.poll() is None:
            proc.kill()


def test_run_hostile_lines_answered_once_and_promptly(tmp_path: Path) -> None:
    """Over stdin: a 100 MB line is answered `line_too_long` with its id as soon as the limit
    is passed, without buffering it; a line the supervisor cannot fit into a worker's limit
    after re-encoding is answered by the supervisor with its id; `shutdown` refuses what
    follows it in the same write. Over `--listen`: a 3 MB line gets `line_too_long`, and the
    connection keeps serving."""
    proc = JsonlProcess.run("--workers", "1", "--worker-command",
                            f"{sys.executable} tests/supervisor/fake_worker.py")  # fmt: skip
    stdin = proc.proc.stdin
    assert stdin is not None
    try:
        assert proc.read()["event"] == "ready"  # type: ignore[index]
        started = time.monotonic()
        stdin.write(b'{"id": "huge", "prompt": "')
        for _ in range(100):
            stdin.write(b"a" * (1 << 20))
        stdin.write(b'"}\n')
        stdin.flush()
        answer = proc.read_until(terminal)[-1]
        assert answer["id"] == "huge" and answer["code"] == "line_too_long", answer
        assert time.monotonic() - started < 10
        rss = psutil.Process(proc.proc.pid).memory_info().rss
        assert rss < 200 << 20, rss  # nothing near 100 MB was held
        # The fake worker announces no limit (1 MiB): `"op":"generate",` pushes it over.
        head = b'{"id":"grow","max_new_tokens":1,"prompt":"'
        line = head + b"a" * (1_048_568 - len(head) - 2) + b'"}'
        stdin.write(line + b"\n")
        stdin.flush()
        answer = proc.read_until(terminal)[-1]
        assert answer["id"] == "grow" and answer["code"] == "line_too_long", answer
        proc.send({"op": "stats", "id": "st"})
        stats = proc.read_until(terminal)[-1]["stats"]
        assert stats["supervisor"]["requests_in_flight"] == 0, stats
        assert stats["workers"][0]["queue_depth"] == 0, stats
        stdin.write(
            b'{"op":"shutdown"}\n{"prompt":"hi","max_new_tokens":2}\n{"id":7,"prompt":"x"}\n'
        )
        stdin.flush()
        refused = [proc.read(), proc.read()]
        assert sorted(str(e.get("id")) for e in refused) == ["7", "None"], refused  # type: ignore[union-attr]
        assert all(e["code"] == "shutting_down" for e in refused), refused  # type: ignore[index]
        assert proc.proc.wait(10) == 0
    finally:
        if proc.proc.poll() is None:
            proc.kill()

    sock = str(tmp_path / "tp.sock")
    server = JsonlProcess.run("--workers", "1", "--listen", sock, "--worker-command",
                              f"{sys.executable} tests/supervisor/fake_worker.py")  # fmt: skip
    try:
        for _ in range(300):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(sock)
        reader = conn.makefile("rb")
        assert orjson.loads(reader.readline())["event"] == "ready"
        conn.sendall(b'{"op":"tokenize","id":"t1","text":"' + b"a" * (3 << 20) + b'"}\n')
        answer = orjson.loads(reader.readline())
        assert answer["id"] == "t1" and answer["code"] == "line_too_long", answer
        assert answer["op"] == "tokenize"
        conn.sendall(b'{"op":"tokenize","id":"t2","text":"ab"}\n')
        tokens = orjson.loads(reader.readline())
        assert tokens == {"event": "tokens", "id": "t2", "tokens": [107, 108]}
        conn.close()
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(10)
