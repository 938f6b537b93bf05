"""Worker lifecycle: spawn, death, restart with backoff, and the heartbeat that turns a hung
worker into a dead one.

When a worker dies, each of its requests ends exactly once:
- one that already streamed a line to its client ends with `worker_lost` (its output cannot
  be taken back);
- one cancelled meanwhile ends with a cancelled `done`;
- any other (nothing of it reached the client: queued, prefilling, or sent to a worker that
  was already dead) is sent again, once (`MAX_RERUNS`), to the restarted worker or another one;
  a request that meets a second death ends with `worker_lost`.
Its named sessions move to `needs_rebuild`: the first request to each re-prefills the mirror.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from protocol.errors import ErrorCode
from supervisor.dispatch import rerun
from supervisor.flight import MAX_RERUNS, Inflight, cancelled_done, error_event
from supervisor.pool import WorkerProcess, WorkerStartError, log
from supervisor.relay import on_worker_lines
from supervisor.router import WorkerState, restart_delay, should_give_up
from supervisor.state import SupervisorState, WorkerSlot


async def spawn_worker(state: SupervisorState, slot: WorkerSlot) -> None:
    """Start `slot`'s worker and wait for its ready line; then send what was held for it."""
    process = await WorkerProcess.spawn(
        slot.spec,
        on_lines=lambda lines: on_worker_lines(state, slot, lines),
        on_death=lambda p: on_worker_death(state, slot, p),
        stderr_sink=state.stderr_sink,
        ready_timeout=state.config.ready_timeout,
    )
    slot.process = process
    slot.ready_info = process.ready_info
    slot.state = WorkerState.READY
    slot.last_heard = time.monotonic()
    slot.ping_sent_at = None
    adopt_restored(state, slot)
    held, slot.held = slot.held, []
    for flight, line in held:
        state.write(slot, flight, line)


def adopt_restored(state: SupervisorState, slot: WorkerSlot) -> None:
    """Place the sessions the worker restored from its --session-dir (its ready line names
    them) on it, so their requests go where the cache is. A session placed elsewhere meanwhile
    keeps its placement, and this worker's stale copy is closed (its file deleted)."""
    restored = slot.ready_info.get("restored_sessions")
    if not isinstance(restored, list):
        return
    for session_id in restored:
        if not isinstance(session_id, str) or not session_id:
            continue
        placed = state.placements.get(session_id)
        if placed is None:
            state.placements[session_id] = slot.index
            slot.named.add(session_id)
        elif placed != slot.index:
            log(
                f"worker {slot.index} restored session {session_id!r}, which lives on worker "
                f"{placed} now: closing its stale copy"
            )
            request = {"op": "close", "session_id": session_id}
            flight = state.internal(slot, request, session_id, lambda _event: None)
            state.send(slot, flight, dict(request))


def on_worker_death(state: SupervisorState, slot: WorkerSlot, process: WorkerProcess) -> None:
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
        state.needs_rebuild.add(session_id)
    for session_id in list(state.rebuilding):
        if state.placements.get(session_id) == slot.index:
            state.needs_rebuild.add(session_id)
    if process.stopping or state.closing:
        slot.state = WorkerState.FAILED
        fail_all(state, slot, ErrorCode.WORKER_LOST, f"worker {slot.index} {how}")
        return
    lived = time.monotonic() - (process.ready_at or process.started_at)
    slot.fast_failures = slot.fast_failures + 1 if lived < state.config.fast_failure_s else 0
    slot.state = WorkerState.STARTING
    slot.process = None
    slot.ping_sent_at = None
    # Take every request out of the slot (registration order = arrival order); a rebuild in
    # progress starts over with the re-run of the requests that waited for it.
    flights = list(slot.inflight.values())
    slot.inflight.clear()
    slot.held = []
    for session_id in list(state.rebuilding):
        if state.placements.get(session_id) == slot.index:
            del state.rebuilding[session_id]
    again: list[Inflight] = []
    lost = 0
    for flight in flights:
        if flight.then is not None:  # the supervisor's own (ping, stats, rebuild)
            state.answer(None, flight, error_event(ErrorCode.WORKER_LOST, f"worker {how}"))
        elif flight.cancelled or flight.cancel_sent:
            state.answer(flight.channel, flight, cancelled_done())
        elif flight.streamed or flight.reruns >= MAX_RERUNS or flight.request is None:
            lost += 1
            state.answer(
                flight.channel,
                flight,
                error_event(
                    ErrorCode.WORKER_LOST,
                    f"worker {slot.index} {how} while serving this request",
                    op=flight.op,
                ),
            )
        else:
            again.append(flight)
    log(
        f"worker {slot.index} (pid {process.pid}) {how}; {lost} request(s) lost, "
        f"{len(again)} sent again"
    )
    slot.restart_task = asyncio.ensure_future(restart(state, slot))
    for flight in again:
        rerun(state, flight)
    state.maybe_idle()


def fail_all(state: SupervisorState, slot: WorkerSlot, code: str, message: str) -> None:
    """End every request of `slot` with one error each (a flight ends exactly once)."""
    slot.held = []
    for iid in list(slot.inflight):
        flight = slot.inflight.pop(iid, None)
        if flight is None:
            continue
        state.answer(flight.channel, flight, error_event(code, message, op=flight.op))
    state.maybe_idle()


async def restart(state: SupervisorState, slot: WorkerSlot) -> None:
    while not state.closing:
        if should_give_up(slot.fast_failures, state.config.max_fast_failures):
            log(
                f"GIVING UP on worker {slot.index}: it failed {slot.fast_failures} times in "
                f"a row within {state.config.fast_failure_s:g}s of starting; its sessions "
                "move to the other workers"
            )
            slot.state = WorkerState.FAILED
            for session_id in list(slot.named):
                state.needs_rebuild.add(session_id)
            fail_all(state, slot, ErrorCode.WORKER_LOST, f"worker {slot.index} failed")
            return
        delay = restart_delay(slot.fast_failures, state.config.restart_base_s)
        log(f"restarting worker {slot.index} in {delay:.1f}s")
        await asyncio.sleep(delay)
        if state.closing:
            return
        try:
            await spawn_worker(state, slot)
        except WorkerStartError as exc:
            slot.fast_failures += 1
            log(str(exc))
            continue
        slot.restarts += 1
        log(f"worker {slot.index} restarted (pid {slot.process.pid if slot.process else '?'})")
        return


async def heartbeat(state: SupervisorState) -> None:
    """Ping every ready worker; kill one that stays silent past the timeout (a hung or
    SIGSTOPped process never dies by itself). Its death then runs the crash path."""
    interval = min(state.config.heartbeat_interval, state.config.heartbeat_timeout / 2)
    while not state.closing:
        await asyncio.sleep(interval)
        now = time.monotonic()
        for slot in state.slots:
            process = slot.process
            if slot.state is not WorkerState.READY or process is None or not process.alive:
                continue
            silent = now - slot.last_heard
            if slot.ping_sent_at is not None and silent > state.config.heartbeat_timeout:
                log(
                    f"worker {slot.index} (pid {process.pid}) wrote nothing for "
                    f"{silent:.1f}s with a ping out (heartbeat timeout "
                    f"{state.config.heartbeat_timeout:g}s): killing it"
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

                flight = state.internal(slot, {"op": "ping"}, "", pong)
                state.send(slot, flight, {"op": "ping"})
