"""One request between its arrival and its terminal answer (`Inflight`), and the interface of
the client connection it answers to (`ClientSink`, implemented by `dispatch.Channel`).

Invariant: every client request becomes exactly one `Inflight`, which ends exactly once: the
supervisor's `answer` delivers its terminal event and `ClientSink.finished` releases its id.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import orjson

NO_ID: Any = object()  # the client sent no id: strip it from answers

# How a worker writes a token event (msgspec: the tag, then `id`, then `token`).
TOKEN_ID = b'{"event":"token","id":'
TOKEN_NO_ID = b'{"event":"token"'
TOKEN_ID_LEN = len(TOKEN_ID)

MAX_RERUNS = 1
"""A request whose worker died before any of its lines reached the client is sent again this
many times (to the restarted worker, or another one); a request that kills every worker it
meets is answered `worker_lost` after that."""


class ClientSink(Protocol):
    """A client connection as the supervisor's parts see it."""

    closed: bool
    emit_line: Callable[[bytes], None] | None
    flush: Callable[[], None] | None

    def emit(self, event: dict[str, Any]) -> None:
        """Deliver one answer line (a dict with `event`) to the client."""

    def finished(self, flight: Inflight) -> None:
        """`flight` was answered: free its id (or let the next id-less request start)."""


class Inflight:
    """One request between its arrival and its terminal answer."""

    __slots__ = (
        "iid",
        "channel",
        "client_id",
        "op",
        "session_id",
        "worker",
        "strip_resident",
        "then",
        "sent",
        "cancelled",
        "cancel_sent",
        "new_placement",
        "token_prefix",
        "request",
        "streamed",
        "reruns",
    )

    def __init__(
        self, channel: ClientSink | None, client_id: Any, op: str, session_id: str
    ) -> None:
        self.iid = 0  # the id on the worker's side; fresh for each send
        self.channel = channel
        self.client_id = client_id
        self.op = op
        self.session_id = session_id
        self.worker = -1
        self.strip_resident = False
        self.then: Callable[[dict[str, Any]], None] | None = None  # internal requests
        self.sent = False
        self.cancelled = False  # cancelled before it was sent: answered when its turn comes
        self.cancel_sent = False  # a cancel went to the worker
        self.new_placement = False
        # The start of this request's token lines as the client sees them, up to the comma
        # after the id: b'{"event":"token","id":"abc"' (or without the id).
        self.token_prefix = (
            TOKEN_NO_ID if client_id is NO_ID else TOKEN_ID + orjson.dumps(client_id)
        )
        self.request: dict[str, Any] | None = None  # as routed: what a re-run sends again
        self.streamed = False  # a token line of it reached the client: it cannot be re-run
        self.reruns = 0


def error_event(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"event": "error", "error": message, "code": code, **extra}


def cancelled_done() -> dict[str, Any]:
    """The `done` of a request cancelled before a worker saw it (or whose worker died)."""
    return {
        "event": "done",
        "done": True,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "finish_reason": "cancelled",
        "reused_prompt_tokens": 0,
        "prefilled_prompt_tokens": 0,
        "session_reset_reason": "new",
        "prefill_ms": 0.0,
        "decode_ms": 0.0,
        "total_ms": 0.0,
        "prefill_tok_s": 0.0,
        "decode_tok_s": 0.0,
    }
