"""Gemma 4 vs transformers (fp32, CPU): the 31B text layout in miniature — sliding and full
layers (window 8), head_dim 16 / 32, 2 / 1 KV heads, K=V on full layers, proportional partial
RoPE, q/k/v norms, layer_scalar, final softcap 30."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_models_common import (
    Pair,
    check_batched_step,
    check_chunked_prefill,
    check_cpu_packed,
    check_greedy,
    check_long_decode,
    check_prompt_logits,
    check_truncate_and_resume,
    make_pair,
)

from worker.models.config import ModelConfig


def _config(k_eq_v: bool) -> Any:
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        eos_token_id=None,
    )
    config.architectures = ["Gemma4ForCausalLM"]
    return config


@pytest.fixture(scope="module", params=["k_eq_v", "separate_v"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return make_pair(_config(request.param == "k_eq_v"), tmp_path_factory.mktemp(request.param))


def test_config_read(pair: Pair) -> None:
    cfg = pair.config
    assert cfg.family == "gemma4" and cfg.final_logit_softcapping == 30.0
    assert cfg.layer_kinds == ("sliding", "full", "sliding", "full")
    full, sliding = cfg.layers[1], cfg.layers[0]
    assert (sliding.head_dim, full.head_dim) == (16, 32)
    assert full.rope.rope_type == "proportional" and full.rope.partial_rotary_factor == 0.25
    k_eq_v = pair.hf.config.attention_k_eq_v
    assert full.k_eq_v == k_eq_v and not sliding.k_eq_v
    assert (full.num_kv_heads == 1) == k_eq_v
    names = {name for name, _ in pair.ours.named_parameters()}
    assert ("model.layers.1.self_attn.v_proj.weight" in names) != k_eq_v
    assert "model.layers.0.self_attn.v_proj.weight" in names
    assert "lm_head.weight" not in names
    assert float(pair.ours.model.layers[1].layer_scalar) != 1.0  # loaded from the checkpoint


def test_prompt_logits_match_hf(pair: Pair) -> None:
    check_prompt_logits(pair)


def test_greedy_matches_hf_generate(pair: Pair) -> None:
    check_greedy(pair)


def test_chunked_prefill_equals_one_shot(pair: Pair) -> None:
    check_chunked_prefill(pair)


def test_batched_step_equals_each_alone(pair: Pair) -> None:
    check_batched_step(pair)


def test_ring_buffer_decoding_far_past_the_window(pair: Pair) -> None:
    check_long_decode(pair, total=80)


def test_truncate_within_ring_slack_then_resume(pair: Pair) -> None:
    check_truncate_and_resume(pair)


def _real_31b_like() -> dict[str, Any]:
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": 262144,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 4,
        "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0,
        "sliding_window": 1024,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 262144,
    }


def test_31b_layout_from_global_keys() -> None:
    cfg = ModelConfig.from_hf(_real_31b_like())
    kinds = cfg.layer_kinds
    assert kinds == ("sliding",) * 5 + ("full",) + kinds[6:] and kinds.count("full") == 10
    full = cfg.layers[5]
    assert (full.head_dim, full.num_kv_heads, full.k_eq_v) == (512, 4, True)
    assert (cfg.layers[0].head_dim, cfg.layers[0].num_kv_heads) == (256, 16)
    assert full.rope.theta == 1e6 and full.rope.rope_type == "proportional"
    # the KV cache of the meta-built model: 50 rings of 1024 + slack, 10 full layers
    from worker.models.registry import build_model

    model = build_model(cfg, "meta", torch.bfloat16)
    assert model.model.layers[5].self_attn.v_proj is None
    kv = model.make_kv_cache(1, 4096)  # on meta: sizes without memory
    sliding = 50 * 2 * 16 * (1024 + kv.ring_slack) * 256 * 2
    full = 10 * 2 * 4 * 4096 * 512 * 2
    assert kv.bytes_per_slot == sliding + full


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("hidden_size_per_layer_input", 256, "per-layer input"),
        ("num_kv_shared_layers", 4, "KV sharing"),
        ("enable_moe_block", True, "mixture-of-experts"),
    ],
)
def test_unsupported_gemma4_features_are_rejected(key: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**_real_31b_like(), key: value})


def test_cpu_packed_weights_match_hf(pair: Pair) -> None:
    check_cpu_packed(pair)
