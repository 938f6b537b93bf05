"""The supervisor's shared state and the send and answer primitives every part uses.

`SupervisorState` is what dispatch, relay, recovery and stats work on; none of them knows the
`Supervisor` (core.py), which composes them. It owns:
- the worker slots (`WorkerSlot`: one per worker index, across restarts) and their requests;
- the named sessions' placements, mirror and rebuild bookkeeping;
- `send`: a request to a worker, as one line, or an answer of its own when the line would be
  longer than the worker accepts; `answer`: a flight's terminal event to its client.

Invariants: a flight is in at most one slot's `inflight`, under its current `iid`; it leaves
it exactly when it is answered (or taken out to be re-run); `answer` is called once per flight.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol.codec import MAX_LINE_BYTES
from protocol.errors import ErrorCode
from supervisor.config import SupervisorConfig
from supervisor.flight import NO_ID, ClientSink, Inflight, cancelled_done, error_event
from supervisor.mirror import SessionMirror
from supervisor.pool import StderrSink, WorkerProcess, WorkerSpec, default_stderr_sink
from supervisor.router import WorkerLoad, WorkerState

_ENCODER = msgspec.json.Encoder()


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

    @property
    def max_line_bytes(self) -> int:
        """The longest line this worker accepts (its ready line says; 1 MiB if it does not)."""
        announced = self.ready_info.get("max_line_bytes")
        return announced if isinstance(announced, int) and announced > 0 else MAX_LINE_BYTES


class SupervisorState:
    def __init__(self, config: SupervisorConfig, stderr_sink: StderrSink | None = None) -> None:
        self.config = config
        self.stderr_sink = stderr_sink or default_stderr_sink
        self.slots: list[WorkerSlot] = []
        self.placements: dict[str, int] = {}  # named session -> worker index
        self.mirror = SessionMirror()
        self.needs_rebuild: set[str] = set()  # sessions whose worker died: only in the mirror
        # session -> requests waiting for its rebuild (each already registered on the slot)
        self.rebuilding: dict[str, list[tuple[Inflight, dict[str, Any]]]] = {}
        self.channels: list[Any] = []  # the open client channels (dispatch.Channel)
        self.ready: dict[str, Any] = {}
        self.closing = False  # aclose started: new requests are refused
        self.accepting = True  # False once a shutdown request took effect
        self.started_at = time.monotonic()
        self.on_shutdown_request: Callable[[], None] | None = None
        self._ids = itertools.count(1)
        self.idle_event = asyncio.Event()

    # ------------------------------------------------------------------ idleness

    @property
    def busy(self) -> bool:
        return any(slot.inflight for slot in self.slots) or not all(c.idle for c in self.channels)

    def maybe_idle(self) -> None:
        if not self.busy:
            self.idle_event.set()

    # ------------------------------------------------------------------ send and answer

    def loads(self) -> list[WorkerLoad]:
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

    def answer(self, channel: ClientSink | None, flight: Inflight, event: dict[str, Any]) -> None:
        """Deliver a terminal answer of `flight` to its client (or its internal callback)."""
        if flight.then is not None:
            flight.then(event)
            self.maybe_idle()  # an internal request (ping, stats, rebuild) may be the last
            return
        if channel is None:
            return
        if flight.client_id is NO_ID:
            event.pop("id", None)
        else:
            event["id"] = flight.client_id
        if not channel.closed:
            channel.emit(event)
        channel.finished(flight)

    def register(self, slot: WorkerSlot, flight: Inflight) -> None:
        flight.iid = next(self._ids)
        flight.worker = slot.index
        slot.inflight[flight.iid] = flight

    def send(self, slot: WorkerSlot, flight: Inflight, request: dict[str, Any]) -> None:
        """Send (or hold until the worker is ready) a registered flight's request. The line
        starts with the internal id, so even a worker that cannot decode it can name it."""
        request.pop("id", None)
        try:
            # msgspec writes whatever its decoder read (orjson stops at 255 levels of nesting)
            line = _ENCODER.encode({"id": flight.iid, **request}) + b"\n"
        except (TypeError, ValueError, msgspec.EncodeError) as exc:  # an in-process caller's
            del slot.inflight[flight.iid]
            self.answer(
                flight.channel,
                flight,
                error_event(ErrorCode.INVALID_REQUEST, f"cannot encode the request: {exc}"),
            )
            return
        limit = slot.max_line_bytes
        if len(line) - 1 > limit:
            # Re-encoding can lengthen a line (e.g. floats written in full): refuse it here,
            # with the client's id, rather than send what the worker would refuse.
            del slot.inflight[flight.iid]
            self.answer(
                flight.channel,
                flight,
                error_event(
                    ErrorCode.LINE_TOO_LONG,
                    f"the request is {len(line) - 1} bytes as sent to a worker, "
                    f"the limit is {limit} bytes",
                    op=flight.op,
                ),
            )
            return
        if slot.state is WorkerState.READY and slot.process is not None:
            self.write(slot, flight, line)
        else:
            slot.held.append((flight, line))

    def write(self, slot: WorkerSlot, flight: Inflight, line: bytes) -> None:
        if flight.iid not in slot.inflight:
            return  # answered meanwhile (e.g. cancelled while held)
        if flight.cancelled:
            del slot.inflight[flight.iid]
            self.answer(flight.channel, flight, cancelled_done())
            return
        flight.sent = True
        assert slot.process is not None
        slot.process.send(line)

    def internal(
        self,
        slot: WorkerSlot,
        request: dict[str, Any],
        session_id: str,
        then: Callable[[dict[str, Any]], None],
    ) -> Inflight:
        """Register a request of the supervisor's own (`then` gets its terminal event)."""
        flight = Inflight(None, NO_ID, request.get("op", "generate"), session_id)
        flight.then = then
        self.register(slot, flight)
        return flight
