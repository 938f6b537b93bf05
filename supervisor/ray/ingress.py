"""The HTTP ingress of `tokenpipe ray up`: Ray Serve's proxy hands it each OpenAI request; it
reads the body, finds the session key and streams the request through the replica that the
router picks (`TokenpipeReplica.asgi`), relaying the app's response as it comes.

It holds no state but the handle; a replica lost mid-request answers `worker_lost` (a 503
before the response started, an error chunk inside an event stream after).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from protocol import ErrorCode
from supervisor.openai.chunks import SSE_DONE, sse
from supervisor.openai.errors import error_body

from .affinity import http_session_key, is_replica_lost
from .asgi_bridge import portable_scope

LOST = "the replica serving this request was lost; retry (its sessions move to another replica)"


def _lost_body() -> dict[str, Any]:
    return error_body(LOST, "server_error", ErrorCode.WORKER_LOST)


class RelayedResponse(Response):
    """A response whose start line and body chunks come from a replica's ASGI messages."""

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


class Ingress:
    """The Serve deployment class of the HTTP ingress (options are set in app.py)."""

    def __init__(self, replica: Any, max_body_bytes: int) -> None:
        self._replica = replica.options(stream=True)
        self._max_body_bytes = max_body_bytes

    async def __call__(self, request: Request) -> Response:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self._max_body_bytes:
                message = f"the request body exceeds {self._max_body_bytes} bytes"
                return _json(error_body(message, "invalid_request_error", "request_too_large"), 413)
        key = http_session_key(request.headers, bytes(body))
        stream = self._replica.asgi.remote(
            portable_scope(request.scope), bytes(body), session_key=key
        )
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return _json(error_body("no response", "server_error", "internal_error"), 500)
        except Exception as exc:
            if is_replica_lost(exc):
                return _json(_lost_body(), 503)
            raise
        return RelayedResponse(first, stream)


def _json(body: dict[str, Any], status: int) -> Response:
    import orjson

    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
