"""`tokenpipe ray run`: the JSONL protocol on stdin/stdout, forwarded to the Ray replicas.

Like `tokenpipe run`, it prints a ready line, answers lines without an id in order and runs
requests with ids together. Each request goes straight to its replica's JSONL port
(endpoints.py) over one long-lived connection per replica (links.py), the replica chosen by the
session rules of the Serve router (directory.py; Serve's controller supplies the live replicas
and their ports). Ids are rewritten to this front end's own (`<prefix><n>`) on the way in and
back on the way out, so several front ends can share the replicas.

It mirrors each named session's resident ids (`return_resident` on every session request, as
the supervisor does for its workers). A replica that has never seen a session it is asked for
answers `tp_need_resident`, and the request goes again with the ids, which the replica prefills
first: a session whose replica died resumes warm where it lands. A replica lost mid-request
(its connection breaks) answers that request's `worker_lost` once and is routed around until
Ray's replacement is listed; a request lost before anything came back is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from protocol import MAX_LINE_BYTES, ErrorCode, ProtocolError, decode_request, line_too_long
from supervisor.lines import LineSplitter, TooLong
from supervisor.mirror import SessionMirror

from .affinity import request_session_key
from .directory import Directory, Endpoint
from .endpoints import NEED_RESIDENT, error_event
from .links import LOST, Link, Links

LOST_MESSAGE = "the replica serving this request was lost"
NO_REPLICA = "no replica is reachable"
LOST_RETRIES = 2  # a request lost before its first event goes again this many times
LIVE_WAIT_S = 30.0  # how long a request waits for a live replica (Ray replaces lost ones)
READY_WAIT_S = 120.0
SESSION_OPS = ("open", "close", "reset")


class Front:
    """Forwards protocol requests (dicts) straight to the replicas' JSONL ports; answers go
    to `emit`. `handle`: a Serve handle on the replicas (the ready line, and the router whose
    replica list feeds `directory`)."""

    def __init__(
        self, handle: Any, emit: Callable[[dict[str, Any]], None], directory: Directory
    ) -> None:
        self._handle = handle
        self._emit = emit
        self._directory = directory
        self._links = Links(directory)
        self._mirror = SessionMirror()
        self._prefix = f"{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count(1)
        self._tasks: dict[Any, asyncio.Task[None]] = {}
        self._placed: dict[Any, tuple[str, Link]] = {}  # client id -> (our id, its link)
        self._ordered: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._order_task = asyncio.ensure_future(self._run_ordered())

    async def ready(self) -> dict[str, Any]:
        """The ready line (one Serve call: it also starts the router that fills the
        directory), once some replica's endpoint is known."""
        info = dict(await self._handle.ready_info.remote())
        for key in ("replica", "rank", "pid", "id", "http_forwarded"):
            info.pop(key, None)
        await self._live(None, READY_WAIT_S)
        return {**info, "event": "ready", "ray": True}

    # -- intake

    def submit(self, request: dict[str, Any]) -> None:
        op = request.get("op", "generate")
        rid = request.get("id")
        if op == "cancel":
            self._cancel(rid)
        elif rid is None or op != "generate":
            self._ordered.put_nowait(request)
        elif rid in self._tasks:
            self._emit(
                error_event(ErrorCode.DUPLICATE_ID, f"id {rid!r} is already in flight", id=rid)
            )
        else:
            task = asyncio.ensure_future(self.generate(request))
            self._tasks[rid] = task
            task.add_done_callback(lambda _: self._forget(rid, task))

    def _forget(self, client_id: Any, task: asyncio.Task[None] | None = None) -> None:
        """The request's id is free again (before its last line goes out: the client may
        reuse the id as soon as it reads that line)."""
        if task is None or self._tasks.get(client_id) is task:
            self._tasks.pop(client_id, None)
            self._placed.pop(client_id, None)

    async def drain(self) -> None:
        """Finish everything submitted so far."""
        self._ordered.put_nowait(None)
        await self._order_task
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)
        self._links.close()

    async def _run_ordered(self) -> None:
        while (request := await self._ordered.get()) is not None:
            op = request.get("op", "generate")
            if op == "generate":
                await self.generate(request)
            elif op == "ping":
                self._emit({"event": "pong", "pong": True, **_id_of(request)})
            elif op == "shutdown":
                self._emit({"event": "shutdown", "shutdown": True, **_id_of(request)})
                return
            else:
                await self._single(request)

    # -- placing requests

    async def _live(self, session: str | None, wait_s: float = LIVE_WAIT_S) -> Endpoint | None:
        """The replica for `session` (None: the least loaded), waiting a little while none is
        live (all were lost and Ray is replacing them)."""
        deadline = time.monotonic() + wait_s
        while (endpoint := self._directory.pick(session)) is None:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)
        return endpoint

    async def _call(
        self, session: str | None, envelope: dict[str, Any]
    ) -> tuple[Link, asyncio.Queue[dict[str, Any]]] | None:
        """Send `envelope` to the replica for `session`; None when no replica can be reached
        (after waiting for one)."""
        for attempt in range(LOST_RETRIES + 1):
            endpoint = await self._live(session)
            if endpoint is None:
                return None
            try:
                link = await self._links.get(endpoint)
            except OSError:
                await asyncio.sleep(0.1 * attempt)
                continue
            return link, link.send(envelope)
        return None

    # -- requests

    async def generate(self, request: dict[str, Any]) -> None:
        request = dict(request)
        client_id = request.get("id")
        session = request_session_key(request)
        internal = f"{self._prefix}{next(self._ids)}"
        request["id"] = internal
        wants_resident = bool(request.get("return_resident"))
        if session:
            request["return_resident"] = True
        resident: list[int] | None = None
        lost = 0
        while True:
            envelope = {
                "call": "generate",
                "id": internal,
                "request": request,
                "mirrored": len(self._mirror.resident(session)) if session else 0,
                "resident": resident,
            }
            placed = await self._call(session, envelope)
            if placed is None:
                self._fail(client_id, ErrorCode.WORKER_LOST, NO_REPLICA)
                return
            link, queue = placed
            self._placed[client_id] = (internal, link)
            self._directory.started(link.endpoint)
            sent = False
            try:
                while True:
                    event = await queue.get()
                    kind = event.get("event")
                    if kind == NEED_RESIDENT and session:
                        resident = self._mirror.resident(session)
                        break
                    if event is LOST:
                        if sent or lost >= LOST_RETRIES:
                            self._fail(client_id, ErrorCode.WORKER_LOST, LOST_MESSAGE)
                            return
                        lost += 1
                        await asyncio.sleep(0.2 * lost)
                        break
                    sent = True
                    self._answer(event, client_id, session, wants_resident)
                    if kind != "token":
                        return
            finally:
                link.forget(internal)
                self._directory.finished(link.endpoint)

    def _fail(self, client_id: Any, code: str, message: str) -> None:
        self._forget(client_id)
        self._emit(error_event(code, message, **_id(client_id)))

    def _answer(
        self, event: dict[str, Any], client_id: Any, session: str | None, wants_resident: bool
    ) -> None:
        if event.get("event") == "done" and session and "resident_keep" in event:
            self._mirror.apply(session, event["resident_keep"], event.get("resident_append") or [])
            if not wants_resident:
                event.pop("resident_keep", None)
                event.pop("resident_append", None)
        if client_id is None:
            event.pop("id", None)
        else:
            event["id"] = client_id
            if event.get("event") != "token":
                self._forget(client_id)
        self._emit(event)

    def _cancel(self, client_id: Any) -> None:
        placed = self._placed.get(client_id)
        if client_id not in self._tasks or placed is None:
            self._emit(
                error_event(
                    ErrorCode.UNKNOWN_ID,
                    f"no request {client_id!r} in flight",
                    op="cancel",
                    **_id(client_id),
                )
            )
            return
        internal, link = placed
        link.cancel(internal)  # the replica answers its cancelled `done`

    async def _single(self, request: dict[str, Any]) -> None:
        """A request with one answer: a session op (to the session's replica) or a call
        (`info`, `stats`, `tokenize`, `detokenize`: to the least-loaded replica)."""
        op = request.get("op")
        session = str(request.get("session_id") or "") if op in SESSION_OPS else None
        internal = f"{self._prefix}{next(self._ids)}"
        envelope: dict[str, Any] = {
            "call": "session_op" if session is not None else "call",
            "id": internal,
            "request": {**request, "id": internal},
        }
        placed = await self._call(session, envelope)
        if placed is None:
            answer = error_event(ErrorCode.WORKER_LOST, NO_REPLICA, op=op)
        else:
            link, queue = placed
            self._directory.started(link.endpoint)
            try:
                answer = await queue.get()
            finally:
                link.forget(internal)
                self._directory.finished(link.endpoint)
            if answer is LOST:
                answer = error_event(ErrorCode.WORKER_LOST, LOST_MESSAGE, op=op)
        answer.pop("id", None)  # ours
        if session is not None and answer.get("event") != "error":
            if op == "close":
                self._mirror.drop(session)
            elif op == "reset":
                self._mirror.clear(session)
        self._emit({**answer, **_id_of(request)})


def _id(client_id: Any) -> dict[str, Any]:
    return {} if client_id is None else {"id": client_id}


def _id_of(request: dict[str, Any]) -> dict[str, Any]:
    return _id(request.get("id"))


# -- the stdio process


def _decode(line: bytes | TooLong) -> dict[str, Any] | None:
    if isinstance(line, TooLong):
        decoded: Any = line_too_long(line.prefix, None, MAX_LINE_BYTES)
    elif not line.strip():
        return None
    else:
        decoded = decode_request(line.removesuffix(b"\r"), MAX_LINE_BYTES)
    if isinstance(decoded, ProtocolError):
        event = msgspec.to_builtins(decoded.to_event())
        event["event"] = "error"
        return {"op": "_error", "event": event}
    out = msgspec.to_builtins(decoded)
    assert isinstance(out, dict)
    return out


def _write(event: dict[str, Any]) -> None:
    sys.stdout.buffer.write(orjson.dumps(event) + b"\n")
    sys.stdout.buffer.flush()


async def serve_stdio(address: str) -> None:
    """Connect to the cluster at `address`, then serve stdin until EOF or `shutdown`."""
    from .app import connect, replica_handle
    from .router import publish_to

    await asyncio.to_thread(connect, address)
    directory = Directory()
    publish_to(directory)
    front = Front(replica_handle(), _write, directory)
    _write(await front.ready())
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes] = asyncio.Queue()

    def read() -> None:
        while True:
            data = os.read(sys.stdin.fileno(), 1 << 16)
            loop.call_soon_threadsafe(chunks.put_nowait, data)
            if not data:
                return

    threading.Thread(target=read, name="stdin", daemon=True).start()
    splitter = LineSplitter(MAX_LINE_BYTES)
    while data := await chunks.get():
        for line in splitter.feed(data):
            request = _decode(line)
            if request is None:
                continue
            if request.get("op") == "_error":
                _write(request["event"])
            else:
                front.submit(request)
                if request.get("op") == "shutdown":
                    break
        else:
            continue
        break
    with contextlib.suppress(Exception):
        await front.drain()
