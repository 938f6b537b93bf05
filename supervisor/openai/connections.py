"""Connection hygiene for uvicorn's h11 protocol: a header deadline and a connection cap.

uvicorn bounds the idle time between requests (`timeout_keep_alive`), but that timer restarts
at every byte, and nothing bounds the time a client takes to send a request's headers, so a
client writing one byte a second holds its connection forever. `GuardedH11Protocol` closes a
connection that has not completed a request's headers within `header_timeout` seconds of
connecting (or of the previous response), and refuses connections beyond `max_connections`.
The body has its own deadline where it is read (`read_body`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    """`H11Protocol` with a header deadline and a connection cap (set on a subclass by
    `guarded_protocol`)."""

    header_timeout: float = 10.0
    max_connections: int = 512

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        waiting_for_request = self.cycle is None or self.cycle.response_complete
        if waiting_for_request and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` class with these limits, for `uvicorn.run(http=...)`."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout": header_timeout, "max_connections": max_connections},
    )
