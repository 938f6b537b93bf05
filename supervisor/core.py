"""The in-process supervisor: workers, routing, id multiplexing, crash recovery, shutdown.

Runs inside the caller's asyncio event loop and does no I/O of its own besides the worker
pipes. Clients talk to it through a `Channel` (one per connection: `tokenpipe run`'s stdio, a
unix-socket connection, an in-process `AsyncClient`): `channel.submit(request_dict)` and the
channel's `emit(event_dict)` callback for every answer line.

Ids: every request sent to a worker carries a fresh internal integer id, unique for the
supervisor's lifetime; answers are mapped back to the client's id (or have the id removed
when the client sent none). A client id in flight twice on one channel gets `duplicate_id`.
Requests without an id are answered one at a time in the order they came (the seed order).

Named sessions are mirrored (`return_resident` on every named generate); when their worker
dies, a request that had streamed output ends with exactly one `worker_lost` error, one that
had not is sent again, the worker restarts with backoff, and the first request to each of its
sessions first re-prefills the mirror.

`Supervisor` composes the parts, which share one `SupervisorState` (state.py) and never import
this file: `dispatch.py` (channels, routing, cancel), `relay.py` (worker output back to
clients), `recovery.py` (spawn, death, re-run, restart, heartbeat), `rebuild.py` (sessions
after a death), `stats.py` (the `stats` answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from protocol.errors import ErrorCode
from supervisor.config import SupervisorConfig, build_worker_args, plan_specs, session_root
from supervisor.dispatch import Channel, Emit, cancel_flight
from supervisor.pool import StderrSink, log
from supervisor.recovery import fail_all, heartbeat, spawn_worker
from supervisor.router import WorkerState
from supervisor.session_dirs import prepare_root
from supervisor.state import SupervisorState, WorkerSlot

__all__ = ["Supervisor", "SupervisorConfig", "WorkerSlot", "build_worker_args", "plan_specs"]

SESSION_SAVE_GRACE_S = 300.0
"""How long a stopping worker with --session-dir may take to save its sessions (then SIGTERM)."""


class Supervisor:
    """Start with `await Supervisor(config).start()`; stop with `await aclose()`."""

    def __init__(self, config: SupervisorConfig, stderr_sink: StderrSink | None = None) -> None:
        self.config = config
        self.state = SupervisorState(config, stderr_sink)
        self._heartbeat_task: asyncio.Task[None] | None = None

    # The state's parts that callers and tests read.
    @property
    def slots(self) -> list[WorkerSlot]:
        return self.state.slots

    @property
    def placements(self) -> dict[str, int]:
        return self.state.placements

    @property
    def ready(self) -> dict[str, Any]:
        return self.state.ready

    @property
    def closing(self) -> bool:
        return self.state.closing

    @property
    def on_shutdown_request(self) -> Callable[[], None] | None:
        return self.state.on_shutdown_request

    @on_shutdown_request.setter
    def on_shutdown_request(self, callback: Callable[[], None] | None) -> None:
        self.state.on_shutdown_request = callback

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> dict[str, Any]:
        """Spawn every worker and wait for all ready lines; returns the supervisor's ready
        event. Raises WorkerStartError (naming the worker, with its last stderr lines)."""
        state = self.state
        state.slots = [WorkerSlot(spec) for spec in plan_specs(self.config)]
        root = session_root(self.config)
        if root is not None:
            for problem in await asyncio.to_thread(prepare_root, root, len(state.slots)):
                log(problem)
        results = await asyncio.gather(
            *(spawn_worker(state, slot) for slot in state.slots), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self._stop_workers()
            raise errors[0]
        state.ready = self._ready_event()
        if self.config.heartbeat_timeout > 0:
            self._heartbeat_task = asyncio.ensure_future(heartbeat(state))
        return state.ready

    def _ready_event(self) -> dict[str, Any]:
        per_worker = []
        for slot in self.state.slots:
            info = slot.ready_info
            per_worker.append(
                {
                    "index": slot.index,
                    "device": slot.spec.device,
                    "max_sessions": int(info.get("max_sessions", 1)),
                    "max_named_sessions": int(info.get("max_named_sessions", 0)),
                }
            )
        first = self.state.slots[0].ready_info
        ready: dict[str, Any] = {
            "event": "ready",
            "ready": True,
            "max_sessions": sum(w["max_sessions"] for w in per_worker),
            "max_named_sessions": sum(w["max_named_sessions"] for w in per_worker),
            "workers": len(per_worker),
            "worker_capacity": per_worker,
        }
        for key in ("model", "architecture", "context_length", "protocol_version"):
            if key in first:
                ready[key] = first[key]
        restored = list(self.state.placements)  # so far: what --session-dir held, newest first
        if restored:
            ready["restored_sessions"] = restored
        ready["device"] = ",".join(sorted({w["device"] for w in per_worker}))
        return ready

    def open_channel(
        self,
        emit: Emit,
        emit_line: Callable[[bytes], None] | None = None,
        flush: Callable[[], None] | None = None,
    ) -> Channel:
        channel = Channel(self.state, emit, emit_line, flush)
        self.state.channels.append(channel)
        return channel

    def close_channel(self, channel: Channel) -> None:
        channel.close()
        with contextlib.suppress(ValueError):
            self.state.channels.remove(channel)
        self.state.maybe_idle()

    @property
    def busy(self) -> bool:
        return self.state.busy

    async def drain(self, timeout: float | None) -> bool:
        """Wait until nothing is in flight; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        idle = self.state.idle_event
        while self.state.busy:
            idle.clear()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(idle.wait(), remaining)
        return True

    async def aclose(self, timeout: float | None = None) -> None:
        """Finish in-flight work (within `timeout`, default drain_timeout), cancel what is
        left, stop every worker. Idempotent."""
        timeout = self.config.drain_timeout if timeout is None else timeout
        state = self.state
        if not state.closing:
            state.closing = True
            if not await self.drain(timeout):
                for slot in state.slots:
                    for flight in list(slot.inflight.values()):
                        cancel_flight(state, flight)
                await self.drain(2.0)
        await self._stop_workers()

    async def _stop_workers(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        for slot in self.state.slots:
            if slot.restart_task is not None:
                slot.restart_task.cancel()
            slot.state = WorkerState.FAILED
        # with --session-dir a worker saves its named sessions before it exits (1.5 GB each for
        # an 8k-token Gemma 4 31B session, ~2 s apiece on the H200 host's disk): wait for it
        # (a second SIGINT still kills at once)
        grace = 5.0 if session_root(self.config) is None else SESSION_SAVE_GRACE_S
        await asyncio.gather(
            *(slot.process.stop(grace) for slot in self.state.slots if slot.process is not None),
            return_exceptions=True,
        )
        for slot in self.state.slots:  # anything left (a worker that never answered) ends here
            fail_all(self.state, slot, ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down")

    def kill_workers(self) -> None:
        """Immediate exit path (second SIGINT): SIGKILL every worker."""
        for slot in self.state.slots:
            if slot.process is not None:
                slot.process.kill()
