"""`tokenpipe generate --json-schema FILE / --regex`: the constraint is checked before any
worker starts (a bad one exits 2 naming the problem) and reaches the generate request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from supervisor import shell

pytest.importorskip("llguidance")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--json-schema", "schema.json"], "uniqueItems"),
        (["--json-schema", "missing.json"], "missing.json"),
        (["--regex", "(a"], "unclosed group"),
        (["--regex", "a", "--json-schema", "schema.json"], "one of"),
    ],
)
def test_bad_constraint_exits_before_a_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], needle: str
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("schema.json").write_text(json.dumps({"type": "array", "uniqueItems": True}))

    def no_client(*_: Any) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(shell, "open_client", no_client)
    result = CliRunner().invoke(shell.generate_command, ["hi", *args])
    assert result.exit_code == 2 and needle in result.output


def test_schema_reaches_the_request(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    assert shell._constraint(path, None) == {"json_schema": schema}
    assert shell._constraint(None, "[ab]+") == {"regex": "[ab]+"}
    assert shell._constraint(None, None) == {}
