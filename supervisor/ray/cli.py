"""`tokenpipe ray up | run | down`: tokenpipe replicas on a Ray cluster."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading

import click

from supervisor.openai.cli import QUANTIZE_MODES

RAY_MISSING = "tokenpipe ray needs Ray Serve: pip install -e '.[ray]'"


def _require_ray() -> None:
    import importlib.util

    # found, not imported: connect() sets Ray's environment before Ray reads it
    if importlib.util.find_spec("ray") is None:  # (a submodule's find_spec imports ray)
        raise click.ClickException(RAY_MISSING)


@click.group("ray", context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """tokenpipe replicas on a Ray cluster, routed by session."""


@command.command("up")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1))
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address of the HTTP API.")
@click.option("--address", default=None, help="Join this cluster (default: start a local one).")
@click.option("--num-cpus", default=None, type=click.IntRange(1), help="CPUs of a local cluster.")
@click.option("--workers", default=None, type=click.IntRange(1), help="CPU workers per replica.")
@click.option(
    "--gpus-per-replica",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0),
    help="GPUs Ray gives each replica; its supervisor runs one worker on each.",
)
@click.option("--model", default=None, help="HF checkpoint dir or .gguf (default: Gemma 3 270M).")
@click.option("--model-id", default=None, help="Model id clients send (default: model name).")
@click.option("--max-sessions", default=None, type=click.IntRange(1), help="Per worker.")
@click.option("--max-context", default=None, type=click.IntRange(1), help="Context per session.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1))
@click.option(
    "--quantize",
    default=None,
    type=click.Choice(QUANTIZE_MODES),
    help="The weights' format (worker default: auto, which keeps a GGUF's).",
)
@click.option("--group-size", default=None, type=click.IntRange(2), help="Quantization group size.")
@click.option(
    "--gpu-memory-gb",
    default=None,
    type=click.FloatRange(0, min_open=True),
    help="Device memory each worker may hold, as on a card that size.",
)
@click.option(
    "--kv-cache-dtype",
    default=None,
    type=click.Choice(["auto", "fp8"]),
    help="The KV cache's format (worker default: auto; fp8 holds twice the tokens).",
)
@click.option("--worker-arg", "worker_args", multiple=True, help="An extra worker flag.")
@click.option(
    "--session-dir",
    default=None,
    help="Save named sessions here (a directory per replica rank, DIR/rank-R, on the "
    "replica's node); a replacement replica, or the next deployment, resumes them warm.",
)
@click.option("--api-key", default=None, envvar="TOKENPIPE_API_KEY", help="Require this key.")
@click.option("--no-http", is_flag=True, help="Replicas only, for `tokenpipe ray run`.")
@click.option(
    "--via-serve",
    is_flag=True,
    help="HTTP through Ray Serve's proxy and a Serve call per request (+5 ms) instead of the "
    "front end passing each request to its replica's own port; for nodes that reach each "
    "other only on Ray's ports.",
)
@click.option(
    "--separate-ingress",
    is_flag=True,
    help="With --via-serve: an ingress deployment in front of the replicas: a replica lost "
    "mid-response is answered worker_lost (not a cut stream), at one more actor hop.",
)
def up_command(
    replicas: int,
    port: int,
    host: str,
    address: str | None,
    num_cpus: int | None,
    workers: int | None,
    gpus_per_replica: float,
    model: str | None,
    model_id: str | None,
    max_sessions: int | None,
    max_context: int | None,
    max_queue: int,
    quantize: str | None,
    group_size: int | None,
    gpu_memory_gb: float | None,
    kv_cache_dtype: str | None,
    worker_args: tuple[str, ...],
    session_dir: str | None,
    api_key: str | None,
    no_http: bool,
    via_serve: bool,
    separate_ingress: bool,
) -> None:
    """Start (or join with --address) a Ray cluster and deploy N replicas behind one OpenAI
    API on --port. Run it again with another --replicas to scale in place. Without
    --address it keeps the cluster up until Ctrl-C."""
    _require_ray()
    from supervisor.core import SupervisorConfig
    from supervisor.openai.app import ServerConfig
    from supervisor.openai.cli import weights_args

    from .app import Deployment, connect, deploy

    cpu_workers = workers if workers is not None else (1 if gpus_per_replica == 0 else None)
    try:
        spec = Deployment(
            replicas=replicas,
            supervisor=SupervisorConfig(
                model=model,
                gpus="all" if gpus_per_replica else "none",
                workers=cpu_workers,
                max_sessions=max_sessions,
                max_context=max_context,
                max_queue=max_queue,
                worker_args=weights_args(quantize, group_size, gpu_memory_gb, kv_cache_dtype)
                + worker_args,
                session_dir=session_dir,
            ),
            server=ServerConfig(
                model_id=model_id, api_key=api_key, max_queue=max_queue, bind_host=host
            ),
            cpus_per_replica=float(cpu_workers or 1),
            gpus_per_replica=gpus_per_replica,
            max_ongoing_requests=max_queue,
            http=not no_http,
            via_serve=via_serve or separate_ingress,
            separate_ingress=separate_ingress,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    cluster = connect(address, num_cpus)
    click.echo(f"tokenpipe ray: cluster {cluster}; deploying {replicas} replica(s)...", err=True)
    deploy(spec, host=host, port=port)
    if not no_http:
        click.echo(f"tokenpipe ray: OpenAI API on http://{host}:{port}/v1", err=True)
    click.echo(f"tokenpipe ray: JSONL front end: tokenpipe ray run --address {cluster}", err=True)
    click.echo(cluster)
    if address:
        return  # the application lives in the cluster; `tokenpipe ray down` removes it
    _hold_until_signal()
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _hold_until_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    click.echo("tokenpipe ray: holding the local cluster; Ctrl-C stops it", err=True)
    stop.wait()


@command.command("run")
@click.option("--address", required=True, help="The cluster `tokenpipe ray up` printed.")
def run_command(address: str) -> None:
    """JSONL on stdin/stdout (as `tokenpipe run`), forwarded to the replicas. The same as
    `tokenpipe run --ray ADDRESS`."""
    run_front(address)


def run_front(address: str) -> None:
    """The JSONL front end on this process's stdio, until EOF or `shutdown`."""
    _require_ray()
    from .front import serve_stdio

    try:
        asyncio.run(serve_stdio(address))
    except KeyboardInterrupt:
        sys.exit(130)


@command.command("down")
@click.option("--address", required=True, help="The cluster `tokenpipe ray up` printed.")
def down_command(address: str) -> None:
    """Remove the tokenpipe application (its replicas and their workers)."""
    _require_ray()
    from ray import serve

    from .app import APP_NAME, connect

    connect(address)
    serve.delete(APP_NAME)
