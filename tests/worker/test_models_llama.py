"""Llama family vs transformers (fp32, CPU): Llama with llama3 rope scaling, Qwen3 (q/k norm,
tied embeddings), Qwen2 (q/k/v bias), Mistral with a sliding window."""

from __future__ import annotations

from typing import Any

import pytest
from test_models_common import (
    Pair,
    check_batched_step,
    check_chunked_prefill,
    check_cpu_packed,
    check_greedy,
    check_long_decode,
    check_prompt_logits,
    make_pair,
)

SMALL: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
)


def _llama3() -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(
        **SMALL,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def _qwen3() -> Any:
    from transformers import Qwen3Config

    config = Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True, rope_theta=1e6)
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def _qwen2_yarn() -> Any:
    from transformers import Qwen2Config

    config = Qwen2Config(
        **SMALL,
        rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    )
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def _mistral_sliding() -> Any:
    from transformers import MistralConfig

    config = MistralConfig(**SMALL, sliding_window=12, rope_theta=1e4)
    config.architectures = ["MistralForCausalLM"]
    return config


VARIANTS = {
    "llama3": _llama3,
    "qwen3": _qwen3,
    "qwen2_yarn": _qwen2_yarn,
    "mistral": _mistral_sliding,
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return make_pair(VARIANTS[request.param](), tmp_path_factory.mktemp(request.param))


def test_config_read(pair: Pair) -> None:
    cfg = pair.config
    assert cfg.family == "llama"
    arch = cfg.architecture
    assert cfg.qk_norm == (arch == "Qwen3ForCausalLM")
    assert cfg.qkv_bias == (arch == "Qwen2ForCausalLM")
    assert cfg.tie_word_embeddings == (arch == "Qwen3ForCausalLM")
    has_head = any(name == "lm_head.weight" for name, _ in pair.ours.named_parameters())
    assert has_head != cfg.tie_word_embeddings
    if arch == "MistralForCausalLM":
        assert cfg.layer_kinds == ("sliding", "sliding") and cfg.sliding_window == 12


def test_prompt_logits_match_hf(pair: Pair) -> None:
    check_prompt_logits(pair)


def test_greedy_matches_hf_generate(pair: Pair) -> None:
    check_greedy(pair)


def test_chunked_prefill_equals_one_shot(pair: Pair) -> None:
    check_chunked_prefill(pair)


def test_batched_step_equals_each_alone(pair: Pair) -> None:
    check_batched_step(pair)


def test_long_decode(pair: Pair) -> None:
    if pair.config.architecture == "MistralForCausalLM":
        check_long_decode(pair, total=80)
    else:
        pytest.skip("only the sliding-window variant has a ring")


def test_cpu_packed_weights_match_hf(pair: Pair) -> None:
    check_cpu_packed(pair)
