"""The examples in examples/shell and examples/python run as written (real default model)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.supervisor.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES = REPO / "examples"


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, (argv, result.stderr[-3000:])
    return result


needs_jq = pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed")


@needs_jq
def test_jq_pipeline() -> None:
    out = run(["bash", str(EXAMPLES / "shell" / "jq_pipeline.sh")]).stdout
    assert out.strip() and "{" not in out  # plain text, no JSON left


@needs_jq
def test_batch_from_jsonl() -> None:
    lines = run(["bash", str(EXAMPLES / "shell" / "batch.sh")]).stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["colors", "capital", "count"]
    assert all(len(line.split("\t", 1)[1]) > 0 for line in lines)


@needs_jq
def test_multi_turn_session() -> None:
    result = run(["bash", str(EXAMPLES / "shell" / "multi_turn.sh")])
    assert len(result.stdout.strip().splitlines()) >= 2
    import json

    stats = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert len(stats) == 2 and stats[1]["reused_prompt_tokens"] > 0  # the session kept its cache


def test_python_client_api() -> None:
    out = run([sys.executable, str(EXAMPLES / "python" / "client_api.py")]).stdout
    assert out.startswith("ready: ") and "second turn reused" in out
    reused = int(out.split("second turn reused ")[1].split()[0])
    assert reused > 0


def test_python_raw_pipes() -> None:
    out = run([sys.executable, str(EXAMPLES / "python" / "raw_pipes.py")]).stdout
    assert "a: '" in out and "b: '" in out and out.strip().endswith("exit status 0")
