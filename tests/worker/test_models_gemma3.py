"""Gemma 3 vs transformers (fp32, CPU): sliding + full layers, window 8, rope scaling, softcaps."""

from __future__ import annotations

import pytest
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


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        sliding_window=8,
        query_pre_attn_scalar=24,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_theta=10_000.0,
        rope_local_base_freq=100.0,
        attn_logit_softcapping=50.0,  # transformers' Gemma 3 ignores it; so do we
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        eos_token_id=None,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    return make_pair(config, tmp_path_factory.mktemp("gemma3"))


def test_config_read(pair: Pair) -> None:
    cfg = pair.config
    assert cfg.family == "gemma3"
    assert cfg.layer_kinds == ("sliding", "sliding", "full", "sliding")
    assert cfg.sliding_window == 8 and cfg.tie_word_embeddings
    assert cfg.layers[2].rope.rope_type == "linear" and cfg.layers[0].rope.theta == 100.0


def test_prompt_logits_match_hf(pair: Pair) -> None:
    check_prompt_logits(pair)


def test_greedy_matches_hf_generate(pair: Pair) -> None:
    check_greedy(pair)


def test_chunked_prefill_equals_one_shot(pair: Pair) -> None:
    check_chunked_prefill(pair)


def test_batched_step_equals_each_alone(pair: Pair) -> None:
    check_batched_step(pair)


def test_ring_buffer_decoding_far_past_the_window(pair: Pair) -> None:
    check_long_decode(pair, total=90)


def test_truncate_within_ring_slack_then_resume(pair: Pair) -> None:
    check_truncate_and_resume(pair)


def test_cpu_packed_weights_match_hf(pair: Pair) -> None:
    check_cpu_packed(pair)
