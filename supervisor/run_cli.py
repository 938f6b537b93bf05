"""`tokenpipe run`: the supervisor serving JSONL on its own stdin/stdout (and, with `--listen`,
on a unix socket).

stdout carries protocol lines only: first the supervisor's ready line, then the answers.
Everything else (worker stderr, prefixed `[worker N]`, and the supervisor's own messages) goes
to stderr.

Shutdown: EOF on stdin (or a `shutdown` request) finishes what is in flight, stops the
workers, exits 0. SIGTERM / the first SIGINT do the same within `--drain-timeout` seconds,
then cancel what is left. A second SIGINT exits at once (workers are SIGKILLed).
Nobody left to answer: a closed stdout (EPIPE), or the death of the parent process when stdin
is a pipe (checked every `PARENT_CHECK_S`, also during an EOF drain), cancels everything at
once and exits.
With `--listen`, stdin is not read: the supervisor runs until a signal or a `shutdown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any

import click
import msgspec
import orjson

from protocol import MAX_LINE_BYTES, ProtocolError, decode_request, line_too_long
from supervisor import eventloop
from supervisor.core import Supervisor, SupervisorConfig
from supervisor.dispatch import Channel, cancel_flight
from supervisor.lines import LineSplitter, TooLong
from supervisor.pool import WorkerStartError, log

READ_SIZE = 1 << 16  # bytes per read of stdin or a connection
PARENT_CHECK_S = 0.2  # how often the stdio mode checks that its parent process is alive


class LineWriter:
    """Batches answer lines and writes them once per event-loop turn (blocking write: a slow
    reader slows the supervisor down instead of growing a buffer without bound)."""

    def __init__(self, write: Callable[[bytes], None], on_broken: Callable[[], None]) -> None:
        self._write = write
        self._on_broken = on_broken
        self._lines: list[bytes] = []
        self._scheduled = False
        self.broken = False
        self._loop = asyncio.get_running_loop()

    def emit(self, event: dict[str, Any]) -> None:
        self._lines.append(orjson.dumps(event))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def emit_line(self, line: bytes) -> None:
        """A relayed token line; the relay calls `flush()` after each batch (no loop turn)."""
        self._lines.append(line)

    def flush(self) -> None:
        self._scheduled = False
        if not self._lines:
            return
        data = b"\n".join(self._lines) + b"\n"
        self._lines = []
        if self.broken:
            return
        try:
            self._write(data)
        except (BrokenPipeError, ConnectionError, ValueError, OSError):
            self.broken = True
            self._on_broken()


def _stdout_write(data: bytes) -> None:
    out = sys.stdout.buffer
    out.write(data)
    out.flush()


def feed_line(channel: Channel, line: bytes | TooLong) -> None:
    """Decode one request line and hand it to the channel (errors keep their place)."""
    if isinstance(line, TooLong):
        decoded: Any = line_too_long(line.prefix, None, MAX_LINE_BYTES)
    elif not line.strip():
        return
    else:
        if line.endswith(b"\r"):
            line = line[:-1]  # a "\r\n" line end
        decoded = decode_request(line, MAX_LINE_BYTES)
    if isinstance(decoded, ProtocolError):
        event = msgspec.to_builtins(decoded.to_event())
        event["event"] = "error"
        channel.submit_error(event)
        return
    channel.submit(msgspec.to_builtins(decoded))


def _read_stdin_thread(loop: asyncio.AbstractEventLoop, on_data: Callable[[bytes], None]) -> None:
    fd = sys.stdin.fileno()
    while True:
        try:
            data = os.read(fd, READ_SIZE)
        except OSError:
            data = b""
        loop.call_soon_threadsafe(on_data, data)
        if not data:
            return


def _stdin_is_pipe() -> bool:
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


async def _watch_parent(parent: int, on_death: Callable[[], None]) -> None:
    """`on_death()` once this process's parent is gone (it is re-parented: the pid changes)."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)
    on_death()


async def serve(config: SupervisorConfig, listen: str | None = None) -> int:
    supervisor = Supervisor(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    drain_deadline: list[float | None] = [None]  # None: EOF, wait for everything

    def graceful(deadline: float | None) -> None:
        if not stop.is_set():
            drain_deadline[0] = deadline
            stop.set()

    def cancel_everything(reason: str) -> None:
        """Nobody reads the answers any more: cancel all in-flight work now, then exit."""
        log(f"{reason}: cancelling everything")
        drain_deadline[0] = 0.0
        stop.set()
        for slot in supervisor.state.slots:  # also cuts short a drain already under way
            for flight in list(slot.inflight.values()):
                cancel_flight(supervisor.state, flight)

    sigint_count = [0]

    def on_sigint() -> None:
        sigint_count[0] += 1
        if sigint_count[0] >= 2:
            log("second SIGINT: exiting now")
            supervisor.kill_workers()
            os._exit(130)
        log("SIGINT: finishing in-flight requests (press Ctrl-C again to exit at once)")
        graceful(config.drain_timeout)

    loop.add_signal_handler(signal.SIGTERM, lambda: graceful(config.drain_timeout))
    loop.add_signal_handler(signal.SIGINT, on_sigint)

    start = asyncio.ensure_future(supervisor.start())
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait([start, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # a signal during start-up
        start.cancel()
        with contextlib.suppress(BaseException):
            await start
        await supervisor.aclose(0)
        return 1
    stop_wait.cancel()
    try:
        ready = start.result()
    except (WorkerStartError, ValueError) as exc:
        log(f"cannot start: {exc}")
        return 1

    writer = LineWriter(_stdout_write, lambda: cancel_everything("stdout closed"))
    writer.emit(ready)
    writer.flush()
    supervisor.on_shutdown_request = lambda: graceful(None)
    server = None
    watcher: asyncio.Future[None] | None = None
    if listen is None:
        channel = supervisor.open_channel(writer.emit, writer.emit_line, writer.flush)
        splitter = LineSplitter(MAX_LINE_BYTES)

        def on_data(data: bytes) -> None:
            if not data:
                last = splitter.finish()
                if last is not None:
                    feed_line(channel, last)
                graceful(None)
                return
            for line in splitter.feed(data):
                feed_line(channel, line)

        threading.Thread(target=_read_stdin_thread, args=(loop, on_data), daemon=True).start()
        parent = os.getppid()
        if parent != 1 and _stdin_is_pipe():  # a program (pi, a script) talks to us: stop
            # when it dies (a `nohup tokenpipe run < file &` is left alone)
            watcher = asyncio.ensure_future(
                _watch_parent(parent, lambda: cancel_everything("parent process exited"))
            )
    else:
        server = await _listen(supervisor, listen, ready)
        log(f"listening on {listen}")
    await stop.wait()
    if server is not None:
        server.close()
    await supervisor.aclose(drain_deadline[0])  # the watcher may still cut a drain short
    if watcher is not None:
        watcher.cancel()
    writer.flush()
    if listen is not None:
        with contextlib.suppress(OSError):
            os.unlink(listen)
    return 0


async def _listen(supervisor: Supervisor, path: str, ready: dict[str, Any]) -> asyncio.Server:
    """Serve the same protocol on a unix socket: a ready line per connection, then answers."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def emit(event: dict[str, Any]) -> None:
            if not writer.is_closing():
                writer.write(orjson.dumps(event) + b"\n")

        def emit_line(line: bytes) -> None:
            if not writer.is_closing():
                writer.write(line + b"\n")

        emit(ready)
        channel = supervisor.open_channel(emit, emit_line)
        splitter = LineSplitter(MAX_LINE_BYTES)
        try:
            while True:
                try:
                    data = await reader.read(READ_SIZE)
                except ConnectionError:
                    break
                if not data:
                    last = splitter.finish()
                    if last is not None:
                        feed_line(channel, last)
                    break
                for line in splitter.feed(data):
                    feed_line(channel, line)
            # The client closed its side: let its requests finish, then hang up.
            while not channel.idle:
                await asyncio.sleep(0.05)
        finally:
            supervisor.close_channel(channel)
            writer.close()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return await asyncio.start_unix_server(connection, path=path, limit=READ_SIZE)


@click.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": ["-h", "--help"],
    }
)
@click.option(
    "--model",
    "--model_path",
    "model",
    default=None,
    help="HF checkpoint dir or .gguf file (default: the packaged Gemma 3 270M).",
)
@click.option(
    "--gpus",
    default="all",
    show_default=True,
    help="GPUs to run one worker each on: all, none, or a list like 0,2.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Run N CPU workers instead (wins over --gpus).",
)
@click.option(
    "--tensor-parallel",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Ranks per worker: each worker is a group of N processes (N GPUs each on CUDA: "
    "--gpus 0..7 with 2 gives 4 workers).",
)
@click.option(
    "--max-sessions",
    type=click.IntRange(min=1),
    default=None,
    help="Sessions per worker, the scratch session included.",
)
@click.option(
    "--max-context", type=click.IntRange(min=1), default=None, help="Context length per session."
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Requests per worker in flight or waiting; beyond it: `overloaded`.",
)
@click.option(
    "--ready-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds to wait for each worker's ready line.",
)
@click.option(
    "--drain-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT, seconds to finish in-flight work before cancelling.",
)
@click.option(
    "--heartbeat-timeout",
    type=click.FloatRange(min=0),
    default=120.0,
    show_default=True,
    help="Kill and restart a worker silent this long with a ping out (0: off).",
)
@click.option(
    "--heartbeat-interval",
    type=click.FloatRange(min=0.01),
    default=5.0,
    show_default=True,
    help="Seconds between heartbeat pings to each worker.",
)
@click.option(
    "--listen",
    default=None,
    metavar="SOCKET",
    help="Serve on this unix socket instead of stdin (for `generate --connect`).",
)
@click.option(
    "--session-dir",
    default=None,
    metavar="DIR",
    help="Save named sessions here (each worker in DIR/worker-N) and restore them at start: "
    "a session resumes warm on its worker after a restart.",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="Start no workers: forward to the replicas of `tokenpipe ray up` on this Ray cluster.",
)
@click.option(
    "--worker-command",
    default=None,
    hidden=True,
    help="Command line of a worker (tests, benchmarks).",
)
@click.pass_context
def command(
    ctx: click.Context,
    model: str | None,
    gpus: str,
    workers: int | None,
    tensor_parallel: int,
    max_sessions: int | None,
    max_context: int | None,
    max_queue: int,
    ready_timeout: float,
    drain_timeout: float,
    heartbeat_timeout: float,
    heartbeat_interval: float,
    listen: str | None,
    session_dir: str | None,
    ray_address: str | None,
    worker_command: str | None,
) -> None:
    """Serve JSONL on stdin/stdout through one worker per GPU (one CPU worker without GPUs).

    Other options (--dtype, --prefill-chunk, --prefix-ids, --no-warm-resume, --threads, ...)
    are passed through to every worker.

    With --ray ADDRESS the same protocol goes to the replicas on a Ray cluster instead (the
    same front end as `tokenpipe ray run --address ADDRESS`).
    """
    if ray_address is not None:
        if session_dir is not None:
            raise click.UsageError("--session-dir is for `tokenpipe ray up` with --ray")
        _run_ray_front(ctx, ray_address, listen)
        return
    try:
        config = SupervisorConfig(
            model=model,
            gpus=gpus,
            workers=workers,
            max_sessions=max_sessions,
            max_context=max_context,
            max_queue=max_queue,
            worker_args=tuple(ctx.args),
            worker_command=tuple(shlex.split(worker_command)) if worker_command else None,
            ready_timeout=ready_timeout,
            drain_timeout=drain_timeout,
            heartbeat_timeout=heartbeat_timeout,
            heartbeat_interval=heartbeat_interval,
            session_dir=session_dir,
            tensor_parallel=tensor_parallel,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    sys.exit(eventloop.run(serve(config, listen)))


def _run_ray_front(ctx: click.Context, address: str, listen: str | None) -> None:
    """`tokenpipe run --ray ADDRESS`: JSONL on stdio, forwarded to the Ray replicas (their
    workers are configured by `tokenpipe ray up`, so worker options do not apply here)."""
    if listen is not None:
        raise click.UsageError("--listen cannot be combined with --ray")
    if ctx.args:
        raise click.UsageError(
            f"worker options ({' '.join(ctx.args)}) do not apply with --ray: "
            "`tokenpipe ray up` configures the replicas' workers"
        )
    from supervisor.ray.cli import run_front

    run_front(address)
