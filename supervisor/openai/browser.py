"""Keeping browsers out of a server without an API key, and letting chosen origins in.

A web page can make the browser send requests to `127.0.0.1`: a "simple" cross-origin POST
(`Content-Type: text/plain`, no preflight) or, by DNS rebinding, a same-origin one under the
attacker's host name. Without `--api-key` (nothing else would stop them) `BrowserGuard` refuses:
- a `Host` that is neither a loopback name or address nor the address the server is bound to
  (403 `forbidden_host`); an IP literal is always accepted on a wildcard bind, since DNS
  rebinding needs a name;
- an `Origin` that is neither the server's own nor one given with `--allow-origin`
  (403 `forbidden_origin`);
- a body that is not JSON: the JSON routes need `Content-Type: application/json`, other
  routes take no body (415 `unsupported_media_type`).
For the `--allow-origin` origins (with or without a key) it answers CORS preflights and adds
`Access-Control-Allow-Origin` to every answer. Non-browser clients send no `Origin`.
"""

from __future__ import annotations

import ipaddress

import orjson
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body

JSON_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
ALLOWED_HEADERS = (
    "authorization, content-type, x-session-affinity, session_id, x-tokenpipe-session-id"
)


def host_name(host_header: str) -> str:
    """The host of a `Host` header, without port or brackets, lower-case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def host_allowed(host_header: str, bind_host: str) -> bool:
    host = host_name(host_header)
    if host == "localhost" or host.endswith(".localhost"):
        return True
    bind = host_name(bind_host) if bind_host not in WILDCARD_BINDS else bind_host
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == bind  # a name: only the one the server was told to bind
    return address.is_loopback or bind in WILDCARD_BINDS or host == bind


def is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class BrowserGuard:
    """ASGI middleware; see the module docstring."""

    def __init__(
        self, app: ASGIApp, *, guard: bool, bind_host: str, allow_origins: tuple[str, ...]
    ) -> None:
        self.app = app
        self.guard = guard
        self.bind_host = bind_host
        self.allow_origins = frozenset(o.rstrip("/") for o in allow_origins)

    def _origin_allowed(self, origin: str) -> bool:
        return "*" in self.allow_origins or origin.rstrip("/") in self.allow_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        allowed = origin is not None and self._origin_allowed(origin)
        if self.guard:
            refusal = self._refusal(scope, headers, origin, allowed)
            if refusal is not None:
                await _send_error(send, *refusal)
                return
        if allowed and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _send_preflight(send, origin or "")
            return
        if not allowed:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"access-control-allow-origin", (origin or "").encode("latin-1")),
                    (b"vary", b"Origin"),
                ]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _refusal(
        self, scope: Scope, headers: Headers, origin: str | None, allowed: bool
    ) -> tuple[int, str, str] | None:
        host = headers.get("host", "")
        if not host_allowed(host, self.bind_host):
            return 403, "forbidden_host", "the Host header does not name this server"
        if (
            origin is not None
            and not allowed
            and origin.rstrip("/")
            not in (
                f"http://{host}",
                f"https://{host}",
            )
        ):
            return 403, "forbidden_origin", "cross-origin requests need --allow-origin"
        if scope["method"] in ("POST", "PUT", "PATCH", "DELETE"):
            content_type = headers.get("content-type")
            needs_json = scope["path"] in JSON_ROUTES
            if (needs_json and not is_json(content_type or "")) or (
                not needs_json and content_type is not None and not is_json(content_type)
            ):
                return (
                    415,
                    "unsupported_media_type",
                    "send the body as Content-Type: application/json",
                )
        return None


async def _send_error(send: Send, status: int, code: str, message: str) -> None:
    body = orjson.dumps(error_body(message, "invalid_request_error", code))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_preflight(send: Send, origin: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 204,
            "headers": [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-allow-methods", ALLOWED_METHODS.encode()),
                (b"access-control-allow-headers", ALLOWED_HEADERS.encode()),
                (b"access-control-max-age", b"600"),
                (b"vary", b"Origin"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b""})
