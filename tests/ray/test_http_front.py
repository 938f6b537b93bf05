"""The direct path's HTTP front end (supervisor/ray/http_front.py) against fake replicas on
loopback (no Ray, no model): requests reach the session's replica over a kept-alive
connection, streams are relayed chunk by chunk, a replica that dies mid-stream is answered
with one `worker_lost` chunk and `[DONE]`, a pooled connection the replica closed is retried,
and an oversized body is refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx

from supervisor.ray.directory import Directory, Endpoint
from supervisor.ray.http_front import HttpProxy
from supervisor.ray.ring import HashRing

Script = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # -> keep the connection


class FakeReplica:
    """An HTTP server that answers each request with `script` and records what it got."""

    def __init__(self, name: str, script: Script) -> None:
        self.name = name
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> Endpoint:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        address = f"127.0.0.1:{port}"
        return Endpoint(self.name, f"id-{self.name}", "127.0.0.1:1", address, secret=self.name)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if not await self.script(head + body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def json_answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
    body = json.dumps({"path": request.split(b" ")[1].decode()}).encode()
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    await writer.drain()
    return True


async def close_after_answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
    await json_answer(request, writer)
    return False  # closes an idle kept-alive connection, as a replica's keep-alive timer does


async def stream_then_die(request: bytes, writer: asyncio.StreamWriter) -> bool:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for i in range(2):
        event = b'data: {"n": %d}\n\n' % i
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.transport.abort()  # the replica's process is gone
    return False


class EndlessStream:
    """A replica streaming until its client goes away (then `gone` is set)."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def __call__(self, request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        try:
            for _ in range(500):
                writer.write(b"9\r\ndata: x\n\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            self.gone.set()
        return False


async def proxy_on(
    replicas: list[FakeReplica], max_body_bytes: int = 1 << 20
) -> tuple[str, Directory, asyncio.Server]:
    directory = Directory()
    directory.update([await r.start() for r in replicas])
    server = await HttpProxy(directory, max_body_bytes).start("127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", directory, server


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 30))


def test_sessions_reach_their_replica_on_one_kept_alive_connection() -> None:
    async def main() -> None:
        replicas = [FakeReplica("rank-0", json_answer), FakeReplica("rank-1", json_answer)]
        base, _, server = await proxy_on(replicas)
        ring = HashRing(["rank-0", "rank-1"])
        sessions = {ring.owner(f"s{i}"): f"s{i}" for i in range(40)}
        async with httpx.AsyncClient(base_url=base) as client:
            for name, session in sessions.items():
                for _ in range(3):
                    headers = {"x-session-affinity": session, "x-tokenpipe-replica": "forged"}
                    r = await client.get("/v1/models", headers=headers)
                    assert r.json() == {"path": "/v1/models"}
                body = {"session_id": session, "prompt": "hi"}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                replica = next(r for r in replicas if r.name == name)
                assert len(replica.requests) == 4 and replica.connections == 1
                assert session.encode() in replica.requests[-1]
                # the replica's secret, set by the front end only (a client's is dropped)
                secret = f"x-tokenpipe-replica: {name}".encode()
                assert all(secret in r and b"forged" not in r for r in replica.requests)
        server.close()

    run(main)


def test_a_replica_lost_mid_stream_ends_it_with_worker_lost() -> None:
    async def main() -> None:
        dying = FakeReplica("rank-0", stream_then_die)
        base, directory, server = await proxy_on([dying])
        async with httpx.AsyncClient(base_url=base) as client:
            async with client.stream("POST", "/v1/completions", json={"stream": True}) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line]
        assert lines[:2] == ['data: {"n": 0}', 'data: {"n": 1}']
        assert len(lines) == 4 and "worker_lost" in lines[2] and lines[3] == "data: [DONE]"
        assert directory.live == []  # routed around until Serve lists a replacement
        server.close()

    run(main)


def test_a_client_that_hangs_up_closes_the_replica_connection() -> None:
    """(The replica's uvicorn sees the disconnect and cancels the generation.)"""

    async def main() -> None:
        endless = EndlessStream()
        base, _, server = await proxy_on([FakeReplica("rank-0", endless)])
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        assert b"200 OK" in await reader.readuntil(b"\r\n\r\n")
        await reader.readuntil(b"data: x")
        writer.close()
        await asyncio.wait_for(endless.gone.wait(), 5)
        server.close()

    run(main)


def test_a_pooled_connection_the_replica_closed_is_retried() -> None:
    async def main() -> None:
        closing = FakeReplica("rank-0", close_after_answer)
        base, directory, server = await proxy_on([closing])
        async with httpx.AsyncClient(base_url=base) as client:
            for _ in range(3):
                assert (await client.get("/health")).status_code == 200
                await asyncio.sleep(0.05)  # the replica's close reaches the pool
        assert closing.connections == 3 and [e.name for e in directory.live] == ["rank-0"]
        server.close()

    run(main)


def test_an_oversized_body_is_refused() -> None:
    async def main() -> None:
        replica = FakeReplica("rank-0", json_answer)
        base, _, server = await proxy_on([replica], max_body_bytes=100)
        async with httpx.AsyncClient(base_url=base) as client:
            r = await client.post("/v1/completions", content=b"x" * 1000)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert replica.requests == []
        server.close()

    run(main)


def test_the_replica_port_wants_its_secret() -> None:
    from supervisor.ray.endpoints import require_secret

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> None:
        transport = httpx.ASGITransport(app=require_secret(app, "abc"))
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            assert (await client.get("/v1/models")).status_code == 403
            wrong = await client.get("/v1/models", headers={"x-tokenpipe-replica": "abd"})
            assert wrong.status_code == 403
            right = await client.get("/v1/models", headers={"x-tokenpipe-replica": "abc"})
            assert right.status_code == 200 and right.text == "ok"

    run(main)


def test_pipelined_requests_are_answered_in_order() -> None:
    async def main() -> None:
        base, _, server = await proxy_on([FakeReplica("rank-0", json_answer)])
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"".join(b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(3)))
        for i in range(3):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert json.loads(await reader.readexactly(length)) == {"path": f"/{i}"}
        writer.close()
        server.close()

    run(main)
