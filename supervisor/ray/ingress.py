"""The HTTP entry of `tokenpipe ray up --via-serve` (the default is http_front.py's direct
path): the replica deployment is the application's ingress, so Serve's proxy hands each OpenAI
request straight to a replica (one actor hop).

The proxy routes on what it sees: the session header Ray reads (`RAY_SERVE_SESSION_ID_HEADER_KEY`;
a local cluster started by `tokenpipe ray up` sets it to `x-session-affinity`) reaches the
router as the request's `session_id`, so the request lands on the session's replica. The
replica then reads the request's own session key (the body's `session_id`, else the first
session header, as `tokenpipe serve` does): when it is the one the proxy routed by, or there
is none, the request runs here (`LocalResponse`); otherwise it is forwarded through the
router to the replica that holds the session (`forward`: a second hop, only for requests
that name their session another way), and the answer relayed as it comes.

A replica lost under a forwarded request answers `worker_lost` (a 503 before the response
started, an error chunk inside an event stream after). When the replica serving a request
directly dies, the proxy ends the response (a streaming client sees the body cut short);
`ray up --separate-ingress` puts an ingress deployment in front instead (`SeparateIngress`):
every request forwarded, so every lost replica is answered `worker_lost`, at one more hop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol import ErrorCode
from supervisor.openai.chunks import SSE_DONE, sse
from supervisor.openai.errors import error_body

from .affinity import http_session_key, is_replica_lost
from .asgi_bridge import portable_scope

LOST = "the replica serving this request was lost; retry (its sessions move to another replica)"


def _lost_body() -> dict[str, Any]:
    return error_body(LOST, "server_error", ErrorCode.WORKER_LOST)


def routed_session() -> str:
    """The session the proxy routed this request by ("" for none): Ray's request context."""
    try:
        from ray.serve.context import _get_serve_request_context

        return str(getattr(_get_serve_request_context(), "session_id", "") or "")
    except Exception:  # noqa: BLE001 - a Ray without it: every session request is forwarded
        return ""


async def read_body(request: Request, limit: int) -> bytes | Response:
    """The whole body, or a 413 answer once it passes `limit` bytes."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            message = f"the request body exceeds {limit} bytes"
            return json_response(
                error_body(message, "invalid_request_error", "request_too_large"), 413
            )
    return bytes(body)


class LocalResponse(Response):
    """Runs the replica's OpenAI app on the request (its body already read): the app's
    messages go straight to the proxy, and the client's disconnect reaches the app."""

    def __init__(self, app: ASGIApp, body: bytes) -> None:
        self._app = app
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = False

        async def replay() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": self._body, "more_body": False}
            return await receive()

        await self._app(scope, replay, send)


class RelayedResponse(Response):
    """A response whose start line and body chunks come from another replica's ASGI
    messages (a forwarded request)."""

    def __init__(
        self, first: list[dict[str, Any]], rest: AsyncIterator[list[dict[str, Any]]]
    ) -> None:
        start = first[0]
        self._first_body = first[1:]
        self.status_code = int(start["status"])
        self.raw_headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", ())]
        self._rest = rest
        self._is_stream = any(
            k.lower() == b"content-type" and v.startswith(b"text/event-stream")
            for k, v in self.raw_headers
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            for message in self._first_body:
                await send(message)
            async for messages in self._rest:
                for message in messages:
                    await send(message)
        except Exception as exc:
            if not is_replica_lost(exc) or not self._is_stream:
                raise
            data = sse(_lost_body()) + SSE_DONE
            await send({"type": "http.response.body", "body": data, "more_body": False})


async def forward(replicas: Any, scope: Scope, body: bytes, session: str | None) -> Response:
    """Send the request through the router to `session`'s replica (None: the least-loaded
    one; `replicas`: a streaming handle on the replica deployment) and relay its answer."""
    stream = replicas.asgi.remote(portable_scope(scope), body, session_key=session)
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return json_response(error_body("no response", "server_error", "internal_error"), 500)
    except Exception as exc:
        if is_replica_lost(exc):
            return json_response(_lost_body(), 503)
        raise
    return RelayedResponse(first, stream)


class SeparateIngress:
    """`tokenpipe ray up --separate-ingress`: an ingress deployment of its own in front of the
    replicas, which forwards every request (two actor hops from the proxy instead of one).
    What it buys: a replica lost under a request is answered here, `worker_lost` (a 503, or an
    error chunk and `[DONE]` in an event stream), where the one-hop path's proxy just ends the
    response."""

    def __init__(self, replica: Any, max_body_bytes: int) -> None:
        self._replicas = replica.options(stream=True)
        self._max_body_bytes = max_body_bytes

    async def __call__(self, request: Request) -> Response:
        body = await read_body(request, self._max_body_bytes)
        if isinstance(body, Response):
            return body
        session = http_session_key(request.headers, body)
        return await forward(self._replicas, request.scope, body, session)


def json_response(body: dict[str, Any], status: int) -> Response:
    import orjson

    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
