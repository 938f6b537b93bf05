"""tools/tune_fla_prefill.py's reading of the autotuners' choices (no GPU: the objects only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from tune_fla_prefill import _autotuner  # noqa: E402


@triton.heuristics({"EVEN": lambda args: args["n"] % 2 == 0})
@triton.autotune(configs=[triton.Config({}, num_warps=2)], key=["n"])
@triton.jit
def _under_heuristics(p, n, EVEN: tl.constexpr):  # fla's chunk state pass is built so
    pass


@triton.autotune(configs=[triton.Config({}, num_warps=2)], key=["n"])
@triton.jit
def _plain(p, n):
    pass


@triton.jit
def _not_tuned(p, n):
    pass


def test_finds_an_autotuner_under_heuristics() -> None:
    """Session 35: the tool read only bare autotuners, so it missed fla's state-pass kernel
    (heuristics outside its autotuner) and a first start still autotuned it (12 configs)."""
    from triton.runtime.autotuner import Autotuner

    assert not isinstance(_under_heuristics, Autotuner)
    assert _autotuner(_under_heuristics) is _under_heuristics.fn
    assert _autotuner(_plain) is _plain
    assert _autotuner(_not_tuned) is None
    assert _autotuner(len) is None
