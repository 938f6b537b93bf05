"""`tokenpipe ray run`: the JSONL protocol on stdin/stdout, forwarded to the Ray replicas.

Like `tokenpipe run`, it prints a ready line, answers lines without an id in order and runs
requests with ids together. Each request goes to a replica through the session router. Ids are
rewritten to this front end's own (`<prefix><n>`) on the way in and back on the way out, so
several front ends can share the replicas.

It mirrors each named session's resident ids (`return_resident` on every session request, as
the supervisor does for its workers). A replica that has never seen a session it is asked for
answers `tp_need_resident`, and the request goes again with the ids, which the replica prefills
first: a session whose replica died resumes warm where it lands. A replica lost mid-request
answers that request's `worker_lost` once; one lost before anything was sent is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from protocol import MAX_LINE_BYTES, ErrorCode, ProtocolError, decode_request, line_too_long
from supervisor.lines import LineSplitter, TooLong
from supervisor.mirror import SessionMirror

from .affinity import SESSION_KEY, is_replica_lost, request_session_key
from .replica import NEED_RESIDENT, error_event

LOST = "the replica serving this request was lost"
LOST_RETRIES = 2  # a request lost before its first event goes again this many times
SESSION_OPS = ("open", "close", "reset")
LOCAL_OPS = ("info", "stats", "tokenize", "detokenize")


class Front:
    """Forwards protocol requests (dicts) to the replicas; answers go to `emit`."""

    def __init__(self, handle: Any, emit: Callable[[dict[str, Any]], None]) -> None:
        self._handle = handle
        self._stream = handle.options(stream=True)
        self._emit = emit
        self._mirror = SessionMirror()
        self._prefix = f"{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count(1)
        self._tasks: dict[Any, asyncio.Task[None]] = {}
        self._internal: dict[Any, tuple[str, str | None]] = {}  # client id -> (our id, session)
        self._ordered: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._order_task = asyncio.ensure_future(self._run_ordered())

    async def ready(self) -> dict[str, Any]:
        info = dict(await self._handle.ready_info.remote())
        for key in ("replica", "rank", "pid", "id"):
            info.pop(key, None)
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
            self._internal.pop(client_id, None)

    async def drain(self) -> None:
        """Finish everything submitted so far."""
        self._ordered.put_nowait(None)
        await self._order_task
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    async def _run_ordered(self) -> None:
        while (request := await self._ordered.get()) is not None:
            op = request.get("op", "generate")
            if op == "generate":
                await self.generate(request)
            elif op in SESSION_OPS:
                await self._session_op(request)
            elif op == "ping":
                self._emit({"event": "pong", "pong": True, **_id_of(request)})
            elif op == "shutdown":
                self._emit({"event": "shutdown", "shutdown": True, **_id_of(request)})
                return
            else:
                await self._call(request)

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
        self._internal[client_id] = (internal, session)
        resident: list[int] | None = None
        lost = 0
        try:
            while True:
                sent = False
                stream = self._stream.generate.remote(
                    request,
                    **{SESSION_KEY: session},
                    mirrored=len(self._mirror.resident(session)) if session else 0,
                    resident=resident,
                )
                try:
                    async for batch in stream:
                        if batch[0].get("event") == NEED_RESIDENT and session:
                            resident = self._mirror.resident(session)
                            break
                        sent = True
                        for event in batch:
                            self._answer(event, client_id, session, wants_resident)
                        if batch[-1].get("event") != "token":
                            return
                    else:
                        self._fail(client_id, ErrorCode.INTERNAL_ERROR, "the answer ended early")
                        return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if not is_replica_lost(exc):
                        problem = f"{type(exc).__name__}: {exc}"
                        self._fail(client_id, ErrorCode.INTERNAL_ERROR, problem)
                        return
                    if sent or lost >= LOST_RETRIES:
                        self._fail(client_id, ErrorCode.WORKER_LOST, LOST)
                        return
                    lost += 1
                    await asyncio.sleep(0.2 * lost)
        except asyncio.CancelledError:
            # A cancel of a request without a session: its stream is closed (the replica
            # cancels it in its worker), and the answer is ours.
            self._forget(client_id)
            self._emit(
                {
                    "event": "done",
                    "done": True,
                    "prompt_tokens": 0,
                    "completion_tokens": 0,
                    "finish_reason": "cancelled",
                    **_id(client_id),
                }
            )

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
        task = self._tasks.get(client_id)
        placed = self._internal.get(client_id)
        if task is None or placed is None:
            self._emit(
                error_event(
                    ErrorCode.UNKNOWN_ID,
                    f"no request {client_id!r} in flight",
                    op="cancel",
                    **_id(client_id),
                )
            )
            return
        internal, session = placed
        if session:  # the session's replica cancels it and answers its cancelled `done`
            asyncio.ensure_future(self._handle.cancel.remote(internal, **{SESSION_KEY: session}))
        else:
            task.cancel()

    async def _session_op(self, request: dict[str, Any]) -> None:
        session = str(request.get("session_id") or "")
        try:
            answer = await self._handle.session_op.remote(request, **{SESSION_KEY: session})
        except Exception as exc:
            code = ErrorCode.WORKER_LOST if is_replica_lost(exc) else ErrorCode.INTERNAL_ERROR
            answer = error_event(code, f"{type(exc).__name__}: {exc}", op=request.get("op"))
        answer.pop("id", None)  # the replica's own id for it
        if answer.get("event") != "error":
            if request.get("op") == "close":
                self._mirror.drop(session)
            elif request.get("op") == "reset":
                self._mirror.clear(session)
        self._emit({**answer, **_id_of(request)})

    async def _call(self, request: dict[str, Any]) -> None:
        try:
            answer = await self._handle.call.remote(request)
        except Exception as exc:
            code = ErrorCode.WORKER_LOST if is_replica_lost(exc) else ErrorCode.INTERNAL_ERROR
            answer = error_event(code, f"{type(exc).__name__}: {exc}", op=request.get("op"))
        answer.pop("id", None)
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

    await asyncio.to_thread(connect, address)
    front = Front(replica_handle(), _write)
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
