"""The Python client API: talk to a supervisor in this process, in a child process, or over a
unix socket. The OpenAI server, the shell commands and the tests all use it.

```python
client = await AsyncClient.spawn(["--workers", "2"])          # `tokenpipe run` subprocess
client = await AsyncClient.in_process(SupervisorConfig(...))  # supervisor in this event loop
client = await AsyncClient.connect("/tmp/tp.sock")            # `tokenpipe run --listen`
async for event in client.generate(GenerateRequest(prompt="Hi", max_new_tokens=8)):
    ...  # TokenEvent..., then exactly one DoneEvent | ErrorEvent; leaving early cancels
await client.aclose()
```

`Client` is the blocking twin (an event loop in a background thread), with the same methods;
its `generate` returns a plain iterator.

Every request gets an id (the caller's, or a fresh `"tp-N"`), so any number may be in flight
at once. Single-answer calls (`info`, `open_session`, ...) raise `TokenpipeError` when the
answer is an error line.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import msgspec
import orjson

from protocol import ErrorCode, Event, GenerateRequest, ReadyEvent
from supervisor.core import Supervisor, SupervisorConfig
from supervisor.dispatch import Channel

T = TypeVar("T")
Submit = Callable[[dict[str, Any]], None]


class TokenpipeError(RuntimeError):
    """An `error` answer to a single-answer request."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def run_command() -> list[str]:
    """argv prefix of `tokenpipe` with this interpreter (no console script needed)."""
    code = "import sys; sys.argv[0] = 'tokenpipe'; from supervisor.cli import main; main()"
    return [sys.executable, "-c", code]


def _to_event(raw: dict[str, Any]) -> Event:
    return msgspec.convert(raw, Event)  # type: ignore[arg-type]


def _request_dict(request: Any) -> dict[str, Any]:
    if isinstance(request, dict):
        return dict(request)
    out = msgspec.to_builtins(request)
    assert isinstance(out, dict)
    return out


class AsyncClient:
    """Asyncio client. Build it with `spawn`, `in_process` or `connect`."""

    def __init__(self) -> None:
        self.ready: ReadyEvent
        self.ready_info: dict[str, Any] = {}  # the ready line as sent (incl. worker_capacity)
        self._submit: Submit = _closed_submit
        self._queues: dict[Any, asyncio.Queue[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._closer: Callable[[], Awaitable[None]] | None = None
        self._closed = False
        self.supervisor: Supervisor | None = None  # in-process only
        self.process: asyncio.subprocess.Process | None = None  # spawn only

    # ------------------------------------------------------------------ constructors

    @classmethod
    async def in_process(
        cls, config: SupervisorConfig, stderr_sink: Callable[[bytes], None] | None = None
    ) -> AsyncClient:
        """Start a supervisor (and its workers) inside this event loop."""
        self = cls()
        supervisor = Supervisor(config, stderr_sink=stderr_sink)
        ready = await supervisor.start()
        channel: Channel = supervisor.open_channel(self._on_event)
        self.supervisor = supervisor
        self._set_ready(ready)
        self._submit = channel.submit

        async def close() -> None:
            await supervisor.aclose(config.drain_timeout)

        self._closer = close
        return self

    @classmethod
    async def spawn(
        cls,
        args: Sequence[str] = (),
        *,
        command: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        stderr: Any = None,
        ready_timeout: float = 600.0,
    ) -> AsyncClient:
        """Start `tokenpipe run ARGS...` as a child process and talk JSONL over its pipes."""
        self = cls()
        argv = list(command) if command is not None else [*run_command(), "run"]
        process = await asyncio.create_subprocess_exec(
            *argv,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env={**os.environ, **(env or {})},
            limit=1 << 24,
        )
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        try:
            line = await asyncio.wait_for(process.stdout.readline(), ready_timeout)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
            raise TokenpipeError(
                ErrorCode.INTERNAL_ERROR, "no ready line from tokenpipe run"
            ) from None
        if not line:
            status = await process.wait()
            raise TokenpipeError(
                ErrorCode.INTERNAL_ERROR, f"tokenpipe run exited with status {status} before ready"
            )
        self._set_ready(orjson.loads(line))
        stdin = process.stdin
        self._submit = lambda req: stdin.write(orjson.dumps(req) + b"\n")
        reader = asyncio.ensure_future(self._read_loop(process.stdout))

        async def close() -> None:
            with contextlib.suppress(Exception):
                stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 60)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
            await reader

        self._closer = close
        return self

    @classmethod
    async def connect(cls, socket_path: str) -> AsyncClient:
        """Talk to a running `tokenpipe run --listen SOCKET`."""
        self = cls()
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=1 << 24)
        line = await reader.readline()
        if not line:
            raise TokenpipeError(ErrorCode.INTERNAL_ERROR, f"{socket_path}: no ready line")
        self._set_ready(orjson.loads(line))
        self._submit = lambda req: writer.write(orjson.dumps(req) + b"\n")
        read_task = asyncio.ensure_future(self._read_loop(reader))

        async def close() -> None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await read_task

        self._closer = close
        return self

    def _set_ready(self, ready: dict[str, Any]) -> None:
        self.ready_info = ready
        self.ready = msgspec.convert(ready, ReadyEvent)

    async def _read_loop(self, stream: asyncio.StreamReader) -> None:
        try:
            while True:
                line = await stream.readline()
                if not line:
                    break
                if line.strip():
                    self._on_event(orjson.loads(line))
        finally:
            for rid, queue in list(self._queues.items()):
                queue.put_nowait(
                    {
                        "event": "error",
                        "id": rid,
                        "code": ErrorCode.INTERNAL_ERROR,
                        "error": "the supervisor connection closed",
                    }
                )

    def _on_event(self, event: dict[str, Any]) -> None:
        queue = self._queues.get(event.get("id"))
        if queue is not None:
            queue.put_nowait(event)

    def _new_id(self) -> str:
        return f"tp-{next(self._ids)}"

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest | dict[str, Any]) -> AsyncIterator[Event]:
        """Stream a generate request's events: TokenEvent..., then DoneEvent | ErrorEvent.
        Leaving the loop before the end cancels the request."""
        async with contextlib.aclosing(self.generate_batches(request)) as batches:
            async for batch in batches:
                for raw in batch:
                    yield _to_event(raw)

    async def generate_batches(
        self, request: GenerateRequest | dict[str, Any]
    ) -> AsyncGenerator[list[dict[str, Any]], None]:
        """`generate`'s answer lines as plain dicts (as on the wire), in batches: each batch
        is every line already in when it is taken, so a caller in another process (a Ray
        replica's) pays one message per batch, not per token. The last batch ends with the
        `done` or `error`. Leaving the loop before the end cancels the request."""
        req = _request_dict(request)
        req.pop("op", None)
        if req.get("id") is None:
            req["id"] = self._new_id()
        rid = req["id"]
        if rid in self._queues:
            message = f"id {rid!r} is already in flight"
            yield [{"event": "error", "error": message, "code": ErrorCode.DUPLICATE_ID, "id": rid}]
            return
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            self._submit(req)
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                finished = batch[-1].get("event") != "token"
                yield batch
        finally:
            self._queues.pop(rid, None)
            if not finished and not self._closed:
                with contextlib.suppress(Exception):
                    self._submit({"op": "cancel", "id": rid})

    async def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one single-answer request (`op` set); return its answer line as a dict."""
        req = dict(request)
        if req.get("id") is None:
            req["id"] = self._new_id()
        rid = req["id"]
        if rid in self._queues:
            raise TokenpipeError(ErrorCode.DUPLICATE_ID, f"id {rid!r} is already in flight")
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[rid] = queue
        try:
            self._submit(req)
            answer = await queue.get()
        finally:
            self._queues.pop(rid, None)
        if answer.get("event") == "error":
            raise TokenpipeError(
                answer.get("code", ErrorCode.INTERNAL_ERROR), answer.get("error", "")
            )
        return answer

    async def cancel(self, request_id: str | int) -> None:
        """Cancel an in-flight request; its stream ends with `finish_reason: "cancelled"`."""
        self._submit({"op": "cancel", "id": request_id})

    async def open_session(self, session_id: str) -> None:
        await self.request({"op": "open", "session_id": session_id})

    async def close_session(self, session_id: str) -> None:
        await self.request({"op": "close", "session_id": session_id})

    async def reset_session(self, session_id: str) -> None:
        await self.request({"op": "reset", "session_id": session_id})

    async def ping(self) -> None:
        await self.request({"op": "ping"})

    async def info(self) -> dict[str, Any]:
        return dict((await self.request({"op": "info"}))["info"])

    async def stats(self) -> dict[str, Any]:
        return dict((await self.request({"op": "stats"}))["stats"])

    async def tokenize(self, text: str, add_prefix: bool = False) -> list[int]:
        answer = await self.request({"op": "tokenize", "text": text, "add_prefix": add_prefix})
        return list(answer["tokens"])

    async def detokenize(self, ids: Sequence[int]) -> str:
        return str((await self.request({"op": "detokenize", "ids": list(ids)}))["text"])

    async def aclose(self) -> None:
        """Finish what is in flight and stop the supervisor (or disconnect). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._closer is not None:
            await self._closer()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _closed_submit(request: dict[str, Any]) -> None:
    raise TokenpipeError(ErrorCode.SHUTTING_DOWN, "the client is not connected")


class Client:
    """The blocking twin of `AsyncClient`: same methods, run on a private event loop thread.

    `Client()` spawns `tokenpipe run` (args from `spawn_args`); `Client(config=...)` runs the
    supervisor in process (on the client's thread; `stderr_sink` receives the workers' log
    bytes, default: this process's stderr); `Client(connect=PATH)` attaches to a
    running `tokenpipe run --listen PATH`.
    """

    def __init__(
        self,
        spawn_args: Sequence[str] | None = None,
        *,
        config: SupervisorConfig | None = None,
        connect: str | None = None,
        stderr_sink: Callable[[bytes], None] | None = None,
        **spawn_kwargs: Any,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tokenpipe-client", daemon=True
        )
        self._thread.start()
        try:
            if connect is not None:
                self._client = self._run(AsyncClient.connect(connect))
            elif config is not None:
                self._client = self._run(AsyncClient.in_process(config, stderr_sink))
            else:
                self._client = self._run(AsyncClient.spawn(spawn_args or (), **spawn_kwargs))
        except BaseException:
            self._stop_loop()
            raise
        self.ready = self._client.ready
        self.ready_info = self._client.ready_info

    @classmethod
    def spawn(cls, args: Sequence[str] = (), **kwargs: Any) -> Client:
        return cls(args, **kwargs)

    @classmethod
    def in_process(cls, config: SupervisorConfig) -> Client:
        return cls(config=config)

    @classmethod
    def connect(cls, socket_path: str) -> Client:
        return cls(connect=socket_path)

    def _run(self, coroutine: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()  # type: ignore[arg-type]

    def generate(self, request: GenerateRequest | dict[str, Any]) -> Iterator[Event]:
        agen = self._client.generate(request)
        try:
            while True:
                try:
                    event = self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield event
        finally:
            self._run(agen.aclose())

    def request(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._run(self._client.request(request))

    def cancel(self, request_id: str | int) -> None:
        self._run(self._client.cancel(request_id))

    def open_session(self, session_id: str) -> None:
        self._run(self._client.open_session(session_id))

    def close_session(self, session_id: str) -> None:
        self._run(self._client.close_session(session_id))

    def reset_session(self, session_id: str) -> None:
        self._run(self._client.reset_session(session_id))

    def ping(self) -> None:
        self._run(self._client.ping())

    def info(self) -> dict[str, Any]:
        return self._run(self._client.info())

    def stats(self) -> dict[str, Any]:
        return self._run(self._client.stats())

    def tokenize(self, text: str, add_prefix: bool = False) -> list[int]:
        return self._run(self._client.tokenize(text, add_prefix))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._run(self._client.detokenize(ids))

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._run(self._client.aclose())
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
