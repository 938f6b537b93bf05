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
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import psutil

from protocol.errors import ErrorCode
from supervisor.mirror import SessionMirror, rebuild_request
from supervisor.pool import (
    WorkerProcess,
    WorkerSpec,
    WorkerStartError,
    default_stderr_sink,
    default_worker_command,
    detect_gpus,
    log,
    plan_devices,
    worker_specs,
)
from supervisor.router import (
    WorkerLoad,
    WorkerState,
    restart_delay,
    route_request,
    should_give_up,
)

Emit = Callable[[dict[str, Any]], None]
_NO_ID: Any = object()  # the client sent no id: strip it from answers

# How a worker writes a token event (msgspec: the tag, then `id`, then `token`).
_TOKEN_ID = b'{"event":"token","id":'
_TOKEN_NO_ID = b'{"event":"token"'
_TOKEN_ID_LEN = len(_TOKEN_ID)

# Error codes a worker may answer that mean "the session was never created there".
_PLACEMENT_FAILED = frozenset({"capacity_exhausted", "unsupported_session", "invalid_request"})


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
        specs = [WorkerSpec(s.index, s.argv, {**s.env, **dict(config.env)}, s.device)
                 for s in specs]
    return specs


class Inflight:
    """One request between its arrival and its terminal answer."""

    __slots__ = ("iid", "channel", "client_id", "op", "session_id", "worker", "strip_resident",
                 "then", "sent", "cancelled", "new_placement", "token_prefix")

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
            _TOKEN_NO_ID if client_id is _NO_ID else _TOKEN_ID + orjson.dumps(client_id)
        )


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


class Channel:
    """One client connection: its id namespace and its ordered queue of id-less requests.

    `emit(event)` receives every answer as a dict. A line-oriented connection (stdio, socket)
    may also pass `emit_line(line)`: token events then arrive as ready-made JSON lines (no
    newline), with the id rewritten in the bytes, never parsed (the relay's fast path);
    `flush()` is called after each batch of worker output.
    """

    def __init__(self, supervisor: Supervisor, emit: Emit,
                 emit_line: Callable[[bytes], None] | None = None,
                 flush: Callable[[], None] | None = None) -> None:
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
            event = {"event": "error", "error": "the supervisor is shutting down",
                     "code": ErrorCode.SHUTTING_DOWN}
            if request.get("id") is not None:
                event["id"] = request["id"]
            self.emit(event)
            return
        if "id" in request and request["id"] is not None:
            self.supervisor._dispatch(self, request)
            return
        request.pop("id", None)
        if len(self.anonymous) >= self.supervisor.config.max_queue:
            self.emit({"event": "error", "error": "too many queued requests without an id",
                       "code": ErrorCode.OVERLOADED})
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
                self.supervisor._dispatch(self, self.anonymous.popleft())
        finally:
            self._pumping = False

    def _finished(self, flight: Inflight) -> None:
        if flight.client_id is _NO_ID:
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
            self.supervisor._cancel_flight(flight)


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
            self._heartbeat_task = asyncio.ensure_future(self._heartbeat())
        return self.ready

    async def _spawn(self, slot: WorkerSlot) -> None:
        process = await WorkerProcess.spawn(
            slot.spec,
            on_lines=lambda lines, s=slot: self._on_worker_lines(s, lines),
            on_death=lambda p, s=slot: self._on_worker_death(s, p),
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
            per_worker.append({
                "index": slot.index, "device": slot.spec.device,
                "max_sessions": int(info.get("max_sessions", 1)),
                "max_named_sessions": int(info.get("max_named_sessions", 0)),
            })
        first = self.slots[0].ready_info
        ready: dict[str, Any] = {
            "event": "ready", "ready": True,
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

    def open_channel(self, emit: Emit, emit_line: Callable[[bytes], None] | None = None,
                     flush: Callable[[], None] | None = None) -> Channel:
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
        return any(slot.inflight for slot in self.slots) or not all(
            c.idle for c in self.channels
        )

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
                        self._cancel_flight(flight)
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
            self._fail_all(slot, ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down")

    def kill_workers(self) -> None:
        """Immediate exit path (second SIGINT): SIGKILL every worker."""
        for slot in self.slots:
            if slot.process is not None:
                slot.process.kill()

    # ------------------------------------------------------------------ requests

    def _loads(self) -> list[WorkerLoad]:
        return [
            WorkerLoad(
                index=s.index, state=s.state,
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
        if flight.client_id is _NO_ID:
            event.pop("id", None)
        else:
            event["id"] = flight.client_id
        if not channel.closed:
            channel.emit(event)
        channel._finished(flight)

    def _local_error(self, channel: Channel, flight: Inflight, code: str, message: str,
                     **extra: Any) -> None:
        self._answer(channel, flight, {"event": "error", "error": message, "code": code, **extra})

    def _dispatch(self, channel: Channel, request: dict[str, Any]) -> None:
        op = request.get("op") or "generate"
        client_id = request.get("id", _NO_ID)
        if client_id is None:
            client_id = _NO_ID
        session_id = request.get("session_id") or ""
        flight = Inflight(channel, client_id, op, session_id)
        if op == "cancel":
            self._client_cancel(channel, client_id)
            return
        if client_id is not _NO_ID:
            if client_id in channel.by_client_id:
                channel.emit({"event": "error", "error": f"id {client_id!r} is already in flight",
                              "code": ErrorCode.DUPLICATE_ID, "id": client_id, "op": op})
                return
            channel.by_client_id[client_id] = flight
        if op == "_error":  # a rejected line, answered in its turn
            self._answer(channel, flight, request["event"])
        elif op == "ping":
            self._answer(channel, flight, {"event": "pong", "pong": True})
        elif op == "shutdown":
            channel._finished(flight)  # no answer line, as from a worker
            if self.on_shutdown_request is not None:
                self.on_shutdown_request()
        elif op == "stats":
            asyncio.ensure_future(self._stats(channel, flight))
        elif op in ("close", "reset") and session_id in self.needs_rebuild:
            # The worker that held it died: the session exists only in the mirror.
            if op == "close":
                self._forget_session(session_id)
                self._answer(channel, flight,
                             {"event": "closed", "closed": True, "session_id": session_id})
            else:
                self.mirror.clear(session_id)
                self.needs_rebuild.discard(session_id)
                self._answer(channel, flight,
                             {"event": "reset", "reset": True, "session_id": session_id})
        else:
            self._route_and_send(channel, flight, request)

    def _route_and_send(self, channel: Channel, flight: Inflight, request: dict[str, Any]) -> None:
        op, session_id = flight.op, flight.session_id
        route = route_request(op, session_id, self.placements, self._loads())
        if route.worker is None:
            self._local_error(channel, flight, route.error_code or ErrorCode.INTERNAL_ERROR,
                              route.error or "no worker", op=op)
            return
        slot = self.slots[route.worker]
        if route.new_placement:
            old = self.placements.get(session_id)
            if old is not None:
                self.slots[old].named.discard(session_id)
            self.placements[session_id] = slot.index
            slot.named.add(session_id)
            flight.new_placement = old is None
        if op == "generate" and session_id:
            flight.strip_resident = not request.get("return_resident", False)
            request["return_resident"] = True
        self._register(slot, flight)
        if session_id and session_id in self.needs_rebuild and op in ("generate", "open"):
            self._start_rebuild(slot, session_id)
        waiting = self.rebuilding.get(session_id) if session_id else None
        if waiting is not None:
            waiting.append((flight, request))
            return
        self._send(slot, flight, request)

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
            self._answer(flight.channel, flight, _cancelled_done())
            return
        flight.sent = True
        assert slot.process is not None
        slot.process.send(line)

    def _internal(self, slot: WorkerSlot, request: dict[str, Any], session_id: str,
                  then: Callable[[dict[str, Any]], None]) -> Inflight:
        flight = Inflight(None, _NO_ID, request.get("op", "generate"), session_id)
        flight.then = then
        self._register(slot, flight)
        return flight

    # ------------------------------------------------------------------ cancel

    def _client_cancel(self, channel: Channel, client_id: Any) -> None:
        flight = channel.by_client_id.get(client_id) if client_id is not _NO_ID else None
        if flight is None:
            channel.emit({"event": "error", "error": f"no request with id {client_id!r} in "
                          "flight", "code": ErrorCode.UNKNOWN_ID, "op": "cancel",
                          **({} if client_id is _NO_ID else {"id": client_id})})
            return
        self._cancel_flight(flight)

    def _cancel_flight(self, flight: Inflight) -> None:
        if flight.worker < 0:
            return  # answered locally, nothing to cancel
        slot = self.slots[flight.worker]
        if flight.iid not in slot.inflight:
            return
        if flight.sent:
            if slot.process is not None and flight.op == "generate":
                slot.process.send(orjson.dumps({"op": "cancel", "id": flight.iid}) + b"\n")
        else:
            flight.cancelled = True  # answered with a cancelled done when its turn comes
            if flight.session_id not in self.rebuilding and flight in [f for f, _ in slot.held]:
                slot.held = [(f, line) for f, line in slot.held if f is not flight]
                del slot.inflight[flight.iid]
                self._answer(flight.channel, flight, _cancelled_done())

    # ------------------------------------------------------------------ rebuild

    def _start_rebuild(self, slot: WorkerSlot, session_id: str) -> None:
        self.needs_rebuild.discard(session_id)
        resident = self.mirror.resident(session_id)
        if not resident:
            return
        self.rebuilding[session_id] = []

        def rebuilt(event: dict[str, Any]) -> None:
            waiting = self.rebuilding.pop(session_id, [])
            if event.get("event") == "done":
                for flight, request in waiting:
                    self._send(slot, flight, request)
                return
            code = event.get("code", ErrorCode.INTERNAL_ERROR)
            if code != ErrorCode.WORKER_LOST:
                log(f"rebuilding session {session_id!r} on worker {slot.index} failed: "
                    f"{event.get('error')}")
            for flight, _request in waiting:
                if slot.inflight.pop(flight.iid, None) is not None:
                    self._answer(flight.channel, flight, {
                        "event": "error", "code": code,
                        "error": f"session {session_id!r} could not be restored after a "
                                 f"worker restart: {event.get('error')}"})

        flight = self._internal(slot, rebuild_request(session_id, resident), session_id, rebuilt)
        self._send(slot, flight, rebuild_request(session_id, resident))

    def _forget_session(self, session_id: str) -> None:
        placed = self.placements.pop(session_id, None)
        if placed is not None:
            self.slots[placed].named.discard(session_id)
        self.mirror.drop(session_id)
        self.needs_rebuild.discard(session_id)

    # ------------------------------------------------------------------ worker events

    def _on_worker_lines(self, slot: WorkerSlot, lines: list[bytes]) -> None:
        """The relay hot path: one call per pipe read."""
        slot.last_heard = time.monotonic()
        inflight = slot.inflight
        loads = orjson.loads
        touched: set[Channel] = set()
        for line in lines:
            if line.startswith(_TOKEN_ID):
                # Fast path: a token line of a line-oriented client is relayed as bytes.
                comma = line.find(b",", _TOKEN_ID_LEN)
                digits = line[_TOKEN_ID_LEN:comma]
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
                    log(f"worker {slot.index} wrote a line that is not a JSON object: "
                        f"{line[:200]!r}")
                continue
            if flight is None:
                continue  # e.g. the unknown_id answer to a cancel that raced a done
            kind = event.get("event")
            if kind == "token":
                channel = flight.channel
                if channel is not None and not channel.closed:
                    if flight.client_id is _NO_ID:
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
            self._finish(slot, flight, event)
        for channel in touched:
            if channel.flush is not None and not channel.closed:
                channel.flush()

    def _finish(self, slot: WorkerSlot, flight: Inflight, event: dict[str, Any]) -> None:
        kind = event.get("event")
        session_id = flight.session_id
        if flight.op == "generate" and session_id:
            if kind == "done" and "resident_keep" in event:
                self.mirror.apply(session_id, event["resident_keep"],
                                  event.get("resident_append") or [])
            if flight.strip_resident:
                event.pop("resident_keep", None)
                event.pop("resident_append", None)
        if kind == "error" and flight.new_placement and event.get("code") in _PLACEMENT_FAILED:
            if not self.mirror.resident(session_id) and self.placements.get(session_id) == \
                    slot.index and not any(f.session_id == session_id
                                           for f in slot.inflight.values()):
                self._forget_session(session_id)
        elif kind == "closed":
            self._forget_session(session_id)
        elif kind == "reset":
            self.mirror.clear(session_id)
        elif kind == "info" and isinstance(event.get("info"), dict):
            event["info"]["workers"] = len(self.slots)
            event["info"]["supervisor_max_sessions"] = self.ready.get("max_sessions")
        self._answer(flight.channel, flight, event)

    def _fail_all(self, slot: WorkerSlot, code: str, message: str) -> None:
        """End every request of `slot` with one error each (a flight ends exactly once)."""
        slot.held = []
        for iid in list(slot.inflight):
            flight = slot.inflight.pop(iid, None)
            if flight is None:
                continue
            self._answer(flight.channel, flight, {"event": "error", "error": message,
                                                   "code": code, "op": flight.op})
        self._maybe_idle()

    def _on_worker_death(self, slot: WorkerSlot, process: WorkerProcess) -> None:
        if process is not slot.process:
            return
        status = process.returncode
        how = f"was killed by signal {-status}" if status is not None and status < 0 \
            else f"exited with status {status}"
        # Its sessions now live only in the mirror.
        for session_id in slot.named:
            self.needs_rebuild.add(session_id)
        for session_id in list(self.rebuilding):
            if self.placements.get(session_id) == slot.index:
                self.needs_rebuild.add(session_id)
        if process.stopping or self.closing:
            slot.state = WorkerState.FAILED
            self._fail_all(slot, ErrorCode.WORKER_LOST, f"worker {slot.index} {how}")
            return
        lived = time.monotonic() - (process.ready_at or process.started_at)
        slot.fast_failures = slot.fast_failures + 1 if lived < self.config.fast_failure_s else 0
        slot.state = WorkerState.STARTING
        slot.process = None
        in_flight = sum(1 for f in slot.inflight.values() if f.sent)
        log(f"worker {slot.index} (pid {process.pid}) {how}; {in_flight} request(s) lost")
        sent = {iid: f for iid, f in slot.inflight.items() if f.sent}
        for iid in sent:
            flight = slot.inflight.pop(iid, None)
            if flight is not None:
                self._answer(flight.channel, flight, {
                    "event": "error", "code": ErrorCode.WORKER_LOST, "op": flight.op,
                    "error": f"worker {slot.index} {how} while serving this request"})
        # Requests held or waiting for a rebuild were never sent: they wait for the restart,
        # but a rebuild must start over, so they are answered too.
        for session_id in list(self.rebuilding):
            if self.placements.get(session_id) == slot.index:
                for flight, _ in self.rebuilding.pop(session_id):
                    if slot.inflight.pop(flight.iid, None) is not None:
                        self._answer(flight.channel, flight, {
                            "event": "error", "code": ErrorCode.WORKER_LOST, "op": flight.op,
                            "error": f"worker {slot.index} {how} while serving this request"})
        self._maybe_idle()
        slot.restart_task = asyncio.ensure_future(self._restart(slot))

    async def _restart(self, slot: WorkerSlot) -> None:
        while not self.closing:
            if should_give_up(slot.fast_failures, self.config.max_fast_failures):
                log(f"GIVING UP on worker {slot.index}: it failed {slot.fast_failures} times in "
                    f"a row within {self.config.fast_failure_s:g}s of starting; its sessions "
                    "move to the other workers")
                slot.state = WorkerState.FAILED
                for session_id in list(slot.named):
                    self.needs_rebuild.add(session_id)
                self._fail_all(slot, ErrorCode.WORKER_LOST, f"worker {slot.index} failed")
                return
            delay = restart_delay(slot.fast_failures, self.config.restart_base_s)
            log(f"restarting worker {slot.index} in {delay:.1f}s")
            await asyncio.sleep(delay)
            if self.closing:
                return
            try:
                await self._spawn(slot)
            except WorkerStartError as exc:
                slot.fast_failures += 1
                log(str(exc))
                continue
            slot.restarts += 1
            log(f"worker {slot.index} restarted (pid {slot.process.pid if slot.process else '?'})")
            return

    # ------------------------------------------------------------------ heartbeat

    async def _heartbeat(self) -> None:
        """Ping every ready worker; kill one that stays silent past the timeout (a hung or
        SIGSTOPped process never dies by itself). Its death then runs the crash path."""
        interval = min(self.config.heartbeat_interval, self.config.heartbeat_timeout / 2)
        while not self.closing:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for slot in self.slots:
                process = slot.process
                if slot.state is not WorkerState.READY or process is None or not process.alive:
                    continue
                silent = now - slot.last_heard
                if slot.ping_sent_at is not None and silent > self.config.heartbeat_timeout:
                    log(f"worker {slot.index} (pid {process.pid}) wrote nothing for "
                        f"{silent:.1f}s with a ping out (heartbeat timeout "
                        f"{self.config.heartbeat_timeout:g}s): killing it")
                    slot.ping_sent_at = None
                    process.kill()  # SIGKILL: works on a stopped process too
                elif slot.ping_sent_at is None:
                    slot.ping_sent_at = now

                    def pong(event: dict[str, Any], slot: WorkerSlot = slot,
                             process: WorkerProcess = process) -> None:
                        if slot.process is process:
                            slot.ping_sent_at = None

                    flight = self._internal(slot, {"op": "ping"}, "", pong)
                    self._send(slot, flight, {"op": "ping"})

    # ------------------------------------------------------------------ stats

    async def _stats(self, channel: Channel, flight: Inflight) -> None:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[dict[str, Any]]] = []
        for slot in self.slots:
            future: asyncio.Future[dict[str, Any]] = loop.create_future()
            futures.append(future)
            if slot.state is WorkerState.READY and slot.process is not None:
                internal = self._internal(
                    slot, {"op": "stats"}, "",
                    lambda ev, f=future: f.done() or f.set_result(ev.get("stats") or {}))
                self._send(slot, internal, {"op": "stats"})
            else:
                future.set_result({})
        try:
            answers = await asyncio.wait_for(asyncio.gather(*futures), 10.0)
        except asyncio.TimeoutError:
            answers = [f.result() if f.done() else {} for f in futures]
        gpu = await loop.run_in_executor(None, _gpu_memory_by_pid) if any(
            s.spec.device != "cpu" for s in self.slots) else {}
        now = time.monotonic()
        workers = []
        totals = {"active_requests": 0, "queued_requests": 0, "sessions": 0, "free_slots": 0,
                  "rss_bytes": 0}
        for slot, worker_stats in zip(self.slots, answers, strict=True):
            pid = slot.process.pid if slot.process is not None and slot.process.alive else None
            rss = _rss(pid)
            entry: dict[str, Any] = {
                "index": slot.index, "state": slot.state.value, "pid": pid,
                "device": slot.spec.device, "queue_depth": len(slot.inflight),
                "named_sessions": sorted(slot.named), "restarts": slot.restarts,
                "uptime_s": round(now - slot.process.started_at, 3)
                if pid is not None and slot.process is not None else 0.0,
                "rss_bytes": rss, "worker": worker_stats,
            }
            if pid is not None and pid in gpu:
                entry["gpu_memory_bytes"] = gpu[pid]
            workers.append(entry)
            for key in ("active_requests", "queued_requests", "sessions", "free_slots"):
                value = worker_stats.get(key)
                if isinstance(value, int):
                    totals[key] += value
            totals["rss_bytes"] += rss
        stats = {**totals, "workers": workers, "supervisor": {
            "pid": os.getpid(), "rss_bytes": _rss(os.getpid()),
            "uptime_s": round(now - self.started_at, 3),
            "event_loop": "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio",
            "sessions": len(self.placements) + len(
                [s for s in self.needs_rebuild if s not in self.placements]),
        }}
        if flight.worker < 0:
            self._answer(channel, flight, {"event": "stats", "stats": stats})


def _cancelled_done() -> dict[str, Any]:
    return {"event": "done", "done": True, "prompt_tokens": 0, "completion_tokens": 0,
            "finish_reason": "cancelled", "reused_prompt_tokens": 0, "prefilled_prompt_tokens": 0,
            "session_reset_reason": "new", "prefill_ms": 0.0, "decode_ms": 0.0, "total_ms": 0.0,
            "prefill_tok_s": 0.0, "decode_tok_s": 0.0}


def _rss(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, OSError):
        return 0


def _gpu_memory_by_pid() -> dict[int, int]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run(
            [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    usage: dict[int, int] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            usage[int(parts[0])] = int(parts[1]) * 1024 * 1024
    return usage
