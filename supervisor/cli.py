"""The `tokenpipe` command line.

Each command lives in the module that owns its feature; this group imports it only when
the command runs, so `tokenpipe --help` stays fast and never imports torch.
"""

from __future__ import annotations

import importlib
import sys

import click

# name -> ("module:attribute", one-line help). The attribute is a click.Command.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("supervisor.run_cli:command", "Serve JSONL on stdin/stdout, one worker per GPU."),
    "worker": ("worker.main:command", "Run one worker process (JSONL on stdin/stdout)."),
    "generate": ("supervisor.shell:generate_command", "Stream the text for one prompt."),
    "chat": ("supervisor.shell:chat_command", "Chat interactively with the model."),
    "serve": ("supervisor.openai.cli:command", "Serve the OpenAI-compatible HTTP API."),
    "info": ("worker.info:command", "Print the model's metadata as JSON."),
    "schema": ("protocol.schema:command", "Print the JSON Schema of requests and events."),
    "ray": ("supervisor.ray.cli:command", "Replicas on a Ray cluster, routed by session."),
}


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        target, help_text = entry
        module_name, attribute = target.split(":")
        try:
            module = importlib.import_module(module_name)
            command = getattr(module, attribute)
        except (ImportError, AttributeError) as exc:
            return _not_implemented(cmd_name, help_text, exc)
        if not isinstance(command, click.Command):
            return _not_implemented(cmd_name, help_text, TypeError(f"{target} is not a command"))
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_text) for name, (_, help_text) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _not_implemented(name: str, help_text: str, reason: Exception) -> click.Command:
    def callback(**_: object) -> None:
        click.echo(f"tokenpipe {name}: not available in this build ({reason})", err=True)
        sys.exit(2)

    return click.Command(
        name,
        callback=callback,
        help=help_text + " (not available in this build)",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tokenpipe")
def main() -> None:
    """tokenpipe: run a large language model as a process other programs talk to.

    With no --model, every command uses the default model, Gemma 3 270M, which ships with
    the package.
    """
