"""The worker-facing relay: worker stdout lines back to their clients (the hot path).

Token lines of a line-oriented client are relayed as bytes with the id rewritten; every other
line is decoded, its internal id mapped back to the client's, and its terminal event keeps the
session mirror and the placements up to date.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from supervisor.dispatch import NO_ID, TOKEN_ID, TOKEN_ID_LEN
from supervisor.pool import log
from supervisor.recovery import forget_session

if TYPE_CHECKING:
    from supervisor.core import Supervisor, WorkerSlot
    from supervisor.dispatch import Channel, Inflight


# Error codes a worker may answer that mean "the session was never created there".
PLACEMENT_FAILED = frozenset({"capacity_exhausted", "unsupported_session", "invalid_request"})


def on_worker_lines(sup: Supervisor, slot: WorkerSlot, lines: list[bytes]) -> None:
    """The relay hot path: one call per pipe read."""
    slot.last_heard = time.monotonic()
    inflight = slot.inflight
    loads = orjson.loads
    touched: set[Channel] = set()
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
                    if not channel.closed:
                        channel.emit_line(flight.token_prefix + line[comma:])
                        touched.add(channel)
                    continue
        try:
            event = loads(line)
            flight = inflight.get(event.get("id"))
        except (orjson.JSONDecodeError, AttributeError):
            if line.strip():
                log(f"worker {slot.index} wrote a line that is not a JSON object: {line[:200]!r}")
            continue
        if flight is None:
            continue  # e.g. the unknown_id answer to a cancel that raced a done
        kind = event.get("event")
        if kind == "token":
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
        finish(sup, slot, flight, event)
    for channel in touched:
        if channel.flush is not None and not channel.closed:
            channel.flush()


def finish(sup: Supervisor, slot: WorkerSlot, flight: Inflight, event: dict[str, Any]) -> None:
    kind = event.get("event")
    session_id = flight.session_id
    if flight.op == "generate" and session_id:
        if kind == "done" and "resident_keep" in event:
            sup.mirror.apply(session_id, event["resident_keep"], event.get("resident_append") or [])
        if flight.strip_resident:
            event.pop("resident_keep", None)
            event.pop("resident_append", None)
    if kind == "error" and flight.new_placement and event.get("code") in PLACEMENT_FAILED:
        if (
            not sup.mirror.resident(session_id)
            and sup.placements.get(session_id) == slot.index
            and not any(f.session_id == session_id for f in slot.inflight.values())
        ):
            forget_session(sup, session_id)
    elif kind == "closed":
        forget_session(sup, session_id)
    elif kind == "reset":
        sup.mirror.clear(session_id)
    elif kind == "info" and isinstance(event.get("info"), dict):
        event["info"]["workers"] = len(sup.slots)
        event["info"]["supervisor_max_sessions"] = sup.ready.get("max_sessions")
    sup._answer(flight.channel, flight, event)
