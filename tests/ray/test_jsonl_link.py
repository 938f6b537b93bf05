"""The direct path's JSONL side without Ray or a model: `Front` (front.py) over `Links`
(links.py) to a replica's JSONL port (endpoints.py) served by a fake replica. Ids are the
client's on the way out; a session the replica never saw is sent again with the mirrored ids;
a cancel reaches the replica; a replica that dies mid-request gives that request one
`worker_lost`, and the next request goes to the live replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from supervisor.ray.directory import Directory, Endpoint
from supervisor.ray.endpoints import NEED_RESIDENT, JsonlPort
from supervisor.ray.front import Front
from supervisor.ray.links import LOST, Link

SECRET = "s3cret"


class FakeReplica:
    """Answers a generate with two tokens and a `done` carrying resident ids; a named session
    it has not seen, when the caller mirrors ids, with `tp_need_resident`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sessions: set[str] = set()
        self.adopted: dict[str, list[int]] = {}
        self.cancelled: list[str] = []
        self.hold = asyncio.Event()  # set: generates stop after their first token until...
        self.release = asyncio.Event()
        self.port = JsonlPort(self, SECRET)

    async def start(self) -> Endpoint:
        await self.port.start("127.0.0.1")
        return Endpoint(self.name, f"id-{self.name}", self.port.address, "", secret=SECRET)

    async def generate(
        self,
        request: dict[str, Any],
        session_key: str | None = None,
        mirrored: int = 0,
        resident: list[int] | None = None,
    ) -> AsyncIterator[list[dict[str, Any]]]:
        session = request.get("session_id")
        if session and session not in self.sessions:
            if mirrored and resident is None:
                yield [{"event": NEED_RESIDENT}]
                return
            self.sessions.add(session)
            self.adopted[session] = list(resident or [])
        yield [{"event": "token", "token": "a", "id": request["id"]}]
        if self.hold.is_set():
            await self.release.wait()
        done = {"event": "done", "done": True, "id": request["id"], "finish_reason": "length"}
        if request.get("return_resident"):
            done.update(resident_keep=0, resident_append=[1, 2, 3])
        yield [{"event": "token", "token": "b", "id": request["id"]}, done]

    async def session_op(self, request: dict[str, Any], session_key: str) -> dict[str, Any]:
        self.sessions.add(request["session_id"])
        return {"event": "opened", "opened": True, "session_id": request["session_id"]}

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"event": "tokens", "tokens": [7], "replica": self.name}

    async def cancel(self, request_id: str, session_key: str | None = None) -> None:
        self.cancelled.append(request_id)
        self.release.set()


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 30))


async def until(events: list[dict[str, Any]], check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.01)


def terminal(events: list[dict[str, Any]], rid: Any) -> list[dict[str, Any]]:
    return [e for e in events if e.get("id") == rid and e["event"] != "token"]


def test_requests_answers_and_resumed_sessions() -> None:
    async def main() -> None:
        replica = FakeReplica("rank-0")
        directory = Directory()
        directory.update([await replica.start()])
        events: list[dict[str, Any]] = []
        front = Front(None, events.append, directory)
        front.submit({"op": "open", "session_id": "s"})
        front.submit({"id": "a", "session_id": "s", "prompt": "x"})
        await until(events, lambda: bool(terminal(events, "a")))
        assert [e["event"] for e in events] == ["opened", "token", "token", "done"]
        assert all(e["id"] == "a" for e in events[1:])
        assert "resident_keep" not in events[-1]  # asked for by the front end, not the client
        # the replica loses the session (say it is a replacement): sent again with the ids
        replica.sessions.clear()
        front.submit({"id": "b", "session_id": "s", "prompt": "x y"})
        await until(events, lambda: bool(terminal(events, "b")))
        assert replica.adopted == {"s": [1, 2, 3]}
        assert [e["event"] for e in events if e.get("id") == "b"] == ["token", "token", "done"]
        front.submit({"op": "tokenize", "text": "hi", "id": 9})
        await until(events, lambda: bool(terminal(events, 9)))
        assert terminal(events, 9)[0]["tokens"] == [7]
        await front.drain()

    run(main)


def test_cancel_reaches_the_replica() -> None:
    async def main() -> None:
        replica = FakeReplica("rank-0")
        replica.hold.set()
        directory = Directory()
        directory.update([await replica.start()])
        events: list[dict[str, Any]] = []
        front = Front(None, events.append, directory)
        front.submit({"id": 1, "prompt": "x"})
        await until(events, lambda: any(e.get("id") == 1 for e in events))
        front.submit({"op": "cancel", "id": 1})
        await until(events, lambda: bool(terminal(events, 1)))
        assert len(replica.cancelled) == 1 and terminal(events, 1)[0]["event"] == "done"
        await front.drain()

    run(main)


def test_a_replica_lost_mid_request_gives_one_worker_lost() -> None:
    async def main() -> None:
        dying, other = FakeReplica("rank-0"), FakeReplica("rank-1")
        dying.hold.set()
        directory = Directory()
        directory.update([await dying.start(), await other.start()])
        events: list[dict[str, Any]] = []
        front = Front(None, events.append, directory)
        directory.started(directory.live[1])  # anonymous requests go to rank-0 (less loaded)
        front.submit({"id": 1, "prompt": "x"})
        await until(events, lambda: any(e.get("id") == 1 for e in events))
        for connection in list(dying.port._connections):
            connection._writer.transport.abort()  # the replica's process is gone
        await until(events, lambda: bool(terminal(events, 1)))
        await asyncio.sleep(0.1)
        lost = terminal(events, 1)
        assert len(lost) == 1 and lost[0]["code"] == "worker_lost", lost
        assert [e.name for e in directory.live] == ["rank-1"]
        front.submit({"id": 2, "prompt": "x"})
        await until(events, lambda: bool(terminal(events, 2)))
        assert terminal(events, 2)[0]["event"] == "done"
        await front.drain()

    run(main)


def test_a_connection_without_the_secret_is_refused() -> None:
    async def main() -> None:
        replica = FakeReplica("rank-0")
        endpoint = await replica.start()
        stranger = Endpoint("rank-0", "id", endpoint.jsonl, "", secret="guess")
        link = await Link.open(stranger, lambda _: None)
        queue = link.send({"call": "call", "id": 1, "request": {"op": "tokenize", "text": "x"}})
        assert await queue.get() is LOST  # closed before any answer
        link = await Link.open(endpoint, lambda _: None)
        queue = link.send({"call": "call", "id": 1, "request": {"op": "tokenize", "text": "x"}})
        assert (await queue.get())["tokens"] == [7]
        link.close()

    run(main)
