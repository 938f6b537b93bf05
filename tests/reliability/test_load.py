"""The load test, scaled down for CI: 8 concurrent sessions x 3 requests through `tokenpipe
run` on a tiny checkpoint, with random cancels (tools/load_test.py runs the full 64 x 20)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.reliability.helpers import REPO, write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def load_tool(name: str) -> ModuleType:
    """Import tools/NAME.py (tools/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def test_load_run_scaled_down(tmp_path: Path) -> None:
    tool = load_tool("load_test")
    model = write_tiny_checkpoint(tmp_path / "tiny")
    args = argparse.Namespace(
        model=str(model),
        workers=1,
        max_context=256,
        max_new=6,
        threads=1,
        seed=1,
        sessions=8,
        requests=3,
        cancel_rate=0.3,
        verify=0,
        write=False,
    )
    summary = asyncio.run(tool.run_mode(args))
    assert summary["problems"] == [], summary
    assert summary["requests"] == 24 and summary["verified"] > 0
    assert summary["cancels_sent"] > 0
    assert sum(summary["finish_reasons"].values()) == 24


def test_update_row_replaces_its_own_row(tmp_path: Path) -> None:
    tool = load_tool("load_test")
    path = tmp_path / "RELIABILITY.md"
    tool.update_row("a", "x.py", "tried 1", "held 1", True, path)
    tool.update_row("b", "y.py", "tried 2", "held 2", False, path)
    tool.update_row("a", "x.py", "tried 3", "held 3", True, path)
    rows = [line for line in path.read_text().splitlines() if line.startswith("| a |")]
    assert len(rows) == 1 and "tried 3" in rows[0] and "PASS" in rows[0]
    assert "| b | `y.py` | tried 2 | held 2 | FAIL |" in path.read_text()
