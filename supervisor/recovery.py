"""Crash recovery: a worker's death, its restart with backoff, the heartbeat that turns a hung
worker into a dead one, and the rebuild of its named sessions from the mirror.

Every request of a dead worker ends exactly once (`worker_lost`); its named sessions move to
`needs_rebuild`, and the first request to each re-prefills the mirror before it is sent.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from protocol.errors import ErrorCode
from supervisor.mirror import rebuild_request
from supervisor.pool import WorkerStartError, log
from supervisor.router import WorkerState, restart_delay, should_give_up

if TYPE_CHECKING:
    from supervisor.core import Supervisor, WorkerSlot
    from supervisor.pool import WorkerProcess


def on_worker_death(sup: Supervisor, slot: WorkerSlot, process: WorkerProcess) -> None:
    if process is not slot.process:
        return
    status = process.returncode
    how = (
        f"was killed by signal {-status}"
        if status is not None and status < 0
        else f"exited with status {status}"
    )
    # Its sessions now live only in the mirror.
    for session_id in slot.named:
        sup.needs_rebuild.add(session_id)
    for session_id in list(sup.rebuilding):
        if sup.placements.get(session_id) == slot.index:
            sup.needs_rebuild.add(session_id)
    if process.stopping or sup.closing:
        slot.state = WorkerState.FAILED
        fail_all(sup, slot, ErrorCode.WORKER_LOST, f"worker {slot.index} {how}")
        return
    lived = time.monotonic() - (process.ready_at or process.started_at)
    slot.fast_failures = slot.fast_failures + 1 if lived < sup.config.fast_failure_s else 0
    slot.state = WorkerState.STARTING
    slot.process = None
    in_flight = sum(1 for f in slot.inflight.values() if f.sent)
    log(f"worker {slot.index} (pid {process.pid}) {how}; {in_flight} request(s) lost")
    sent = {iid: f for iid, f in slot.inflight.items() if f.sent}
    for iid in sent:
        flight = slot.inflight.pop(iid, None)
        if flight is not None:
            sup._answer(
                flight.channel,
                flight,
                {
                    "event": "error",
                    "code": ErrorCode.WORKER_LOST,
                    "op": flight.op,
                    "error": f"worker {slot.index} {how} while serving this request",
                },
            )
    # Requests held or waiting for a rebuild were never sent: they wait for the restart,
    # but a rebuild must start over, so they are answered too.
    for session_id in list(sup.rebuilding):
        if sup.placements.get(session_id) == slot.index:
            for flight, _ in sup.rebuilding.pop(session_id):
                if slot.inflight.pop(flight.iid, None) is not None:
                    sup._answer(
                        flight.channel,
                        flight,
                        {
                            "event": "error",
                            "code": ErrorCode.WORKER_LOST,
                            "op": flight.op,
                            "error": f"worker {slot.index} {how} while serving this request",
                        },
                    )
    sup._maybe_idle()
    slot.restart_task = asyncio.ensure_future(restart(sup, slot))


def fail_all(sup: Supervisor, slot: WorkerSlot, code: str, message: str) -> None:
    """End every request of `slot` with one error each (a flight ends exactly once)."""
    slot.held = []
    for iid in list(slot.inflight):
        flight = slot.inflight.pop(iid, None)
        if flight is None:
            continue
        sup._answer(
            flight.channel,
            flight,
            {"event": "error", "error": message, "code": code, "op": flight.op},
        )
    sup._maybe_idle()


async def restart(sup: Supervisor, slot: WorkerSlot) -> None:
    while not sup.closing:
        if should_give_up(slot.fast_failures, sup.config.max_fast_failures):
            log(
                f"GIVING UP on worker {slot.index}: it failed {slot.fast_failures} times in "
                f"a row within {sup.config.fast_failure_s:g}s of starting; its sessions "
                "move to the other workers"
            )
            slot.state = WorkerState.FAILED
            for session_id in list(slot.named):
                sup.needs_rebuild.add(session_id)
            fail_all(sup, slot, ErrorCode.WORKER_LOST, f"worker {slot.index} failed")
            return
        delay = restart_delay(slot.fast_failures, sup.config.restart_base_s)
        log(f"restarting worker {slot.index} in {delay:.1f}s")
        await asyncio.sleep(delay)
        if sup.closing:
            return
        try:
            await sup._spawn(slot)
        except WorkerStartError as exc:
            slot.fast_failures += 1
            log(str(exc))
            continue
        slot.restarts += 1
        log(f"worker {slot.index} restarted (pid {slot.process.pid if slot.process else '?'})")
        return


async def heartbeat(sup: Supervisor) -> None:
    """Ping every ready worker; kill one that stays silent past the timeout (a hung or
    SIGSTOPped process never dies by itself). Its death then runs the crash path."""
    interval = min(sup.config.heartbeat_interval, sup.config.heartbeat_timeout / 2)
    while not sup.closing:
        await asyncio.sleep(interval)
        now = time.monotonic()
        for slot in sup.slots:
            process = slot.process
            if slot.state is not WorkerState.READY or process is None or not process.alive:
                continue
            silent = now - slot.last_heard
            if slot.ping_sent_at is not None and silent > sup.config.heartbeat_timeout:
                log(
                    f"worker {slot.index} (pid {process.pid}) wrote nothing for "
                    f"{silent:.1f}s with a ping out (heartbeat timeout "
                    f"{sup.config.heartbeat_timeout:g}s): killing it"
                )
                slot.ping_sent_at = None
                process.kill()  # SIGKILL: works on a stopped process too
            elif slot.ping_sent_at is None:
                slot.ping_sent_at = now

                def pong(
                    event: dict[str, Any], slot: WorkerSlot = slot, process: WorkerProcess = process
                ) -> None:
                    if slot.process is process:
                        slot.ping_sent_at = None

                flight = sup._internal(slot, {"op": "ping"}, "", pong)
                sup._send(slot, flight, {"op": "ping"})


def start_rebuild(sup: Supervisor, slot: WorkerSlot, session_id: str) -> None:
    sup.needs_rebuild.discard(session_id)
    resident = sup.mirror.resident(session_id)
    if not resident:
        return
    sup.rebuilding[session_id] = []

    def rebuilt(event: dict[str, Any]) -> None:
        waiting = sup.rebuilding.pop(session_id, [])
        if event.get("event") == "done":
            for flight, request in waiting:
                sup._send(slot, flight, request)
            return
        code = event.get("code", ErrorCode.INTERNAL_ERROR)
        if code != ErrorCode.WORKER_LOST:
            log(
                f"rebuilding session {session_id!r} on worker {slot.index} failed: "
                f"{event.get('error')}"
            )
        for flight, _request in waiting:
            if slot.inflight.pop(flight.iid, None) is not None:
                sup._answer(
                    flight.channel,
                    flight,
                    {
                        "event": "error",
                        "code": code,
                        "error": f"session {session_id!r} could not be restored after a "
                        f"worker restart: {event.get('error')}",
                    },
                )

    flight = sup._internal(slot, rebuild_request(session_id, resident), session_id, rebuilt)
    sup._send(slot, flight, rebuild_request(session_id, resident))


def forget_session(sup: Supervisor, session_id: str) -> None:
    placed = sup.placements.pop(session_id, None)
    if placed is not None:
        sup.slots[placed].named.discard(session_id)
    sup.mirror.drop(session_id)
    sup.needs_rebuild.discard(session_id)
