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
dies, each in-flight request ends with exactly one `worker_lost` error, the worker restarts
with backoff, and the first request to each of its sessions first re-prefills the mirror.

This file holds the config, the worker slots, start-up and shutdown, and the send and answer
primitives the other parts share: `dispatch.py` (channels, routing, cancel), `relay.py`
(worker output back to clients), `recovery.py` (heartbeat, crash, restart, session rebuild),
`stats.py` (the `stats` answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from protocol.errors import ErrorCode
from supervisor.dispatch import NO_ID, Channel, Emit, Inflight, cancel_flight, cancelled_done
from supervisor.mirror import SessionMirror
from supervisor.pool import (
    WorkerProcess,
    WorkerSpec,
    default_stderr_sink,
    default_worker_command,
    detect_gpus,
    plan_devices,
    worker_specs,
)
from supervisor.recovery import fail_all, heartbeat, on_worker_death
from supervisor.relay import on_worker_lines
from supervisor.router import WorkerLoad, WorkerState


@dataclass(frozen=True)
class SupervisorConfig:
    """What `tokenpipe run` (and `AsyncClient.in_process`) start. Validated on creation."""

    model: str | None = None
    gpus: str = "all"  # "all" | "none" | "0,2"
    workers: int | None = None  # N CPU workers (wins over gpus)
    max_sessions: int | None = None  # per worker; None = the worker's default
    max_context: int | None = None
    max_queue: int = 64  # per worker: requests sent or held, not yet answered
    worker_args: tuple[str, ...] = ()  # other worker flags, passed through
    worker_command: tuple[str, ...] | None = None  # default: `tokenpipe worker`
    ready_timeout: float = 600.0
    drain_timeout: float = 30.0  # SIGTERM / aclose: finish in-flight work within this
    max_fast_failures: int = 5  # give up on a worker after this many fast failures in a row
    fast_failure_s: float = 30.0  # a worker dying sooner than this after ready failed "fast"
    restart_base_s: float = 0.5
    env: tuple[tuple[str, str], ...] = ()  # extra environment for every worker
    # Liveness: a ping every `heartbeat_interval` s; a worker that has written nothing for
    # `heartbeat_timeout` s while a ping is out is killed and restarted (0 disables). The
    # timeout must exceed the longest forward step (a worker answers pings between steps).
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {self.max_sessions}")
        if self.ready_timeout <= 0:
            raise ValueError("ready_timeout must be positive")
        if self.heartbeat_timeout < 0 or self.heartbeat_interval <= 0:
            raise ValueError("heartbeat_timeout must be >= 0 and heartbeat_interval positive")


def build_worker_args(config: SupervisorConfig) -> list[str]:
    args: list[str] = []
    if config.model is not None:
        args += ["--model", config.model]
    if config.max_sessions is not None:
        args += ["--max-sessions", str(config.max_sessions)]
    if config.max_context is not None:
        args += ["--max-context", str(config.max_context)]
    return args + list(config.worker_args)


def plan_specs(config: SupervisorConfig) -> list[WorkerSpec]:
    visible = detect_gpus() if config.workers is None else []
    devices = plan_devices(config.gpus, config.workers, visible)
    command = config.worker_command or default_worker_command()
    specs = worker_specs(command, build_worker_args(config), devices)
    if config.env:
        specs = [
            WorkerSpec(s.index, s.argv, {**s.env, **dict(config.env)}, s.device) for s in specs
        ]
    return specs


@dataclass
class WorkerSlot:
    """Worker `index` across restarts."""

    spec: WorkerSpec
    state: WorkerState = WorkerState.STARTING
    process: WorkerProcess | None = None
    inflight: dict[int, Inflight] = field(default_factory=dict)
    held: list[tuple[Inflight, bytes]] = field(default_factory=list)  # waiting for ready
    named: set[str] = field(default_factory=set)
    restarts: int = 0
    fast_failures: int = 0
    ready_info: dict[str, Any] = field(default_factory=dict)
    restart_task: asyncio.Task[None] | None = None
    last_heard: float = 0.0  # monotonic time of the last stdout line (or of ready)
    ping_sent_at: float | None = None  # a heartbeat ping is out since then

    @property
    def index(self) -> int:
        return self.spec.index


class Supervisor:
    """Start with `await Supervisor(config).start()`; stop with `await aclose()`."""

    def __init__(
        self, config: SupervisorConfig, stderr_sink: Callable[[bytes], None] | None = None
    ) -> None:
        self.config = config
        self.stderr_sink = stderr_sink or default_stderr_sink
        self.slots: list[WorkerSlot] = []
        self.placements: dict[str, int] = {}
        self.mirror = SessionMirror()
        self.needs_rebuild: set[str] = set()
        self.rebuilding: dict[str, list[tuple[Inflight, dict[str, Any]]]] = {}
        self.channels: list[Channel] = []
        self.ready: dict[str, Any] = {}
        self.closing = False
        self.started_at = time.monotonic()
        self._ids = itertools.count(1)
        self._idle = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.on_shutdown_request: Callable[[], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> dict[str, Any]:
        """Spawn every worker and wait for all ready lines; returns the supervisor's ready
        event. Raises WorkerStartError (naming the worker, with its last stderr lines)."""
        specs = plan_specs(self.config)
        self.slots = [WorkerSlot(spec) for spec in specs]
        results = await asyncio.gather(
            *(self._spawn(slot) for slot in self.slots), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self._stop_workers()
            raise errors[0]
        self.ready = self._ready_event()
        if self.config.heartbeat_timeout > 0:
            self._heartbeat_task = asyncio.ensure_future(heartbeat(self))
        return self.ready

    async def _spawn(self, slot: WorkerSlot) -> None:
        process = await WorkerProcess.spawn(
            slot.spec,
            on_lines=lambda lines, s=slot: on_worker_lines(self, s, lines),
            on_death=lambda p, s=slot: on_worker_death(self, s, p),
            stderr_sink=self.stderr_sink,
            ready_timeout=self.config.ready_timeout,
        )
        slot.process = process
        slot.ready_info = process.ready_info
        slot.state = WorkerState.READY
        slot.last_heard = time.monotonic()
        slot.ping_sent_at = None
        held, slot.held = slot.held, []
        for flight, line in held:
            self._write(slot, flight, line)

    def _ready_event(self) -> dict[str, Any]:
        per_worker = []
        for slot in self.slots:
            info = slot.ready_info
            per_worker.append(
                {
                    "index": slot.index,
                    "device": slot.spec.device,
                    "max_sessions": int(info.get("max_sessions", 1)),
                    "max_named_sessions": int(info.get("max_named_sessions", 0)),
                }
            )
        first = self.slots[0].ready_info
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
        ready["device"] = ",".join(sorted({w["device"] for w in per_worker}))
        return ready

    def open_channel(
        self,
        emit: Emit,
        emit_line: Callable[[bytes], None] | None = None,
        flush: Callable[[], None] | None = None,
    ) -> Channel:
        channel = Channel(self, emit, emit_line, flush)
        self.channels.append(channel)
        return channel

    def close_channel(self, channel: Channel) -> None:
        channel.close()
        with contextlib.suppress(ValueError):
            self.channels.remove(channel)
        self._maybe_idle()

    @property
    def busy(self) -> bool:
        return any(slot.inflight for slot in self.slots) or not all(c.idle for c in self.channels)

    def _maybe_idle(self) -> None:
        if not self.busy:
            self._idle.set()

    async def drain(self, timeout: float | None) -> bool:
        """Wait until nothing is in flight; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.busy:
            self._idle.clear()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), remaining)
        return True

    async def aclose(self, timeout: float | None = None) -> None:
        """Finish in-flight work (within `timeout`, default drain_timeout), cancel what is
        left, stop every worker. Idempotent."""
        timeout = self.config.drain_timeout if timeout is None else timeout
        if not self.closing:
            self.closing = True
            if not await self.drain(timeout):
                for slot in self.slots:
                    for flight in list(slot.inflight.values()):
                        cancel_flight(self, flight)
                await self.drain(2.0)
        await self._stop_workers()

    async def _stop_workers(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        for slot in self.slots:
            if slot.restart_task is not None:
                slot.restart_task.cancel()
            slot.state = WorkerState.FAILED
        await asyncio.gather(
            *(slot.process.stop() for slot in self.slots if slot.process is not None),
            return_exceptions=True,
        )
        for slot in self.slots:  # anything left (a worker that never answered) ends here
            fail_all(self, slot, ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down")

    def kill_workers(self) -> None:
        """Immediate exit path (second SIGINT): SIGKILL every worker."""
        for slot in self.slots:
            if slot.process is not None:
                slot.process.kill()

    # ------------------------------------------------------------------ send and answer

    def _loads(self) -> list[WorkerLoad]:
        return [
            WorkerLoad(
                index=s.index,
                state=s.state,
                queued=len(s.inflight) - (s.ping_sent_at is not None),  # a heartbeat is no load
                named_sessions=len(s.named),
                max_named_sessions=int(s.ready_info.get("max_named_sessions", 0)),
                max_queue=self.config.max_queue,
            )
            for s in self.slots
        ]

    def _answer(self, channel: Channel | None, flight: Inflight, event: dict[str, Any]) -> None:
        """Deliver a terminal answer of `flight` to its client (or its internal callback)."""
        if flight.then is not None:
            flight.then(event)
            self._maybe_idle()  # an internal request (ping, stats, rebuild) may be the last
            return
        if channel is None:
            return
        if flight.client_id is NO_ID:
            event.pop("id", None)
        else:
            event["id"] = flight.client_id
        if not channel.closed:
            channel.emit(event)
        channel._finished(flight)

    def _register(self, slot: WorkerSlot, flight: Inflight) -> None:
        flight.iid = next(self._ids)
        flight.worker = slot.index
        slot.inflight[flight.iid] = flight

    def _send(self, slot: WorkerSlot, flight: Inflight, request: dict[str, Any]) -> None:
        request["id"] = flight.iid
        line = orjson.dumps(request) + b"\n"
        if slot.state is WorkerState.READY and slot.process is not None:
            self._write(slot, flight, line)
        else:
            slot.held.append((flight, line))

    def _write(self, slot: WorkerSlot, flight: Inflight, line: bytes) -> None:
        if flight.iid not in slot.inflight:
            return  # answered meanwhile (e.g. cancelled while held)
        if flight.cancelled:
            del slot.inflight[flight.iid]
            self._answer(flight.channel, flight, cancelled_done())
            return
        flight.sent = True
        assert slot.process is not None
        slot.process.send(line)

    def _internal(
        self,
        slot: WorkerSlot,
        request: dict[str, Any],
        session_id: str,
        then: Callable[[dict[str, Any]], None],
    ) -> Inflight:
        flight = Inflight(None, NO_ID, request.get("op", "generate"), session_id)
        flight.then = then
        self._register(slot, flight)
        return flight
