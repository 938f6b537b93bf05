"""Watching the HTTP client while a request is served: a disconnect cancels the work.

`race_disconnect` awaits something unless the client goes away first; `EventStreamResponse`
is an SSE response whose producer is cancelled the moment the client disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


T = TypeVar("T")


async def race_disconnect(awaitable: Awaitable[T], receive: Receive) -> T:
    """Await `awaitable` unless the HTTP client disconnects first (then cancel it and raise
    `ClientGone`)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


class EventStreamResponse(Response):
    """`text/event-stream` whose producer is cancelled the moment the client disconnects
    (starlette's StreamingResponse only notices at the next write on ASGI 2.4)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        self.body_iterator = body
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if producer in done:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            with contextlib.suppress(OSError):
                producer.result()
            return
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await producer
        with contextlib.suppress(Exception):
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        self.on_disconnect()
