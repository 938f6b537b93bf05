"""The HTTP front end of `tokenpipe ray up` (the direct path): the OpenAI API on --port, each
request passed straight to its replica's own HTTP port over a kept-alive connection.

It is a small HTTP/1.1 reverse proxy on asyncio and httptools (Ray Serve's own HTTP stack
brings both): it reads a request's head and body, picks the replica (`Directory.pick` with the
session key `tokenpipe serve` itself reads: the body's `session_id`, else the first session
header; none: the replica with the fewest requests in flight from here), writes the request to
a pooled connection to that replica and relays the response as it comes (a stream chunk by
chunk). Nothing is decoded but the HTTP framing and, when it can name one, the body's
`session_id`.

A replica lost under a request is answered here: `worker_lost` as a 503 before the response
started, or as an error chunk and `[DONE]` inside an event stream; the replica is marked down
and the next request goes to the one the directory names then (Ray's replacement, same rank).
A connection that was idle in the pool and turns out closed before any byte of the response
came back is retried once on a fresh one.

It runs as a Serve deployment (`HttpFront`, app.py): Ray places it (on the head node), checks
its health and restarts it; the replicas' list reaches it from Serve's controller through the
session router of its handle on them (router.publish_to).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httptools
import orjson

from protocol import ErrorCode
from supervisor.openai.chunks import SSE_DONE, sse
from supervisor.openai.errors import error_body

from .affinity import http_session_key
from .directory import Directory, Endpoint
from .endpoints import SECRET_HEADER

log = logging.getLogger("tokenpipe.ray")

READ_SIZE = 1 << 16
POOL_IDLE_S = 3.0  # below the replica's keep-alive (endpoints.HTTP_KEEP_ALIVE_S)
POOL_SIZE = 32  # idle connections kept per replica
CONNECT_TIMEOUT_S = 5.0
LIVE_WAIT_S = 30.0
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"content-length",
        b"expect",  # answered here (100 Continue); the body goes on whole
        SECRET_HEADER.encode(),  # set by this front end only
    }
)
LOST = "the replica serving this request was lost; retry (its sessions move to another replica)"
NO_REPLICA = "no replica is reachable"


@dataclass
class Request:
    """One HTTP request from a client, whole."""

    method: bytes = b""
    url: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    keep_alive: bool = True
    too_large: bool = False


class RequestReader:
    """httptools callbacks: complete requests end up in `ready`."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.current = Request()
        self.ready: deque[Request] = deque()
        self.continue_wanted = False  # a client waits for "100 Continue" before its body
        self.parser = httptools.HttpRequestParser(self)

    def on_message_begin(self) -> None:
        self.current = Request()

    def on_url(self, url: bytes) -> None:
        self.current.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.continue_wanted = any(
            n == b"expect" and v.lower() == b"100-continue" for n, v in self.current.headers
        )

    def on_body(self, body: bytes) -> None:
        if len(self.current.body) + len(body) > self.max_body_bytes:
            self.current.too_large = True
        else:
            self.current.body += body

    def on_message_complete(self) -> None:
        self.current.method = self.parser.get_method()
        self.current.keep_alive = self.parser.should_keep_alive()
        self.ready.append(self.current)


class ResponseReader:
    """httptools callbacks for one upstream response: what to send on, in order."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.chunked = False
        self.event_stream = False
        self.body: list[bytes] = []
        self.complete = False
        self.keep_alive = True
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        for name, value in self.headers:
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                self.chunked = True
            elif name == b"content-type" and value.startswith(b"text/event-stream"):
                self.event_stream = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()


class Upstream:
    """A kept-alive connection to one replica's HTTP port."""

    def __init__(
        self, endpoint: Endpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.endpoint = endpoint
        self.reader = reader
        self.writer = writer
        self.idle_since = time.monotonic()
        self.used = False  # served a request before (a closed one is then retried)

    def close(self) -> None:
        self.writer.close()


class ReplicaLost(Exception):
    """The replica's connection broke before the response was complete."""

    def __init__(self, started: bool) -> None:
        super().__init__("replica lost")
        self.started = started  # some of the response went to the client


class HttpProxy:
    """The proxy: client connections in, replica connections out."""

    def __init__(self, directory: Directory, max_body_bytes: int) -> None:
        self._directory = directory
        self._max_body_bytes = max_body_bytes
        self._pools: dict[str, list[Upstream]] = {}  # replica id -> idle connections

    async def start(self, host: str, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._client, host, port, limit=READ_SIZE)

    # -- the client side

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nodelay(writer)
        requests = RequestReader(self._max_body_bytes)
        early: bytes | None = None  # what the client sent while its last request was served
        try:
            while data := (early if early is not None else await reader.read(READ_SIZE)):
                early = None
                problem = self._feed(requests, data, writer)
                if problem is not None:
                    await self._reply(writer, *problem)
                    return
                while requests.ready:
                    served = await self._serve_watching(requests.ready.popleft(), reader, writer)
                    if served is None:
                        return  # the client hung up (the replica's request was cancelled)
                    keep, sent_meanwhile = served
                    if not keep:
                        return
                    if sent_meanwhile:  # parsed once the requests before it are served
                        early = (early or b"") + sent_meanwhile
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _feed(
        self, requests: RequestReader, data: bytes, writer: asyncio.StreamWriter
    ) -> tuple[int, str, str] | None:
        """Parse what the client sent; the error to answer when it is not HTTP we serve."""
        try:
            requests.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            return 501, "not_implemented", "upgrades are not served"
        except httptools.HttpParserError:
            return 400, "invalid_request", "malformed HTTP request"
        if requests.continue_wanted:
            requests.continue_wanted = False
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    async def _serve_watching(
        self, request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[bool, bytes] | None:
        """`_serve`, cancelled when the client hangs up meanwhile (closing the replica's
        connection, which cancels the generation there, as `tokenpipe serve` does); (keep the
        connection, bytes the client sent meanwhile), or None when it hung up."""
        serving = asyncio.ensure_future(self._serve(request, writer))
        watch = asyncio.ensure_future(reader.read(READ_SIZE))
        await asyncio.wait((serving, watch), return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and (watch.exception() is not None or not watch.result()):
            serving.cancel()
            with contextlib.suppress(BaseException):
                await serving
            return None
        keep = await serving
        if not watch.done():
            watch.cancel()
            with contextlib.suppress(BaseException):
                await watch
            return keep, b""
        return keep, watch.result()

    async def _reply(
        self, writer: asyncio.StreamWriter, status: int, code: str, message: str
    ) -> None:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = orjson.dumps(error_body(message, kind, code))
        writer.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (status, REASONS.get(status, b"Error"), len(body))
            + body
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def _serve(self, request: Request, client: asyncio.StreamWriter) -> bool:
        """Answer one request; whether the client connection stays open."""
        if request.too_large:
            message = f"the request body exceeds {self._max_body_bytes} bytes"
            await self._reply(client, 413, "request_too_large", message)
            return False
        headers = {n.decode("latin-1"): v.decode("latin-1") for n, v in request.headers}
        session = http_session_key(headers, bytes(request.body))
        head = upstream_head(request)
        for attempt in range(3):
            endpoint = await self._live(session)
            if endpoint is None:
                await self._reply(client, 503, ErrorCode.WORKER_LOST, NO_REPLICA)
                return request.keep_alive
            secret = b"%s: %s\r\n" % (SECRET_HEADER.encode(), endpoint.secret.encode())
            try:
                upstream = await self._connection(endpoint)
            except OSError:
                self._directory.mark_down(endpoint.replica_id)
                await asyncio.sleep(0.1 * attempt)
                continue
            self._directory.started(endpoint)
            try:
                keep_upstream = await self._relay(upstream, head + secret, request, client)
            except ReplicaLost as lost:
                upstream.close()
                if not lost.started and upstream.used and attempt == 0:
                    continue  # a pooled connection the replica had closed: once more
                self._directory.mark_down(endpoint.replica_id)
                if not lost.started:
                    await self._reply(client, 503, ErrorCode.WORKER_LOST, LOST)
                    return request.keep_alive
                return False  # the relay ended the response as it could
            except BaseException:
                upstream.close()  # the client went away: the replica sees it and cancels
                raise
            finally:
                self._directory.finished(endpoint)
            if keep_upstream:
                self._release(upstream)
            else:
                upstream.close()
            return request.keep_alive
        await self._reply(client, 503, ErrorCode.WORKER_LOST, NO_REPLICA)
        return request.keep_alive

    async def _live(self, session: str | None) -> Endpoint | None:
        deadline = time.monotonic() + LIVE_WAIT_S
        while (endpoint := self._directory.pick(session)) is None or not endpoint.http:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)
        return endpoint

    # -- the replica side

    async def _connection(self, endpoint: Endpoint) -> Upstream:
        pool = self._pools.setdefault(endpoint.replica_id, [])
        now = time.monotonic()
        while pool:
            upstream = pool.pop()
            if now - upstream.idle_since < POOL_IDLE_S and not upstream.writer.is_closing():
                return upstream
            upstream.close()
        host, port = endpoint.http_address
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=READ_SIZE), CONNECT_TIMEOUT_S
        )
        nodelay(writer)
        return Upstream(endpoint, reader, writer)

    def _release(self, upstream: Upstream) -> None:
        pool = self._pools.setdefault(upstream.endpoint.replica_id, [])
        if len(pool) >= POOL_SIZE or upstream.endpoint not in self._directory.live:
            upstream.close()
            return
        upstream.idle_since = time.monotonic()
        upstream.used = True
        pool.append(upstream)

    async def _relay(
        self, upstream: Upstream, head: bytes, request: Request, client: asyncio.StreamWriter
    ) -> bool:
        """Send the request, relay the response; whether the upstream connection can be
        reused. ReplicaLost when the replica's side breaks first."""
        upstream.writer.write(head + b"content-length: %d\r\n\r\n" % len(request.body))
        if request.body:
            upstream.writer.write(bytes(request.body))
        response = ResponseReader()
        started = False
        while not response.complete:
            try:
                data = await upstream.reader.read(READ_SIZE)
            except (ConnectionError, OSError):
                data = b""
            if not data:
                if started and response.event_stream and response.chunked:
                    payload = sse(error_body(LOST, "server_error", ErrorCode.WORKER_LOST))
                    payload += SSE_DONE
                    client.write(chunk(payload) + b"0\r\n\r\n")
                    with contextlib.suppress(ConnectionError):
                        await client.drain()
                raise ReplicaLost(started)
            try:
                response.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                raise ReplicaLost(started) from exc
            out = bytearray()
            if response.head_done and not started:
                started = True
                out += response_head(response, request.keep_alive)
            for piece in response.body:
                out += chunk(piece) if response.chunked else piece
            response.body.clear()
            if response.complete and response.chunked:
                out += b"0\r\n\r\n"
            if out:
                client.write(out)
                await client.drain()
        return response.keep_alive


def upstream_head(request: Request) -> bytes:
    """The request line and headers sent to the replica (without hop-by-hop headers; the
    body's length is added by the caller)."""
    lines = [b"%s %s HTTP/1.1" % (request.method, request.url)]
    lines += [b"%s: %s" % (n, v) for n, v in request.headers if n not in HOP_BY_HOP]
    return b"\r\n".join(lines) + b"\r\n"


def response_head(response: ResponseReader, keep_alive: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (response.status, REASONS.get(response.status, b"OK"))]
    lines += [
        b"%s: %s" % (n, v)
        for n, v in response.headers
        if n not in HOP_BY_HOP or (n == b"content-length" and not response.chunked)
    ]
    if response.chunked:
        lines.append(b"transfer-encoding: chunked")
    if not keep_alive:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def nodelay(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, AttributeError):
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    408: b"Request Timeout",
    413: b"Payload Too Large",
    422: b"Unprocessable Entity",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    503: b"Service Unavailable",
}


class HttpFront:
    """The Serve deployment of the HTTP front end (app.py): the proxy on `host:port`, fed by
    the router of its handle on the replicas."""

    async def __init__(self, replicas: Any, host: str, port: int, max_body_bytes: int) -> None:
        from .router import publish_to

        self._directory = Directory()
        publish_to(self._directory)
        self._replicas = replicas
        self._proxy = HttpProxy(self._directory, max_body_bytes)
        self._server = await self._proxy.start(host, port)
        # one Serve call starts this process's router on the replicas (and so the
        # directory's feed); it waits for a replica, so it runs in the background
        self._primer = asyncio.ensure_future(self._prime())
        log.info("tokenpipe HTTP front end on %s:%d", host, port)

    async def _prime(self) -> None:
        while True:
            try:
                await self._replicas.ready_info.remote()
                return
            except Exception as exc:  # noqa: BLE001 - replicas still starting: try again
                log.info("waiting for a replica: %s", exc)
                await asyncio.sleep(1.0)

    async def check_health(self) -> None:
        """Serve's health check: the port is still served."""
        if not self._server.is_serving():
            raise RuntimeError("the HTTP front end stopped serving its port")

    async def __call__(self, *args: Any) -> None:
        raise RuntimeError("the HTTP front end serves its own port, not Serve's proxy")

    async def __del__(self) -> None:
        self._server.close()
