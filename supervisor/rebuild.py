"""Named sessions after a worker's death: rebuilt from the mirror on first use, or forgotten.

A session whose worker died is in `needs_rebuild` (it lives only in the mirror). The first
generate or open naming it sends a prefill-only request of the mirrored ids first; requests
that arrive meanwhile wait in `rebuilding[session_id]` and are sent once it is done.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import ErrorCode
from supervisor.flight import error_event
from supervisor.mirror import rebuild_request
from supervisor.pool import log
from supervisor.state import SupervisorState, WorkerSlot


def start_rebuild(state: SupervisorState, slot: WorkerSlot, session_id: str) -> None:
    state.needs_rebuild.discard(session_id)
    resident = state.mirror.resident(session_id)
    if not resident:
        return
    state.rebuilding[session_id] = []

    def rebuilt(event: dict[str, Any]) -> None:
        waiting = state.rebuilding.pop(session_id, [])
        if event.get("event") == "done":
            for flight, request in waiting:
                state.send(slot, flight, request)
            return
        code = event.get("code", ErrorCode.INTERNAL_ERROR)
        if code != ErrorCode.WORKER_LOST:
            log(
                f"rebuilding session {session_id!r} on worker {slot.index} failed: "
                f"{event.get('error')}"
            )
        for flight, _request in waiting:
            if slot.inflight.pop(flight.iid, None) is not None:
                state.answer(
                    flight.channel,
                    flight,
                    error_event(
                        code,
                        f"session {session_id!r} could not be restored after a worker "
                        f"restart: {event.get('error')}",
                    ),
                )

    flight = state.internal(slot, rebuild_request(session_id, resident), session_id, rebuilt)
    state.send(slot, flight, rebuild_request(session_id, resident))


def forget_session(state: SupervisorState, session_id: str) -> None:
    placed = state.placements.pop(session_id, None)
    if placed is not None:
        state.slots[placed].named.discard(session_id)
    state.mirror.drop(session_id)
    state.needs_rebuild.discard(session_id)
