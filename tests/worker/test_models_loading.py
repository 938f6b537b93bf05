"""build_model on meta / empty storage, load_weights checks, random init."""

from __future__ import annotations

import pytest
import torch

from worker.loading.random_init import init_random_weights
from worker.models.config import ModelConfig
from worker.models.registry import build_model
from worker.models.step import StepInput

torch.set_num_threads(1)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 40,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _state(seed: int, **extra: object) -> dict[str, torch.Tensor]:
    model = build_model(ModelConfig.from_hf({**CONFIG, **extra}), "cpu", torch.float32)
    init_random_weights(model, seed)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_hf_names() -> None:
    names = set(_state(0))
    assert {
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    } <= names
    assert "lm_head.weight" not in _state(0, tie_word_embeddings=True)


def test_meta_build_has_no_storage() -> None:
    model = build_model(ModelConfig.from_hf(CONFIG), "meta", torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())


def test_load_weights_roundtrip_and_dtype_cast() -> None:
    state = _state(3)
    model = build_model(ModelConfig.from_hf(CONFIG), "cpu", torch.bfloat16)
    report = model.load_weights(state.items())
    assert report.loaded == len(state) and not report.missing and not report.unexpected
    loaded = model.state_dict()
    for name, tensor in state.items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16))


def test_load_weights_errors() -> None:
    state = _state(0)
    model = build_model(ModelConfig.from_hf(CONFIG), "cpu", torch.float32)
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(17)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(17,\).*\(16,\)"):
        model.load_weights(bad.items())
    partial = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="missing.*lm_head.weight"):
        model.load_weights(partial.items())
    extra = {**state, "model.layers.9.foo": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.9\.foo"):
        model.load_weights(extra.items())
    report = model.load_weights(extra.items(), strict=False)
    assert report.unexpected == ["model.layers.9.foo"] and not report.missing


def test_tied_head_and_multimodal_names_load() -> None:
    state = _state(1, tie_word_embeddings=True)
    model = build_model(ModelConfig.from_hf({**CONFIG, "tie_word_embeddings": True}), "cpu")
    # checkpoints sometimes carry the tied head, and multimodal ones prefix the text stack
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    renamed["lm_head.weight"] = state["model.embed_tokens.weight"]
    renamed["model.vision_tower.encoder.weight"] = torch.zeros(3)
    report = model.load_weights(renamed.items())
    assert report.loaded == len(state)


def test_random_init_is_deterministic_and_sane() -> None:
    a, b, c = _state(7), _state(7), _state(8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(16))
    assert 0.015 < float(a["model.layers.0.mlp.up_proj.weight"].std()) < 0.025
    gemma = build_model(
        ModelConfig.from_hf({**CONFIG, "architectures": ["Gemma3ForCausalLM"], "head_dim": 4}),
        "cpu",
    )
    init_random_weights(gemma, 0)
    assert torch.equal(gemma.model.norm.weight, torch.zeros(16))  # (1 + w) norm: identity at 0
    kv = gemma.make_kv_cache(1, 16)
    logits = gemma(StepInput.single([1, 2, 3], 0, 0), kv)
    assert logits.shape == (1, 40) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
