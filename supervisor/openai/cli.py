"""`tokenpipe serve`: the OpenAI-compatible HTTP API (starlette on uvicorn).

The supervisor runs in this process (`AsyncClient.in_process`) on uvicorn's event loop; the
port opens at once and `/health` answers 503 until the model is loaded.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

QUANTIZE_MODES = ("auto", "none", "int8", "int4", "int4-mixed", "int4-experts")
"""The worker's --quantize choices (`worker/loading/quantize.py` holds their meaning)."""


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--model-id", default=None, help="Model id clients send (default: model name).")
@click.option(
    "--api-key",
    default=None,
    envvar="TOKENPIPE_API_KEY",
    help="Require `Authorization: Bearer KEY` on every API request.",
)
@click.option(
    "--chat-template",
    "chat_template_file",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A jinja chat template file overriding the model's.",
)
@click.option(
    "--tool-parser",
    type=click.Choice(["gemma4", "hermes", "qwen"]),
    default=None,
    help="Tool-call markup to parse (default: the model family's).",
)
@click.option(
    "--allow-origin",
    "allow_origins",
    multiple=True,
    help="A browser origin allowed to call the API, e.g. http://localhost:5173 (repeatable; "
    "CORS headers for it). Without --api-key other origins are refused.",
)
@click.option("--max-body-bytes", default=8 << 20, show_default=True, type=click.IntRange(1))
@click.option(
    "--render-budget",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds to parse and render one request; beyond: 400 request_too_complex.",
)
@click.option(
    "--header-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds for a request's headers to arrive (from connect or the last response).",
)
@click.option(
    "--body-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds for a request's body to arrive (408 after).",
)
@click.option(
    "--keep-alive-timeout",
    default=5,
    show_default=True,
    type=click.IntRange(1),
    help="Seconds an idle keep-alive connection stays open.",
)
@click.option(
    "--max-connections",
    default=512,
    show_default=True,
    type=click.IntRange(1),
    help="Open connections at most; more are closed at once.",
)
@click.option("--model", default=None, help="HF checkpoint dir or .gguf (default: Gemma 3 270M).")
@click.option("--workers", default=None, type=click.IntRange(1), help="CPU workers to run.")
@click.option("--gpus", default="all", show_default=True, help="all | none | 0,2")
@click.option(
    "--tensor-parallel",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Ranks per worker (N GPUs each on CUDA).",
)
@click.option("--max-sessions", default=None, type=click.IntRange(1), help="Per worker.")
@click.option("--max-context", default=None, type=click.IntRange(1), help="Context per session.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1))
@click.option(
    "--max-resident",
    default=None,
    type=click.IntRange(1),
    help="Per worker: sessions whose cache is on the device at once (the others of "
    "--max-sessions wait in host memory, then --session-dir).",
)
@click.option(
    "--host-cache-gb",
    default=None,
    type=click.FloatRange(0),
    help="Per worker: host memory for idle sessions' caches (worker default: 4).",
)
@click.option(
    "--quantize",
    default=None,
    type=click.Choice(QUANTIZE_MODES),
    help="Per worker: the weights' format (worker default: auto, which keeps a GGUF's).",
)
@click.option("--group-size", default=None, type=click.IntRange(2), help="Quantization group size.")
@click.option(
    "--gpu-memory-gb",
    default=None,
    type=click.FloatRange(0, min_open=True),
    help="Per worker: device memory it may hold, as on a card that size.",
)
@click.option(
    "--kv-cache-dtype",
    default=None,
    type=click.Choice(["auto", "fp8"]),
    help="Per worker: the KV cache's format (worker default: auto, the model's dtype; fp8 "
    "holds twice the tokens).",
)
@click.option(
    "--session-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Save named sessions (and the turns spliced into them) here; after a restart they "
    "resume warm on the worker that saved them.",
)
@click.option(
    "--worker-arg",
    "worker_args",
    multiple=True,
    help="An extra flag for every worker (repeatable), e.g. --worker-arg=--dtype=bfloat16",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
def command(
    host: str,
    port: int,
    model_id: str | None,
    api_key: str | None,
    chat_template_file: Path | None,
    tool_parser: str | None,
    allow_origins: tuple[str, ...],
    max_body_bytes: int,
    render_budget: float,
    header_timeout: float,
    body_timeout: float,
    keep_alive_timeout: int,
    max_connections: int,
    model: str | None,
    workers: int | None,
    gpus: str,
    tensor_parallel: int,
    max_sessions: int | None,
    max_context: int | None,
    max_queue: int,
    max_resident: int | None,
    host_cache_gb: float | None,
    quantize: str | None,
    group_size: int | None,
    gpu_memory_gb: float | None,
    kv_cache_dtype: str | None,
    session_dir: Path | None,
    worker_args: tuple[str, ...],
    log_level: str,
) -> None:
    """Serve the OpenAI-compatible HTTP API (chat, completions, tokenize, metrics)."""
    import uvicorn

    from supervisor.client import AsyncClient
    from supervisor.config import session_root
    from supervisor.core import SupervisorConfig

    from .app import Server, ServerConfig, create_app
    from .connections import guarded_protocol
    from .sessions import TurnStore
    from .turn_files import TurnFiles

    logging.basicConfig(
        stream=sys.stderr,
        level=log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        supervisor_config = SupervisorConfig(
            model=model,
            gpus=gpus,
            workers=workers,
            max_sessions=max_sessions,
            max_context=max_context,
            max_queue=max_queue,
            worker_args=tiers_args(max_resident, host_cache_gb)
            + weights_args(quantize, group_size, gpu_memory_gb, kv_cache_dtype)
            + tuple(worker_args),
            session_dir=str(session_dir) if session_dir is not None else None,
            tensor_parallel=tensor_parallel,
        )
        server_config = ServerConfig(
            model_id=model_id,
            api_key=api_key,
            chat_template=chat_template_file.read_text() if chat_template_file else None,
            tool_parser=tool_parser,
            max_body_bytes=max_body_bytes,
            render_budget_s=render_budget,
            body_timeout_s=body_timeout,
            max_queue=max_queue,
            allow_origins=tuple(allow_origins),
            bind_host=host,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    async def start_client() -> AsyncClient:
        return await AsyncClient.in_process(supervisor_config)

    turns = TurnStore()
    root = session_root(supervisor_config)
    if root is not None:
        turns = TurnStore(files=TurnFiles(turns_dir(root), turns.max_turns))
    server = Server(server_config, start_client, turns=turns)
    uvicorn.run(
        create_app(server),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=30,
        http=guarded_protocol(header_timeout, max_connections),
        timeout_keep_alive=keep_alive_timeout,
        limit_concurrency=max_connections + 1,  # uvicorn answers 503 at >= the limit
    )


def tiers_args(max_resident: int | None, host_cache_gb: float | None) -> tuple[str, ...]:
    """The worker flags of the session tiers given on `serve`'s command line."""
    args: tuple[str, ...] = ()
    if max_resident is not None:
        args += ("--max-resident", str(max_resident))
    if host_cache_gb is not None:
        args += ("--host-cache-gb", str(host_cache_gb))
    return args


def weights_args(
    quantize: str | None,
    group_size: int | None,
    gpu_memory_gb: float | None,
    kv_cache_dtype: str | None = None,
) -> tuple[str, ...]:
    """The worker flags of the weights' format, the device memory limit and the KV cache's
    format."""
    args: tuple[str, ...] = ()
    if quantize is not None:
        args += ("--quantize", quantize)
    if group_size is not None:
        args += ("--group-size", str(group_size))
    if gpu_memory_gb is not None:
        args += ("--gpu-memory-gb", str(gpu_memory_gb))
    if kv_cache_dtype is not None:
        args += ("--kv-cache-dtype", kv_cache_dtype)
    return args


def turns_dir(session_dir: str) -> Path:
    """Where the remembered turns of the sessions saved under `session_dir` are kept (next
    to the workers' `worker-N` directories)."""
    return Path(session_dir) / "openai-turns"
