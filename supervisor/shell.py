"""`tokenpipe generate` and `tokenpipe chat`: the shell front ends of the client API.

Both start a supervisor with one worker in this process (first GPU, else CPU), or attach to a
running `tokenpipe run --listen SOCKET` with `--connect SOCKET`. Text goes to stdout as it is
produced; worker logs, model-load progress and prompts go to stderr, so stdout stays clean
for pipes.

Sessions: without `--connect`, a session lives only as long as the command (per invocation).
To continue a named session across invocations, start `tokenpipe run --listen SOCKET` once
and pass `--connect SOCKET --session NAME` to each `generate`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import msgspec

from protocol import DoneEvent, ErrorEvent, GenerateRequest, TokenEvent
from supervisor.client import Client, TokenpipeError
from supervisor.core import SupervisorConfig
from supervisor.pool import detect_gpus


def _sampling_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option(
            "--max-new-tokens",
            type=click.IntRange(min=-1),
            default=256,
            show_default=True,
            help="-1 fills the context.",
        ),
        click.option(
            "--temperature",
            type=click.FloatRange(min=0),
            default=0.0,
            show_default=True,
            help="0 is greedy.",
        ),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0),
        click.option("--top-k", type=click.IntRange(min=0), default=0, help="0 is off."),
        click.option("--min-p", type=click.FloatRange(0, 1), default=0.0),
        click.option("--seed", type=click.IntRange(min=0), default=0, help="0 is unset."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option(
            "--model",
            "--model_path",
            "model",
            default=None,
            help="HF checkpoint dir or .gguf file (default: Gemma 3 270M).",
        ),
        click.option("--max-context", type=click.IntRange(min=1), default=None),
        click.option(
            "--connect",
            default=None,
            metavar="SOCKET",
            help="Use a running `tokenpipe run --listen SOCKET`.",
        ),
        click.option("-q", "--quiet", is_flag=True, help="Hide the worker's log lines."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _sampling(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        "max_new_tokens": kwargs["max_new_tokens"],
        "temperature": kwargs["temperature"],
        "top_p": kwargs["top_p"],
        "top_k": kwargs["top_k"],
        "min_p": kwargs["min_p"],
        "seed": kwargs["seed"],
        "stop": list(kwargs["stop"]),
    }


def open_client(kwargs: dict[str, Any], worker_args: Sequence[str]) -> Client:
    """A blocking client: attached to `--connect`, else a one-worker in-process supervisor."""
    if kwargs.get("connect"):
        return Client(connect=kwargs["connect"])
    config = SupervisorConfig(
        model=kwargs.get("model"),
        gpus="0" if detect_gpus() else "none",
        max_context=kwargs.get("max_context"),
        worker_args=tuple(worker_args),
    )
    return Client(config=config, stderr_sink=_discard if kwargs.get("quiet") else None)


def _discard(_: bytes) -> None:
    pass


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def stream_reply(client: Client, request: GenerateRequest, as_json: bool = False) -> DoneEvent:
    """Print a generate's text (or its event lines) as it comes; return its `done`.
    Raises TokenpipeError on an error answer."""
    for event in client.generate(request):
        if as_json:
            _write(msgspec.json.encode(event).decode() + "\n")
        if isinstance(event, TokenEvent):
            if not as_json:
                _write(event.token)
        elif isinstance(event, DoneEvent):
            return event
        elif isinstance(event, ErrorEvent):
            raise TokenpipeError(event.code, event.error)
    raise TokenpipeError("internal_error", "the stream ended without a done line")


def _constraint(json_schema_file: Path | None, regex: str | None) -> dict[str, Any]:
    """The generate fields of `--json-schema FILE` / `--regex`, checked with llguidance.
    Raises OSError (unreadable file) or ValueError (a message naming the problem)."""
    from protocol.constraints import check_constraint

    if json_schema_file is not None and regex is not None:
        raise ValueError("use one of --json-schema and --regex")
    if regex is not None:
        check_constraint("regex", regex)
        return {"regex": regex}
    if json_schema_file is None:
        return {}
    text = json_schema_file.read_text()
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--json-schema {json_schema_file}: not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {json_schema_file}: a JSON Schema must be an object")
    try:
        check_constraint("json_schema", json.dumps(schema))
    except ValueError as exc:
        raise ValueError(f"--json-schema {json_schema_file}: {exc}") from None
    return {"json_schema": schema}


_CONTEXT = {
    "ignore_unknown_options": True,
    "allow_extra_args": True,
    "help_option_names": ["-h", "--help"],
}


@click.command(context_settings=_CONTEXT)
@click.argument("prompt")
@click.option("--json", "as_json", is_flag=True, help="Print the event lines (JSONL) instead.")
@click.option(
    "--session", default=None, help="Named session (kept across invocations only with --connect)."
)
@click.option("--raw", is_flag=True, help="Do not add the model's prompt prefix (BOS).")
@click.option(
    "--json-schema",
    "json_schema_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Constrain the output to JSON valid against the JSON Schema in this file.",
)
@click.option("--regex", default=None, help="Constrain the output to match this regex.")
@_sampling_options
@click.pass_context
def generate_command(
    ctx: click.Context,
    prompt: str,
    as_json: bool,
    session: str | None,
    raw: bool,
    json_schema_file: Path | None,
    regex: str | None,
    **kwargs: Any,
) -> None:
    """Generate text for PROMPT (`-` reads it from stdin) and stream it to stdout.

    Other options (--dtype, --threads, ...) are passed to the worker.
    """
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        constraint = _constraint(json_schema_file, regex)
    except (OSError, ValueError) as exc:  # before any worker starts
        click.echo(f"tokenpipe generate: {exc}", err=True)
        sys.exit(2)
    request = GenerateRequest(
        prompt=prompt,
        session_id=session,
        add_prefix=not raw,
        **_sampling(kwargs),
        **constraint,
    )
    try:
        client = open_client(kwargs, ctx.args)
    except Exception as exc:  # start-up failures: a clear message, non-zero status
        click.echo(f"tokenpipe generate: {exc}", err=True)
        sys.exit(1)
    status = 0
    try:
        stream_reply(client, request, as_json)
        if not as_json and sys.stdout.isatty():
            _write("\n")
    except TokenpipeError as exc:
        click.echo(f"\ntokenpipe generate: {exc}", err=True)
        status = 1
    except KeyboardInterrupt:
        status = 130
    finally:
        client.close()
    sys.exit(status)


@click.command(context_settings=_CONTEXT)
@click.option("--session", default="chat", show_default=True, help="Named session to use.")
@click.option("--system", default=None, help="A system message to start with.")
@_sampling_options
@click.pass_context
def chat_command(ctx: click.Context, session: str, system: str | None, **kwargs: Any) -> None:
    """Chat with the model on a named session, using its chat template.

    Type a message and press Enter; `/reset` starts over, `/exit` or Ctrl-D leaves. Ctrl-C
    stops a reply early.
    """
    if kwargs["max_new_tokens"] == 256:
        kwargs["max_new_tokens"] = 512
    try:
        client = open_client(kwargs, ctx.args)
    except Exception as exc:
        click.echo(f"tokenpipe chat: {exc}", err=True)
        sys.exit(1)
    base: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    click.echo("tokenpipe chat: /reset starts over, /exit or Ctrl-D leaves.", err=True)
    try:
        while True:
            sys.stderr.write("> ")
            sys.stderr.flush()
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:
                sys.stderr.write("\n")
                continue
            if not line:  # Ctrl-D
                sys.stderr.write("\n")
                break
            text = line.strip()
            if not text:
                continue
            if text == "/exit":
                break
            if text == "/reset":
                client.reset_session(session)
                messages = list(base)
                click.echo("(conversation reset)", err=True)
                continue
            messages.append({"role": "user", "content": text})
            request = GenerateRequest(messages=messages, session_id=session, **_sampling(kwargs))
            reply: list[str] = []
            try:
                for event in client.generate(request):
                    if isinstance(event, TokenEvent):
                        reply.append(event.token)
                        _write(event.token)
                    elif isinstance(event, ErrorEvent):
                        raise TokenpipeError(event.code, event.error)
            except KeyboardInterrupt:
                click.echo(" (stopped)", err=True)
            except TokenpipeError as exc:
                click.echo(f"\nerror: {exc}", err=True)
                messages.pop()
                continue
            _write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})
    finally:
        client.close()
