"""Worker processes: planning which to start, spawning, the ready handshake, watching, stopping.

A `WorkerProcess` is one child speaking JSONL on its stdin/stdout. Its stdout lines go to a
callback in batches (one call per pipe read, so the relay does no per-line task switch); its
stderr lines are relayed, prefixed with the worker index, and the last ones kept for error
messages. Death is seen at once: the process-exit callback plus EOF on stdout.

No torch here: GPUs are found through CUDA_VISIBLE_DEVICES or `nvidia-smi -L`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

# Logs go here (the supervisor's stderr); tests may swap it.
StderrSink = Callable[[bytes], None]


def default_stderr_sink(data: bytes) -> None:
    try:
        sys.stderr.buffer.write(data)
        sys.stderr.buffer.flush()
    except (OSError, ValueError):
        pass


def log(message: str) -> None:
    default_stderr_sink(f"tokenpipe: {message}\n".encode())


# --------------------------------------------------------------------------- planning


def default_worker_command() -> tuple[str, ...]:
    """`tokenpipe worker` run with this interpreter (works without the console script)."""
    code = "import sys; sys.argv[0] = 'tokenpipe'; from supervisor.cli import main; main()"
    return (sys.executable, "-c", code, "worker")


def detect_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """Visible GPU ids, without importing torch: CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        # "-1" (or any negative) hides every GPU, and so does everything after it.
        out: list[str] = []
        for v in ids:
            if v.startswith("-"):
                break
            out.append(v)
        return out
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    if listing.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU")]


def plan_devices(gpus: str, workers: int | None, visible: Sequence[str]) -> list[str | None]:
    """One entry per worker: the CUDA_VISIBLE_DEVICES value to pin, or None for a CPU worker.

    `gpus` is "all", "none" or a comma list of indices into `visible`. `workers` (when given)
    asks for that many CPU workers and wins over `gpus`.
    """
    if workers is not None:
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        return [None] * workers
    choice = gpus.strip().lower()
    if choice in ("none", "cpu", ""):
        return [None]
    if choice == "all":
        return list(visible) or [None]
    picked: list[str | None] = []
    for part in choice.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"--gpus takes all, none or a list like 0,2; got {gpus!r}")
        if int(part) >= len(visible):
            raise ValueError(f"--gpus {gpus}: GPU {part} is not visible ({len(visible)} found)")
        picked.append(visible[int(part)])
    return picked


def group_devices(devices: Sequence[str | None], tensor_parallel: int) -> list[str | None]:
    """Pure: one entry per tensor-parallel group. GPUs go `tensor_parallel` to a group, in
    order ("0,1", "2,3", ...: the group's CUDA_VISIBLE_DEVICES); CPU workers stay one entry
    each (a CPU group starts its own ranks)."""
    if tensor_parallel == 1 or all(d is None for d in devices):
        return list(devices)
    if len(devices) % tensor_parallel:
        raise ValueError(
            f"--tensor-parallel {tensor_parallel}: {len(devices)} GPU(s) do not make whole groups"
        )
    return [
        ",".join(str(d) for d in devices[i : i + tensor_parallel])
        for i in range(0, len(devices), tensor_parallel)
    ]


@dataclass(frozen=True)
class WorkerSpec:
    """How to start worker `index`."""

    index: int
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the supervisor's env
    device: str = "cpu"


def worker_specs(
    command: Sequence[str], worker_args: Sequence[str], devices: Sequence[str | None]
) -> list[WorkerSpec]:
    """Pure: the spec of each worker. CPU workers get `--device cpu`, GPU ones `--device cuda`
    with CUDA_VISIBLE_DEVICES pinned to their GPU."""
    specs = []
    for index, gpu in enumerate(devices):
        if gpu is None:
            argv = (*command, *worker_args, "--device", "cpu")
            specs.append(WorkerSpec(index, argv, {}, "cpu"))
        else:
            argv = (*command, *worker_args, "--device", "cuda")
            specs.append(WorkerSpec(index, argv, {"CUDA_VISIBLE_DEVICES": gpu}, f"cuda:{gpu}"))
    return specs


# --------------------------------------------------------------------------- processes


class WorkerStartError(RuntimeError):
    """A worker did not print its ready line (exited, or timed out)."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


LineHandler = Callable[[list[bytes]], None]

_STDOUT_READ_SIZE = 64 * 1024  # per read of a worker's stdout under asyncio's own loop


class _Protocol(asyncio.SubprocessProtocol):
    def __init__(self, owner: WorkerProcess) -> None:
        self.owner = owner

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd == 1:
            self.owner._on_stdout(data)
        else:
            self.owner._on_stderr(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1:
            self.owner._on_stdout_eof()

    def process_exited(self) -> None:
        self.owner._on_exit()


class WorkerProcess:
    """One running worker. Create with `await WorkerProcess.spawn(...)`, which returns once the
    ready line is in (or raises WorkerStartError)."""

    def __init__(
        self,
        spec: WorkerSpec,
        on_lines: LineHandler,
        on_death: Callable[[WorkerProcess], None],
        stderr_sink: StderrSink,
    ) -> None:
        self.spec = spec
        self.ready_info: dict[str, Any] = {}
        self.pid: int | None = None
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        self.returncode: int | None = None
        self.stderr_tail: deque[str] = deque(maxlen=20)
        self._on_lines = on_lines
        self._on_death = on_death
        self._stderr_sink = stderr_sink
        self._prefix = f"[worker {spec.index}] ".encode()
        self._stdout_partial = b""
        self._stderr_partial = b""
        self._transport: asyncio.SubprocessTransport | None = None
        self._stdin: asyncio.WriteTransport | None = None
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._stdout_closed = False
        self._exited = False
        self._dead = False
        self._dead_event = asyncio.Event()
        self.stopping = False  # set by stop(): the death that follows is not a crash

    @classmethod
    async def spawn(
        cls,
        spec: WorkerSpec,
        on_lines: LineHandler,
        on_death: Callable[[WorkerProcess], None],
        stderr_sink: StderrSink = default_stderr_sink,
        ready_timeout: float = 300.0,
    ) -> WorkerProcess:
        self = cls(spec, on_lines, on_death, stderr_sink)
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        try:
            transport, _ = await loop.subprocess_exec(
                lambda: _Protocol(self),
                *spec.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        except OSError as exc:
            raise WorkerStartError(
                f"worker {spec.index}: cannot start {spec.argv[0]}: {exc}"
            ) from exc
        self._transport = transport
        self._stdin = transport.get_pipe_transport(0)  # type: ignore[assignment]
        stdout_pipe = transport.get_pipe_transport(1)
        if hasattr(type(stdout_pipe), "max_size"):
            # asyncio's pipe transport reads into a fresh bytes of max_size (256 KiB: above
            # malloc's mmap threshold, so mmap + mremap + munmap on every read); uvloop reads
            # into one reused buffer and has no such attribute.
            stdout_pipe.max_size = _STDOUT_READ_SIZE  # type: ignore[attr-defined]
        self.pid = transport.get_pid()
        try:
            self.ready_info = await asyncio.wait_for(asyncio.shield(self._ready), ready_timeout)
        except asyncio.TimeoutError:
            self.kill()
            await self.wait_dead(5.0)
            if self._transport is not None:
                self._transport.close()
            raise WorkerStartError(
                f"worker {spec.index} (pid {self.pid}) printed no ready line within "
                f"{ready_timeout:g}s{self._tail_text()}"
            ) from None
        return self

    def _tail_text(self) -> str:
        if self._stderr_partial:
            self.stderr_tail.append(self._stderr_partial.decode(errors="replace"))
        if not self.stderr_tail:
            return " (no stderr output)"
        return "; its last stderr lines:\n  " + "\n  ".join(self.stderr_tail)

    # ----------------------------------------------------------------- pipe callbacks

    def _on_stdout(self, data: bytes) -> None:
        if self._stdout_partial:
            data = self._stdout_partial + data
        lines = data.split(b"\n")
        self._stdout_partial = lines.pop()
        if self._ready is not None and not self._ready.done():
            while lines:
                first = lines.pop(0)
                if not first.strip():
                    continue
                try:
                    info = orjson.loads(first)
                except orjson.JSONDecodeError:
                    self._stderr_sink(self._prefix + b"(stdout, not JSON) " + first + b"\n")
                    continue
                if isinstance(info, dict) and info.get("ready"):
                    self.ready_at = time.monotonic()
                    self._ready.set_result(info)
                    break
            if not self._ready.done():
                return
        if lines:
            self._on_lines(lines)

    def _on_stderr(self, data: bytes) -> None:
        data = self._stderr_partial + data
        lines = data.split(b"\n")
        self._stderr_partial = lines.pop()
        out = [self._prefix + line + b"\n" for line in lines]
        for line in lines:
            self.stderr_tail.append(line.rsplit(b"\r", 1)[-1].decode(errors="replace"))
        if b"\r" in self._stderr_partial:
            # A progress bar redrawing its line: relay each finished redraw as it comes.
            done, _, self._stderr_partial = self._stderr_partial.rpartition(b"\r")
            out += [b"\r" + self._prefix + piece for piece in done.split(b"\r") if piece]
        if out:
            self._stderr_sink(b"".join(out))

    def _on_stdout_eof(self) -> None:
        self._stdout_closed = True
        if self._stdout_partial.strip() and self._ready is not None and self._ready.done():
            self._on_lines([self._stdout_partial])
        self._stdout_partial = b""
        if not self._exited:
            self.kill()  # a worker without stdout is useless; its exit completes the death
        self._maybe_dead()

    def _on_exit(self) -> None:
        self._exited = True
        if self._transport is not None:
            self.returncode = self._transport.get_returncode()
        if not self._stdout_closed:
            # Normally stdout's EOF follows at once; do not wait on a grandchild holding it.
            asyncio.get_running_loop().call_later(0.5, self._force_dead)
        self._maybe_dead()

    def _force_dead(self) -> None:
        self._stdout_closed = True
        self._maybe_dead()

    def _maybe_dead(self) -> None:
        if self._dead or not (self._exited and self._stdout_closed):
            return
        self._dead = True
        if self._stderr_partial:
            self._on_stderr(b"\n")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(
                WorkerStartError(
                    f"worker {self.spec.index} (pid {self.pid}) exited with status "
                    f"{self.returncode} before its ready line{self._tail_text()}"
                )
            )
            self._ready.exception()  # mark retrieved
        self._dead_event.set()
        if self._transport is not None:
            self._transport.close()
        if self.ready_at is not None:
            self._on_death(self)

    # ----------------------------------------------------------------- control

    @property
    def alive(self) -> bool:
        return not self._dead

    def send(self, data: bytes) -> None:
        if self._stdin is not None and not self._stdin.is_closing():
            self._stdin.write(data)

    def close_stdin(self) -> None:
        if self._stdin is not None and not self._stdin.is_closing():
            self._stdin.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.pid is not None and not self._exited:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    async def wait_dead(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._dead_event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def stop(self, timeout: float = 5.0) -> None:
        """Close stdin (the worker finishes and exits), then SIGTERM, then SIGKILL."""
        self.stopping = True
        self.close_stdin()
        if await self.wait_dead(timeout):
            return
        self.kill(signal.SIGTERM)
        if await self.wait_dead(2.0):
            return
        self.kill(signal.SIGKILL)
        await self.wait_dead(2.0)
