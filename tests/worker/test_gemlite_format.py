"""Our int4 weights in gemlite's A16W4 format (tools/bench_gemlite.py ``gemlite_tensors``): the
same codes, scales and offsets rearranged, so gemlite's dequantization formula gives our
``dequantize`` bit for bit. Plain torch: runs (never skips) on the CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from worker.layers import quant as Q

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_gemlite.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gemlite", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("n", "k", "group"), [(24, 64, 32), (40, 256, 32), (8, 96, 16)])
def test_gemlite_tensors_dequantize_to_our_weights(n: int, k: int, group: int) -> None:
    tool = _tool()
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen) * 0.05
    qw = Q.quantize(weight, Q.QuantFormat("int4", group), search=False)
    words, scales, zeros = tool.gemlite_tensors(qw)
    assert words.dtype == torch.int32 and words.shape == (k // 8, n)
    assert scales.shape == zeros.shape == (k // group, n)
    assert scales.dtype == zeros.dtype == torch.float16
    # gemlite's own packing (bitpack.pack_weights_over_cols_torch, transposed): code k of
    # output n at bits 4 (k % 8) of word (k // 8, n)
    codes = Q.unpack_nibbles(qw.qdata).to(torch.int32)  # [N, K]
    expected = torch.zeros((n, k // 8), dtype=torch.int32)
    for j in range(k):
        expected[:, j // 8] |= codes[:, j] << (4 * (j % 8))
    assert torch.equal(words, expected.t())
    assert torch.equal(tool.gemlite_dequantize(words, scales, zeros, group), Q.dequantize(qw))


def test_gemlite_tensors_refuse_int8() -> None:
    tool = _tool()
    qw = Q.quantize(torch.randn(8, 64), Q.QuantFormat("int8", 32), search=False)
    with pytest.raises(ValueError, match="int4"):
        tool.gemlite_tensors(qw)
