"""What the supervisor starts: `SupervisorConfig` (validated on creation) and the worker
specs derived from it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from supervisor.pool import (
    WorkerSpec,
    default_worker_command,
    detect_gpus,
    group_devices,
    plan_devices,
    worker_specs,
)
from supervisor.session_dirs import SESSION_DIR_FLAG, split_session_dir, worker_session_dir


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
    # Saved named sessions: worker i gets <session_dir>/worker-<i> (supervisor/session_dirs.py).
    # A --session-dir among worker_args means the same.
    session_dir: str | None = None
    # Tensor parallel: each worker is a group of this many ranks (on CUDA, this many GPUs;
    # worker/parallel/group.py). The supervisor sees one worker per group.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {self.max_sessions}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be at least 1, got {self.tensor_parallel}")
        if self.ready_timeout <= 0:
            raise ValueError("ready_timeout must be positive")
        if self.heartbeat_timeout < 0 or self.heartbeat_interval <= 0:
            raise ValueError("heartbeat_timeout must be >= 0 and heartbeat_interval positive")


def session_root(config: SupervisorConfig) -> str | None:
    """The shared --session-dir root: the config's, else one among the worker flags."""
    found, _ = split_session_dir(config.worker_args)
    return config.session_dir or found


def build_worker_args(config: SupervisorConfig) -> list[str]:
    args: list[str] = []
    if config.model is not None:
        args += ["--model", config.model]
    if config.max_sessions is not None:
        args += ["--max-sessions", str(config.max_sessions)]
    if config.max_context is not None:
        args += ["--max-context", str(config.max_context)]
    if config.tensor_parallel > 1:
        args += ["--tensor-parallel", str(config.tensor_parallel)]
    _, rest = split_session_dir(config.worker_args)
    return args + list(rest)


def plan_specs(config: SupervisorConfig) -> list[WorkerSpec]:
    visible = detect_gpus() if config.workers is None else []
    devices = group_devices(
        plan_devices(config.gpus, config.workers, visible), config.tensor_parallel
    )
    command = config.worker_command or default_worker_command()
    specs = worker_specs(command, build_worker_args(config), devices)
    root = session_root(config)
    if root is not None:
        specs = [
            replace(s, argv=(*s.argv, SESSION_DIR_FLAG, str(worker_session_dir(root, s.index))))
            for s in specs
        ]
    if config.env:
        specs = [
            WorkerSpec(s.index, s.argv, {**s.env, **dict(config.env)}, s.device) for s in specs
        ]
    return specs
