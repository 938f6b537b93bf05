"""One HTTP request through an ASGI app in this process, as a stream of ASGI messages.

A replica runs `tokenpipe serve`'s starlette app without a socket: the ingress sends it the
request's scope and whole body, and relays what the app sends (`http.response.start`, then
`http.response.body` chunks), a batch of messages at a time. The app sees no disconnect
until the caller stops reading: closing this stream cancels the app, which cancels the
generation in the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[Message]],
        Callable[[Message], Awaitable[None]],
    ],
    Awaitable[None],
]

SCOPE_KEYS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "root_path",
    "headers",
    "client",
    "server",
)


def portable_scope(scope: MutableMapping[str, Any]) -> dict[str, Any]:
    """The parts of an HTTP scope another process needs (plain, picklable values)."""
    out = {key: scope[key] for key in SCOPE_KEYS if key in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", ())]
    out["root_path"] = ""
    out["client"] = tuple(scope["client"]) if scope.get("client") else None
    out["server"] = tuple(scope["server"]) if scope.get("server") else None
    return out


async def run_asgi(
    app: ASGIApp, scope: dict[str, Any], body: bytes
) -> AsyncIterator[list[Message]]:
    """What `app` sends for one request with `body`: the messages sent so far, in batches (a
    whole response sent at once is one batch: one item across processes, not three)."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    body_given = False
    caller_gone = asyncio.Event()

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await caller_gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.put_nowait(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        finished = False
        while not finished:
            batch = [await messages.get()]
            while not messages.empty():
                batch.append(messages.get_nowait())
            finished = batch[-1] is None
            sent = [m for m in batch if m is not None]
            if sent:
                yield sent
        await task  # its exception, if it failed
    finally:
        if not task.done():
            caller_gone.set()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
