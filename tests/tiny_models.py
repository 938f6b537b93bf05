"""Tiny checkpoints for tests: a byte-level tokenizer.json, small configs, tensor shapes.

Imported by name (`from tiny_models import ...`; pyproject puts tests/ on the path), since
several test folders have a conftest.py and `from conftest import` is ambiguous.
"""

from __future__ import annotations

import json
from typing import Any


def byte_level_tokenizer_json(extra_tokens: int = 0) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json: 256 byte tokens, a few merges, <bos>/<eos>/<eot>."""
    import tokenizers
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    from worker.loading.tokenizer import byte_level_decoder

    alphabet = sorted(byte_level_decoder(), key=lambda ch: byte_level_decoder()[ch])
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    for i in range(extra_tokens):
        vocab[f"tok{i}"] = len(vocab)
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<bos>", "<eos>", "<eot>")]
    )
    bos = backend.token_to_id("<bos>")
    backend.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0", pair="<bos>:0 $A:0 $B:1", special_tokens=[("<bos>", bos)]
    )
    return json.loads(backend.to_str())


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 256 + 4,
        "eos_token_id": 256 + 5,
        "torch_dtype": "float32",
    }
    if family == "llama":
        common.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
    else:
        raise ValueError(family)
    common.update(overrides)
    return common


def llama_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    return shapes
