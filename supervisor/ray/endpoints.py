"""A replica's own data endpoints (the direct path): its OpenAI app on an HTTP port, and its
protocol calls on a JSONL port, both on the replica's node address, published to the front
ends through the replica's Serve metadata (`record_replica_metadata`).

Ray places, health-checks and replaces the replica; the bytes of a request go from a front end
to these ports over a kept-alive connection, never through a Serve call.

Both ports answer only callers that know the replica's secret, a random token it publishes
with the ports (Serve metadata reaches only processes that joined the cluster): the HTTP port
wants it in the `x-tokenpipe-replica` header (anything else is a 403; `--api-key` is checked
as well, by the app), the JSONL port as its first line, `{"call": "hello", "secret": S}`. So a
replica's ports open no door that `ray up --host` did not.

The JSONL port then speaks envelopes, one JSON object a line each way:

    -> {"call": "generate", "id": I, "request": {...}, "mirrored": n, "resident": [...]|null}
    -> {"call": "session_op" | "call", "id": I, "request": {...}}
    -> {"call": "cancel", "id": I}                       (cancel the generate with id I)
    <- the events of request I, each carrying "id": I (a generate's last is `done`/`error`;
       the others answer one line)

`I` is the front end's own id of the request (unique on its connection); a generate's request
carries it too, so its events come back with it. Closing the connection cancels what it has in
flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from protocol import ErrorCode
from supervisor.lines import LineSplitter, TooLong

log = logging.getLogger("tokenpipe.ray")

NEED_RESIDENT = "tp_need_resident"
"""The one event a replica answers when it lacks a session the caller said it mirrors."""

MAX_ENVELOPE_BYTES = 64 << 20  # a request with every resident id of a long session
READ_SIZE = 1 << 16
HTTP_KEEP_ALIVE_S = 5  # the replica's idle keep-alive (front ends drop idle links sooner)
HTTP_HEADER_TIMEOUT_S = 10.0
HTTP_MAX_CONNECTIONS = 512
SECRET_HEADER = "x-tokenpipe-replica"


def secret_matches(given: Any, secret: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), secret.encode())


def error_event(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"event": "error", "code": code, "error": message, **extra}


class ReplicaCalls(Protocol):
    """What the JSONL port calls (TokenpipeReplica's methods)."""

    def generate(
        self,
        request: dict[str, Any],
        session_key: str | None = None,
        mirrored: int = 0,
        resident: list[int] | None = None,
    ) -> AsyncIterator[list[dict[str, Any]]]: ...

    async def session_op(self, request: dict[str, Any], session_key: str) -> dict[str, Any]: ...

    async def call(self, request: dict[str, Any]) -> dict[str, Any]: ...

    async def cancel(self, request_id: str, session_key: str | None = None) -> None: ...


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def bound_socket(host: str) -> socket.socket:
    """A listening TCP socket on `host` at a port the system picks."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class JsonlPort:
    """The replica's JSONL port and its open connections."""

    def __init__(self, calls: ReplicaCalls, secret: str) -> None:
        self._calls = calls
        self._secret = secret
        self._connections: set[JsonlConnection] = set()
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self, host: str) -> None:
        sock = bound_socket(host)
        self._server = await asyncio.start_server(self._connection, sock=sock, limit=READ_SIZE)
        self.address = address(sock)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = JsonlConnection(self._calls, reader, writer, self._secret)
        self._connections.add(connection)
        try:
            await connection.run()
        finally:
            self._connections.discard(connection)

    async def drain(self, timeout_s: float) -> None:
        """Accept no more connections; wait (at most `timeout_s`) until the requests in
        flight on the open ones are answered (Serve drains only the calls it carried)."""
        if self._server is not None:
            self._server.close()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(c.busy for c in self._connections):
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.05)


def require_secret(app: Any, secret: str) -> Any:
    """`app`, answering 403 to HTTP requests without the replica's secret header."""
    header = SECRET_HEADER.encode()
    refusal = orjson.dumps(
        {
            "error": {
                "message": "not a tokenpipe front end",
                "type": "invalid_request_error",
                "code": "forbidden",
                "param": None,
            }
        }
    )

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = next((v for k, v in scope["headers"] if k == header), b"")
            if not secret_matches(given.decode("latin-1"), secret):
                headers = [(b"content-type", b"application/json")]
                await send({"type": "http.response.start", "status": 403, "headers": headers})
                await send({"type": "http.response.body", "body": refusal})
                return
        await app(scope, receive, send)

    return guarded


async def serve_http(
    app: Any, host: str, secret: str
) -> tuple[Callable[[float], Awaitable[None]], str]:
    """Start the replica's OpenAI app on an HTTP port (uvicorn, the same connection guards as
    `tokenpipe serve`); (a coroutine function that stops it, letting the requests in flight
    finish within its timeout; its "host:port")."""
    import uvicorn

    from supervisor.openai.connections import guarded_protocol

    sock = bound_socket(host)
    config = uvicorn.Config(
        require_secret(app, secret),
        lifespan="off",  # the replica started its server already
        log_level="warning",
        http=guarded_protocol(HTTP_HEADER_TIMEOUT_S, HTTP_MAX_CONNECTIONS),
        timeout_keep_alive=HTTP_KEEP_ALIVE_S,
        limit_concurrency=HTTP_MAX_CONNECTIONS + 1,
    )
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # its start-up error
        await asyncio.sleep(0.01)

    async def stop(timeout_s: float) -> None:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout_s)

    return stop, address(sock)


class JsonlConnection:
    """One front end's connection to this replica's JSONL port."""

    def __init__(
        self,
        calls: ReplicaCalls,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        secret: str,
    ) -> None:
        self._calls = calls
        self._secret = secret
        self._greeted = False
        self._reader = reader
        self._writer = writer
        self._tasks: dict[Any, asyncio.Task[None]] = {}

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    async def run(self) -> None:
        with contextlib.suppress(OSError):
            self._writer.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
        splitter = LineSplitter(MAX_ENVELOPE_BYTES)
        try:
            while data := await self._reader.read(READ_SIZE):
                for line in splitter.feed(data):
                    if isinstance(line, TooLong):
                        log.warning("a front end sent a line over %d bytes", MAX_ENVELOPE_BYTES)
                        return
                    if not line.strip():
                        continue
                    envelope = orjson.loads(line)
                    if self._greeted:
                        self._dispatch(envelope)
                    elif envelope.get("call") == "hello" and secret_matches(
                        envelope.get("secret"), self._secret
                    ):
                        self._greeted = True
                    else:
                        log.warning("a JSONL connection without the replica's secret: closed")
                        return
        except (ConnectionError, orjson.JSONDecodeError) as exc:
            log.warning("front end connection ended: %s", exc)
        finally:
            for task in list(self._tasks.values()):
                task.cancel()  # a generate cancels its request in the worker
            self._writer.close()

    def _write(self, events: list[dict[str, Any]]) -> None:
        if not self._writer.is_closing():
            self._writer.write(b"".join(orjson.dumps(e) + b"\n" for e in events))

    def _dispatch(self, envelope: dict[str, Any]) -> None:
        call, rid = envelope.get("call"), envelope.get("id")
        if call == "cancel":
            if rid in self._tasks:
                asyncio.ensure_future(self._calls.cancel(str(rid)))
            return
        if call == "generate":
            work: Awaitable[None] = self._generate(envelope)
        elif call in ("session_op", "call"):
            work = self._answer(envelope)
        else:
            self._write([error_event(ErrorCode.INVALID_REQUEST, f"unknown call {call!r}", id=rid)])
            return
        task = asyncio.ensure_future(work)
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))

    async def _generate(self, envelope: dict[str, Any]) -> None:
        rid = envelope["id"]
        request = {**envelope["request"], "id": rid}
        stream = self._calls.generate(
            request, mirrored=int(envelope.get("mirrored") or 0), resident=envelope.get("resident")
        )
        try:
            async with contextlib.aclosing(stream) as batches:  # type: ignore[type-var]
                async for batch in batches:
                    self._write([{**event, "id": rid} for event in batch])
        except Exception as exc:  # the front end gets a protocol line, never a traceback
            problem = f"{type(exc).__name__}: {exc}"
            self._write([error_event(ErrorCode.INTERNAL_ERROR, problem, id=rid)])

    async def _answer(self, envelope: dict[str, Any]) -> None:
        request = envelope["request"]
        if envelope["call"] == "session_op":
            answer = await self._calls.session_op(request, str(request.get("session_id")))
        else:
            answer = await self._calls.call(request)
        self._write([{**answer, "id": envelope["id"]}])
