"""The worker-facing relay: worker stdout lines back to their clients (the hot path).

Token lines of a line-oriented client are relayed as bytes with the id rewritten; every other
line is decoded, its internal id mapped back to the client's, and its terminal event keeps the
session mirror and the placements up to date.

Invariant: a terminal line is never dropped while its request waits for it. Lines of requests
already answered (a cancel's `unknown_id` that raced a `done`) are dropped; a terminal line
without a usable id is given to the slot's only request that was sent and not yet answered,
when there is exactly one (otherwise it is logged: no request can be named).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from supervisor.flight import NO_ID, TOKEN_ID, TOKEN_ID_LEN, ClientSink, Inflight
from supervisor.pool import log
from supervisor.rebuild import forget_session
from supervisor.state import SupervisorState, WorkerSlot

# Error codes a worker may answer that mean "the session was never created there".
PLACEMENT_FAILED = frozenset({"capacity_exhausted", "unsupported_session", "invalid_request"})


def on_worker_lines(state: SupervisorState, slot: WorkerSlot, lines: list[bytes]) -> None:
    """The relay hot path: one call per pipe read."""
    slot.last_heard = time.monotonic()
    inflight = slot.inflight
    loads = orjson.loads
    touched: set[ClientSink] = set()
    for line in lines:
        if line.startswith(TOKEN_ID):
            # Fast path: a token line of a line-oriented client is relayed as bytes.
            comma = line.find(b",", TOKEN_ID_LEN)
            digits = line[TOKEN_ID_LEN:comma]
            if comma > 0 and digits.isdigit():
                flight = inflight.get(int(digits))
                if flight is None:
                    continue
                channel = flight.channel
                if channel is not None and channel.emit_line is not None:
                    flight.streamed = True
                    if not channel.closed:
                        channel.emit_line(flight.token_prefix + line[comma:])
                        touched.add(channel)
                    continue
        try:
            event = loads(line)
            rid = event.get("id")
            flight = inflight.get(rid)
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            if line.strip():
                log(f"worker {slot.index} wrote a line that is not a JSON object: {line[:200]!r}")
            continue
        kind = event.get("event")
        if flight is None:
            if rid is None and kind not in ("token", "ready"):
                flight = _only_sent(slot)
                log(f"worker {slot.index} answered without an id: {line[:200]!r}")
            if flight is None:
                continue  # e.g. the unknown_id answer to a cancel that raced a done
        if kind == "token":
            flight.streamed = True
            channel = flight.channel
            if channel is not None and not channel.closed:
                if flight.client_id is NO_ID:
                    del event["id"]
                else:
                    event["id"] = flight.client_id
                channel.emit(event)
                touched.add(channel)
            continue
        if kind == "error" and event.get("op") == "cancel":
            continue
        del inflight[flight.iid]
        if flight.channel is not None:
            touched.add(flight.channel)
        finish(state, slot, flight, event)
    for channel in touched:
        if channel.flush is not None and not channel.closed:
            channel.flush()


def _only_sent(slot: WorkerSlot) -> Inflight | None:
    """The one request this worker was sent and has not answered, if there is exactly one."""
    sent = [f for f in slot.inflight.values() if f.sent]
    return sent[0] if len(sent) == 1 else None


def finish(
    state: SupervisorState, slot: WorkerSlot, flight: Inflight, event: dict[str, Any]
) -> None:
    kind = event.get("event")
    session_id = flight.session_id
    if flight.op == "generate" and session_id:
        if kind == "done" and "resident_keep" in event:
            append = event.get("resident_append") or []
            state.mirror.apply(session_id, event["resident_keep"], append)
        if flight.strip_resident:
            event.pop("resident_keep", None)
            event.pop("resident_append", None)
    if kind == "error" and flight.new_placement and event.get("code") in PLACEMENT_FAILED:
        if (
            not state.mirror.resident(session_id)
            and state.placements.get(session_id) == slot.index
            and not any(f.session_id == session_id for f in slot.inflight.values())
        ):
            forget_session(state, session_id)
    elif kind == "closed":
        forget_session(state, session_id)
    elif kind == "reset":
        state.mirror.clear(session_id)
    elif kind == "info" and isinstance(event.get("info"), dict):
        event["info"]["workers"] = len(state.slots)
        event["info"]["supervisor_max_sessions"] = state.ready.get("max_sessions")
    state.answer(flight.channel, flight, event)
