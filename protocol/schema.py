"""`tokenpipe schema`: print the JSON Schema of requests and events."""

from __future__ import annotations

import json

import click

from protocol.codec import json_schema


@click.command("schema")
@click.option("--indent", type=int, default=2, show_default=True, help="JSON indent (0: compact).")
def command(indent: int) -> None:
    """Print the JSON Schema of requests and events as JSON: {"request": ..., "event": ...}."""
    text = json.dumps(json_schema(), indent=indent or None, sort_keys=False)
    click.echo(text)
