"""Every `tokenpipe ...` command line in the docs parses: its subcommand exists and takes
every option the line gives. (The 24 GB card's `tokenpipe serve --quantize int4` line in
examples/gemma4_31b/README.md failed with "No such option" until session 27.)"""

from __future__ import annotations

import re
import shlex
import subprocess

import click
import pytest

from supervisor.cli import main
from tests.supervisor.conftest import REPO

# `run` passes unknown options to its workers; the others must know every option they get
STRICT = ("serve", "worker", "info", "generate", "chat", "ray")


def documented_lines() -> list[tuple[str, str]]:
    files = subprocess.run(
        ["git", "ls-files", "*.md"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout.split()
    lines: list[tuple[str, str]] = []
    for name in files:
        text = (REPO / name).read_text()
        for match in re.finditer(r"^\s*(tokenpipe (?:[^\n]*\\\n)*[^\n]*)", text, re.M):
            line = re.sub(r"\\\n\s*", " ", match.group(1))
            line = re.sub(r"\s+#.*$", "", line).strip()  # a trailing comment
            if line.split()[1] in STRICT and "..." not in line:
                lines.append((name, line))
    return lines


LINES = documented_lines()


def test_the_docs_have_such_lines() -> None:
    assert any(line.startswith("tokenpipe serve --quantize") for _, line in LINES)
    assert any("--gpu-memory-gb" in line for _, line in LINES)


@pytest.mark.parametrize(("name", "line"), LINES, ids=[line[:60] for _, line in LINES])
def test_documented_command_parses(name: str, line: str) -> None:
    args = shlex.split(line)[1:]
    context = click.Context(main)
    command = main.get_command(context, args.pop(0))
    while isinstance(command, click.Group):  # `ray up`
        command = command.get_command(context, args.pop(0))
    assert command is not None, (name, line)
    try:
        command.make_context(command.name, args)
    except click.UsageError as exc:
        pytest.fail(f"{name}: `{line}`: {exc.format_message()}")


def test_an_unknown_option_fails_here() -> None:
    with pytest.raises(pytest.fail.Exception, match="No such option"):
        test_documented_command_parses("README.md", "tokenpipe serve --quantize int4 --bogus 1")
