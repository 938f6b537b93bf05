"""The MoE layer's host-side pieces (worker/layers/moe.py): the merged input matmul's padding."""

from __future__ import annotations

import pytest
import torch
from test_models_qwen3_5_moe import TINY
from torch import nn

from worker.layers.moe import IN_PROJ_ROW_MULTIPLE, _pad_rows


def test_pad_rows_appends_zero_rows_to_a_multiple() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(16, 13, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(13, 16, generator=gen))
    want = linear.weight.detach().clone()
    padded = _pad_rows(linear, 8)
    assert padded.weight.shape == (16, 16)
    assert torch.equal(padded.weight[:13], want) and not padded.weight[13:].any()
    x = torch.randn(3, 16, generator=gen)
    torch.testing.assert_close(padded(x)[:, :13], x @ want.T)
    aligned = nn.Linear(16, 8, bias=False)
    assert _pad_rows(aligned, 8) is aligned  # already a multiple: unchanged
    biased = nn.Linear(16, 13)
    assert _pad_rows(biased, 8) is biased


def test_merged_moe_input_matmul_is_padded_and_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fuse_projections`` (on the CPU here) pads the merged router + shared-expert matmul to
    IN_PROJ_ROW_MULTIPLE rows; the layer's output is unchanged."""
    import worker.layers.deltanet as deltanet
    from worker.layers.moe import SparseMoE
    from worker.models.config import ModelConfig

    config = ModelConfig.from_hf({**TINY, "architectures": ["Qwen3_5MoeForCausalLM"]})
    torch.manual_seed(0)
    moe = SparseMoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    x = torch.randn(5, config.hidden_size)
    want = moe(x)
    monkeypatch.setattr(deltanet, "FUSED_PROJECTION_DEVICES", ("cuda", "cpu"))
    moe.fuse_projections()
    assert moe.in_proj is not None and moe.in_proj.out_features % IN_PROJ_ROW_MULTIPLE == 0
    assert moe.in_proj.out_features > moe.experts.num_experts + 1 + 2 * moe.shared_expert.inner
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
