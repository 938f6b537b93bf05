"""From a client channel to a worker: id namespaces, id-less ordering, routing, cancel.

A `Channel` is one client connection; each request becomes an `Inflight` until its terminal
answer. `dispatch` answers what the supervisor answers itself (ping, shutdown, stats, close
or reset of a session that lives only in the mirror) and routes the rest to a worker, after a
session rebuild when its worker died.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from protocol.errors import ErrorCode
from supervisor.recovery import forget_session, start_rebuild
from supervisor.router import route_request
from supervisor.stats import answer_stats

if TYPE_CHECKING:
    from supervisor.core import Supervisor


Emit = Callable[[dict[str, Any]], None]
NO_ID: Any = object()  # the client sent no id: strip it from answers

# How a worker writes a token event (msgspec: the tag, then `id`, then `token`).
TOKEN_ID = b'{"event":"token","id":'
TOKEN_NO_ID = b'{"event":"token"'
TOKEN_ID_LEN = len(TOKEN_ID)


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
        "new_placement",
        "token_prefix",
    )

    def __init__(self, channel: Channel | None, client_id: Any, op: str, session_id: str) -> None:
        self.iid = 0
        self.channel = channel
        self.client_id = client_id
        self.op = op
        self.session_id = session_id
        self.worker = -1
        self.strip_resident = False
        self.then: Callable[[dict[str, Any]], None] | None = None  # internal requests
        self.sent = False
        self.cancelled = False
        self.new_placement = False
        # The start of this request's token lines as the client sees them, up to the comma
        # after the id: b'{"event":"token","id":"abc"' (or without the id).
        self.token_prefix = (
            TOKEN_NO_ID if client_id is NO_ID else TOKEN_ID + orjson.dumps(client_id)
        )


class Channel:
    """One client connection: its id namespace and its ordered queue of id-less requests.

    `emit(event)` receives every answer as a dict. A line-oriented connection (stdio, socket)
    may also pass `emit_line(line)`: token events then arrive as ready-made JSON lines (no
    newline), with the id rewritten in the bytes, never parsed (the relay's fast path);
    `flush()` is called after each batch of worker output.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        emit: Emit,
        emit_line: Callable[[bytes], None] | None = None,
        flush: Callable[[], None] | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.emit = emit
        self.emit_line = emit_line
        self.flush = flush
        self.by_client_id: dict[Any, Inflight] = {}
        self.anonymous: deque[dict[str, Any]] = deque()
        self.anonymous_busy = False
        self._pumping = False
        self.closed = False

    def submit(self, request: dict[str, Any]) -> None:
        """Accept one request (a plain dict as on the wire; `op` absent means generate)."""
        if self.supervisor.closing and request.get("op") not in ("cancel", "shutdown"):
            event = {
                "event": "error",
                "error": "the supervisor is shutting down",
                "code": ErrorCode.SHUTTING_DOWN,
            }
            if request.get("id") is not None:
                event["id"] = request["id"]
            self.emit(event)
            return
        if "id" in request and request["id"] is not None:
            dispatch(self.supervisor, self, request)
            return
        request.pop("id", None)
        if len(self.anonymous) >= self.supervisor.config.max_queue:
            self.emit(
                {
                    "event": "error",
                    "error": "too many queued requests without an id",
                    "code": ErrorCode.OVERLOADED,
                }
            )
            return
        self.anonymous.append(request)
        self._pump()

    def submit_error(self, event: dict[str, Any]) -> None:
        """Answer a line that could not be decoded; id-less ones keep their place in line."""
        if event.get("id") is not None:
            self.emit(event)
        else:
            event.pop("id", None)
            self.anonymous.append({"op": "_error", "event": event})
            self._pump()

    def _pump(self) -> None:
        if self._pumping:
            return
        self._pumping = True
        try:
            while not self.anonymous_busy and self.anonymous:
                self.anonymous_busy = True
                dispatch(self.supervisor, self, self.anonymous.popleft())
        finally:
            self._pumping = False

    def _finished(self, flight: Inflight) -> None:
        if flight.client_id is NO_ID:
            self.anonymous_busy = False
            self._pump()
        else:
            self.by_client_id.pop(flight.client_id, None)
        self.supervisor._maybe_idle()

    @property
    def idle(self) -> bool:
        return not self.by_client_id and not self.anonymous and not self.anonymous_busy

    def close(self) -> None:
        """The client went away: cancel what it has in flight; drop its answers."""
        self.closed = True
        self.anonymous.clear()
        for flight in list(self.by_client_id.values()):
            cancel_flight(self.supervisor, flight)


def dispatch(sup: Supervisor, channel: Channel, request: dict[str, Any]) -> None:
    op = request.get("op") or "generate"
    client_id = request.get("id", NO_ID)
    if client_id is None:
        client_id = NO_ID
    session_id = request.get("session_id") or ""
    flight = Inflight(channel, client_id, op, session_id)
    if op == "cancel":
        client_cancel(sup, channel, client_id)
        return
    if client_id is not NO_ID:
        if client_id in channel.by_client_id:
            channel.emit(
                {
                    "event": "error",
                    "error": f"id {client_id!r} is already in flight",
                    "code": ErrorCode.DUPLICATE_ID,
                    "id": client_id,
                    "op": op,
                }
            )
            return
        channel.by_client_id[client_id] = flight
    if op == "_error":  # a rejected line, answered in its turn
        sup._answer(channel, flight, request["event"])
    elif op == "ping":
        sup._answer(channel, flight, {"event": "pong", "pong": True})
    elif op == "shutdown":
        channel._finished(flight)  # no answer line, as from a worker
        if sup.on_shutdown_request is not None:
            sup.on_shutdown_request()
    elif op == "stats":
        asyncio.ensure_future(answer_stats(sup, channel, flight))
    elif op in ("close", "reset") and session_id in sup.needs_rebuild:
        # The worker that held it died: the session exists only in the mirror.
        if op == "close":
            forget_session(sup, session_id)
            sup._answer(
                channel, flight, {"event": "closed", "closed": True, "session_id": session_id}
            )
        else:
            sup.mirror.clear(session_id)
            sup.needs_rebuild.discard(session_id)
            sup._answer(
                channel, flight, {"event": "reset", "reset": True, "session_id": session_id}
            )
    else:
        route_and_send(sup, channel, flight, request)


def route_and_send(
    sup: Supervisor, channel: Channel, flight: Inflight, request: dict[str, Any]
) -> None:
    op, session_id = flight.op, flight.session_id
    route = route_request(op, session_id, sup.placements, sup._loads())
    if route.worker is None:
        local_error(
            sup,
            channel,
            flight,
            route.error_code or ErrorCode.INTERNAL_ERROR,
            route.error or "no worker",
            op=op,
        )
        return
    slot = sup.slots[route.worker]
    if route.new_placement:
        old = sup.placements.get(session_id)
        if old is not None:
            sup.slots[old].named.discard(session_id)
        sup.placements[session_id] = slot.index
        slot.named.add(session_id)
        flight.new_placement = old is None
    if op == "generate" and session_id:
        flight.strip_resident = not request.get("return_resident", False)
        request["return_resident"] = True
    sup._register(slot, flight)
    if session_id and session_id in sup.needs_rebuild and op in ("generate", "open"):
        start_rebuild(sup, slot, session_id)
    waiting = sup.rebuilding.get(session_id) if session_id else None
    if waiting is not None:
        waiting.append((flight, request))
        return
    sup._send(slot, flight, request)


def local_error(
    sup: Supervisor, channel: Channel, flight: Inflight, code: str, message: str, **extra: Any
) -> None:
    sup._answer(channel, flight, {"event": "error", "error": message, "code": code, **extra})


def client_cancel(sup: Supervisor, channel: Channel, client_id: Any) -> None:
    flight = channel.by_client_id.get(client_id) if client_id is not NO_ID else None
    if flight is None:
        channel.emit(
            {
                "event": "error",
                "error": f"no request with id {client_id!r} in flight",
                "code": ErrorCode.UNKNOWN_ID,
                "op": "cancel",
                **({} if client_id is NO_ID else {"id": client_id}),
            }
        )
        return
    cancel_flight(sup, flight)


def cancel_flight(sup: Supervisor, flight: Inflight) -> None:
    if flight.worker < 0:
        return  # answered locally, nothing to cancel
    slot = sup.slots[flight.worker]
    if flight.iid not in slot.inflight:
        return
    if flight.sent:
        if slot.process is not None and flight.op == "generate":
            slot.process.send(orjson.dumps({"op": "cancel", "id": flight.iid}) + b"\n")
    else:
        flight.cancelled = True  # answered with a cancelled done when its turn comes
        if flight.session_id not in sup.rebuilding and flight in [f for f, _ in slot.held]:
            slot.held = [(f, line) for f, line in slot.held if f is not flight]
            del slot.inflight[flight.iid]
            sup._answer(flight.channel, flight, cancelled_done())


def cancelled_done() -> dict[str, Any]:
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
