"""KV cache: keepable_prefix (pure), geometry, bytes_per_slot."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from worker.layers.kv import keepable_prefix_for
from worker.models.config import ModelConfig
from worker.models.registry import build_model


def _brute_force(ring: int, window: int, cached: int, common: int) -> int:
    """Largest L <= min(common, cached) whose needed positions [L - W + 1, L) are in the ring."""
    held = set(range(max(0, cached - ring), cached))
    for keep in range(min(common, cached), -1, -1):
        if all(p in held for p in range(max(0, keep - window + 1), keep)):
            return keep
    return 0


@given(
    window=st.integers(1, 12),
    slack=st.integers(0, 6),
    cached=st.integers(0, 60),
    common=st.integers(0, 70),
)
def test_keepable_prefix_matches_a_brute_force_ring(
    window: int, slack: int, cached: int, common: int
) -> None:
    ring = window + slack
    assert keepable_prefix_for([(ring, window)], cached, common) == _brute_force(
        ring, window, cached, common
    )


def test_keepable_prefix_examples() -> None:
    # full layers only: any prefix, capped by what is cached
    assert keepable_prefix_for([], 100, 40) == 40
    assert keepable_prefix_for([], 10, 40) == 10
    # ring of 8 = window 8, no slack: only the whole cache (or one token less) survives
    assert keepable_prefix_for([(8, 8)], 20, 20) == 20
    assert keepable_prefix_for([(8, 8)], 20, 19) == 19
    assert keepable_prefix_for([(8, 8)], 20, 18) == 0
    # before the ring wrapped everything is kept
    assert keepable_prefix_for([(8, 8)], 8, 3) == 3
    # slack 4: can drop up to 5 tokens
    assert keepable_prefix_for([(12, 8)], 30, 25) == 25
    assert keepable_prefix_for([(12, 8)], 30, 24) == 0
    # the tightest ring decides
    assert keepable_prefix_for([(12, 8), (9, 8)], 30, 25) == 0


def _config(**extra: object) -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            **extra,
        }
    )


def test_cache_geometry_and_bytes_per_slot() -> None:
    model = build_model(_config(), "cpu", torch.float32)
    kv = model.make_kv_cache(num_slots=3, max_context=100, ring_slack=2)
    shapes = [tuple(layer.k.shape) for layer in kv.layers]
    assert shapes == [(3, 1, 8, 8), (3, 1, 8, 8), (3, 1, 100, 8)]
    assert [layer.window for layer in kv.layers] == [6, 6, None]
    assert kv.bytes_per_slot == 2 * 4 * 8 * (8 + 8 + 100)
    assert kv.keepable_prefix(50, 47) == 47 and kv.keepable_prefix(50, 46) == 0
    # a context shorter than the ring: the ring never wraps, every prefix is kept
    small = model.make_kv_cache(num_slots=1, max_context=5)
    assert [layer.k.shape[2] for layer in small.layers] == [5, 5, 5]
    assert small.keepable_prefix(5, 1) == 1
    bf16 = build_model(_config(), "cpu", torch.bfloat16).make_kv_cache(1, 100, ring_slack=2)
    assert bf16.bytes_per_slot == kv.bytes_per_slot // 2
    with pytest.raises(ValueError):
        model.make_kv_cache(0, 10)
