"""From a client channel to a worker: id namespaces, id-less ordering, routing, cancel.

A `Channel` is one client connection; each request becomes an `Inflight` until its terminal
answer. `dispatch` answers what the supervisor answers itself (ping, shutdown, stats, close
or reset of a session that lives only in the mirror) and routes the rest to a worker, after a
session rebuild when its worker died. `rerun` sends a request again after its worker died
before answering it.

Intake: once a channel has sent `shutdown` (or the supervisor is closing), every later request
on it except `cancel` is answered `shutting_down`; an id-less one in its turn.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

from protocol.errors import ErrorCode
from supervisor.flight import NO_ID, Inflight, cancelled_done, error_event
from supervisor.rebuild import forget_session, start_rebuild
from supervisor.router import route_request
from supervisor.state import SupervisorState
from supervisor.stats import answer_stats

Emit = Callable[[dict[str, Any]], None]


class Channel:
    """One client connection: its id namespace and its ordered queue of id-less requests.

    `emit(event)` receives every answer as a dict. A line-oriented connection (stdio, socket)
    may also pass `emit_line(line)`: token events then arrive as ready-made JSON lines (no
    newline), with the id rewritten in the bytes, never parsed (the relay's fast path);
    `flush()` is called after each batch of worker output.
    """

    def __init__(
        self,
        state: SupervisorState,
        emit: Emit,
        emit_line: Callable[[bytes], None] | None = None,
        flush: Callable[[], None] | None = None,
    ) -> None:
        self.state = state
        self.emit = emit
        self.emit_line = emit_line
        self.flush = flush
        self.by_client_id: dict[Any, Inflight] = {}
        self.anonymous: deque[dict[str, Any]] = deque()
        self.anonymous_busy = False
        self._pumping = False
        self.closed = False
        self.shutdown_received = False  # this client sent `shutdown`: later requests refused

    def submit(self, request: dict[str, Any]) -> None:
        """Accept one request (a plain dict as on the wire; `op` absent means generate)."""
        op = request.get("op")
        refused = self.shutdown_received or self.state.closing or not self.state.accepting
        if refused and op not in ("cancel", "shutdown"):
            event = error_event(ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down")
            if request.get("id") is not None:
                event["id"] = request["id"]
            self.submit_error(event)
            return
        if op == "shutdown":
            self.shutdown_received = True
        if "id" in request and request["id"] is not None:
            dispatch(self.state, self, request)
            return
        request.pop("id", None)
        if len(self.anonymous) >= self.state.config.max_queue:
            self.submit_error(
                error_event(ErrorCode.OVERLOADED, "too many queued requests without an id")
            )
            return
        self.anonymous.append(request)
        self._pump()

    def submit_error(self, event: dict[str, Any]) -> None:
        """Answer a line that could not be taken; id-less ones keep their place in line."""
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
                dispatch(self.state, self, self.anonymous.popleft())
        finally:
            self._pumping = False

    def finished(self, flight: Inflight) -> None:
        if flight.client_id is NO_ID:
            self.anonymous_busy = False
            self._pump()
        else:
            self.by_client_id.pop(flight.client_id, None)
        self.state.maybe_idle()

    @property
    def idle(self) -> bool:
        return not self.by_client_id and not self.anonymous and not self.anonymous_busy

    def close(self) -> None:
        """The client went away: cancel what it has in flight; drop its answers."""
        self.closed = True
        self.anonymous.clear()
        for flight in list(self.by_client_id.values()):
            cancel_flight(self.state, flight)


def dispatch(state: SupervisorState, channel: Channel, request: dict[str, Any]) -> None:
    op = request.get("op") or "generate"
    client_id = request.get("id", NO_ID)
    if client_id is None:
        client_id = NO_ID
    session_id = request.get("session_id") or ""
    if op == "cancel":
        client_cancel(state, channel, client_id)
        return
    flight = Inflight(channel, client_id, op, session_id)
    if client_id is not NO_ID:
        if client_id in channel.by_client_id:
            channel.emit(
                error_event(
                    ErrorCode.DUPLICATE_ID,
                    f"id {client_id!r} is already in flight",
                    id=client_id,
                    op=op,
                )
            )
            return
        channel.by_client_id[client_id] = flight
    if op == "generate" and session_id:
        # Named sessions are mirrored: the worker reports the resident ids on every `done`.
        flight.strip_resident = not request.get("return_resident", False)
        request["return_resident"] = True
    handle(state, channel, flight, request)


def handle(state: SupervisorState, channel: Channel, flight: Inflight, req: dict[str, Any]) -> None:
    """Answer `flight` here, or route it to a worker (its id already taken on `channel`)."""
    op, session_id = flight.op, flight.session_id
    if op == "_error":  # a rejected line, answered in its turn
        state.answer(channel, flight, req["event"])
    elif op == "ping":
        state.answer(channel, flight, {"event": "pong", "pong": True})
    elif op == "shutdown":
        channel.finished(flight)  # no answer line, as from a worker
        state.accepting = False
        if state.on_shutdown_request is not None:
            state.on_shutdown_request()
    elif op == "stats":
        asyncio.ensure_future(answer_stats(state, channel, flight))
    elif op in ("close", "reset") and session_id in state.needs_rebuild:
        # The worker that held it died: the session exists only in the mirror.
        if op == "close":
            forget_session(state, session_id)
            state.answer(
                channel, flight, {"event": "closed", "closed": True, "session_id": session_id}
            )
        else:
            state.mirror.clear(session_id)
            state.needs_rebuild.discard(session_id)
            state.answer(
                channel, flight, {"event": "reset", "reset": True, "session_id": session_id}
            )
    else:
        route_and_send(state, channel, flight, req)


def rerun(state: SupervisorState, flight: Inflight) -> None:
    """Send again a request whose worker died before any line of it reached the client (it
    was taken out of the dead worker's slot). Its client id stays taken meanwhile."""
    channel = flight.channel
    assert isinstance(channel, Channel) and flight.request is not None
    flight.reruns += 1
    flight.sent = False
    if channel.closed:
        state.answer(channel, flight, cancelled_done())
        return
    handle(state, channel, flight, flight.request)


def route_and_send(
    state: SupervisorState, channel: Channel, flight: Inflight, request: dict[str, Any]
) -> None:
    op, session_id = flight.op, flight.session_id
    route = route_request(op, session_id, state.placements, state.loads())
    if route.worker is None:
        state.answer(
            channel,
            flight,
            error_event(
                route.error_code or ErrorCode.INTERNAL_ERROR, route.error or "no worker", op=op
            ),
        )
        return
    slot = state.slots[route.worker]
    if route.new_placement:
        old = state.placements.get(session_id)
        if old is not None:
            state.slots[old].named.discard(session_id)
        state.placements[session_id] = slot.index
        slot.named.add(session_id)
        flight.new_placement = old is None
    flight.request = request
    state.register(slot, flight)
    if session_id and session_id in state.needs_rebuild and op in ("generate", "open"):
        start_rebuild(state, slot, session_id)
    waiting = state.rebuilding.get(session_id) if session_id else None
    if waiting is not None:
        waiting.append((flight, request))
        return
    state.send(slot, flight, request)


def client_cancel(state: SupervisorState, channel: Channel, client_id: Any) -> None:
    flight = channel.by_client_id.get(client_id) if client_id is not NO_ID else None
    if flight is None:
        channel.emit(
            error_event(
                ErrorCode.UNKNOWN_ID,
                f"no request with id {client_id!r} in flight",
                op="cancel",
                **({} if client_id is NO_ID else {"id": client_id}),
            )
        )
        return
    cancel_flight(state, flight)


def cancel_flight(state: SupervisorState, flight: Inflight) -> None:
    if flight.worker < 0:
        return  # answered locally, nothing to cancel
    slot = state.slots[flight.worker]
    if flight.iid not in slot.inflight:
        return
    if flight.sent:
        if slot.process is not None and flight.op == "generate" and not flight.cancel_sent:
            flight.cancel_sent = True
            slot.process.send(orjson.dumps({"op": "cancel", "id": flight.iid}) + b"\n")
    else:
        flight.cancelled = True  # answered with a cancelled done when its turn comes
        if flight.session_id not in state.rebuilding and flight in [f for f, _ in slot.held]:
            slot.held = [(f, line) for f, line in slot.held if f is not flight]
            del slot.inflight[flight.iid]
            state.answer(flight.channel, flight, cancelled_done())
