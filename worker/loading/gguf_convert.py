"""GGUF file -> a cached directory in Hugging Face layout.

The first load of a `.gguf` reads it with the `gguf` package, dequantizes every tensor to the
storage dtype, renames it to its Hugging Face name (undoing llama.cpp's changes: the Q/K row
permutation of llama, Gemma's norm weights stored as 1+w), rebuilds the tokenizer from the GGUF
vocabulary, and writes

    <cache>/gguf/<stem>-<key>-<dtype>/
        model.safetensors (or shards + model.safetensors.index.json)
        config.json               the config transformers builds from this GGUF
        tokenizer.json            a `tokenizers` Tokenizer rebuilt from the vocabulary
        tokenizer_config.json     BOS/EOS/add-BOS and `tokenizer.chat_template`
        generation_config.json    EOS ids
        gguf_source.json          where it came from

`<key>` hashes the file's size, modification time and its first bytes (the header), so a
changed file converts again. The directory is written under a temporary name and renamed into
place, so a crash never leaves a half-written cache behind; a lock file keeps two processes
from converting the same file at once. Later loads read the directory like any checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.loading.checkpoint import TORCH_TO_SAFETENSORS, ModelLoadError

CONVERTER_VERSION = 3
HEADER_HASH_BYTES = 16 * 1024 * 1024
MAX_SHARD_BYTES = 4 * 1024**3
SUPPORTED_GGUF_ARCHITECTURES = ("gemma3", "gemma4", "llama", "qwen35moe")

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)

# ---------------------------------------------------------------------------------------------
# Cache location and identity


def cache_root() -> Path:
    """`$TOKENPIPE_CACHE/gguf`, default `~/.cache/tokenpipe/gguf`."""
    from worker import cache_dir

    return cache_dir("gguf")


def gguf_identity_key(path: Path) -> str:
    """A short hash of the file's size, mtime and header bytes (plus the converter version)."""
    stat = path.stat()
    digest = hashlib.sha256()
    digest.update(f"v{CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with path.open("rb") as handle:
        digest.update(handle.read(HEADER_HASH_BYTES))
    return digest.hexdigest()[:20]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cached_dir_for(
    path: Path, dtype: torch.dtype, root: Path | None = None, weights: bool = True
) -> Path:
    """The cache directory this GGUF file converts to (it may not exist yet): with the weights
    dequantized into `dtype`, or (``weights=False``) its config and tokenizer only."""
    root = cache_root() if root is None else root
    suffix = dtype_name(dtype) if weights else "meta"
    return root / f"{path.stem}-{gguf_identity_key(path)}-{suffix}"


# ---------------------------------------------------------------------------------------------
# Progress on stderr


class Progress:
    """A one-line progress bar on stderr (a no-op when disabled)."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.done = 0
        self.started = time.monotonic()
        self.last_draw = 0.0

    def advance(self, count: int = 1) -> None:
        self.done += count
        now = time.monotonic()
        if self.enabled and (now - self.last_draw > 0.2 or self.done >= self.total):
            self.last_draw = now
            width = 30
            filled = min(width, width * self.done // self.total)
            bar = "#" * filled + "-" * (width - filled)
            sys.stderr.write(
                f"\r{self.label} [{bar}] {self.done}/{self.total} {now - self.started:5.1f}s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Reading GGUF metadata


def open_reader(path: Path) -> Any:
    """A `gguf.GGUFReader`, with a corrupt or truncated file reported as ModelLoadError."""
    from gguf import GGUFReader

    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic {magic!r})")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors alike
        raise ModelLoadError(
            f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc}); re-download it"
        ) from exc
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {tensor.name!r} ends past the end of the file"
            )
    return reader


def metadata(reader: Any) -> dict[str, Any]:
    """All GGUF key/values as Python values (strings decoded, arrays as lists)."""
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            values[key] = field.contents()
        except Exception as exc:
            raise ModelLoadError(f"corrupt GGUF metadata field {key!r}: {exc}") from exc
    return values


# ---------------------------------------------------------------------------------------------
# Config: what transformers builds from each architecture's GGUF metadata


def require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelLoadError(f"GGUF file lacks the metadata key {key!r}")
    return meta[key]


def vocab_size_of(meta: dict[str, Any], arch: str) -> int:
    if f"{arch}.vocab_size" in meta:
        return int(meta[f"{arch}.vocab_size"])
    return len(require(meta, "tokenizer.ggml.tokens"))


def special_ids(meta: dict[str, Any]) -> dict[str, int]:
    names = {
        "bos_token_id": "tokenizer.ggml.bos_token_id",
        "eos_token_id": "tokenizer.ggml.eos_token_id",
        "pad_token_id": "tokenizer.ggml.padding_token_id",
        "unk_token_id": "tokenizer.ggml.unknown_token_id",
    }
    return {name: int(meta[key]) for name, key in names.items() if key in meta}


def gemma3_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Gemma3ForCausalLM's config.json for a gemma3 GGUF (text stack only).

    GGUF leaves out what transformers takes from Gemma3TextConfig's defaults: local RoPE base
    10000, five sliding layers to one full, query_pre_attn_scalar = head_dim (llama.cpp uses
    hidden/heads for the 27B model, whose checkpoint says so; we follow it there).
    """
    arch = "gemma3"
    layers = int(require(meta, f"{arch}.block_count"))
    hidden = int(require(meta, f"{arch}.embedding_length"))
    heads = int(require(meta, f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", 256))
    rope_theta = float(meta.get(f"{arch}.rope.freq_base", 1_000_000.0))
    local_base = 10_000.0
    pattern = int(meta.get(f"{arch}.attention.sliding_window_pattern", 6))
    layer_types = [
        "full_attention" if (index + 1) % pattern == 0 else "sliding_attention"
        for index in range(layers)
    ]
    is_27b = layers == 62 and hidden == 5376
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size_of(meta, arch),
        "hidden_size": hidden,
        "intermediate_size": int(require(meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 32768)),
        "initializer_range": 0.02,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "use_cache": True,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
            "full_attention": {"rope_type": "default", "rope_theta": rope_theta},
        },
        "rope_theta": rope_theta,
        "rope_local_base_freq": local_base,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": hidden // heads if is_27b else head_dim,
        "sliding_window": int(meta.get(f"{arch}.attention.sliding_window", 512)),
        "sliding_window_pattern": pattern,
        "layer_types": layer_types,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "torch_dtype": "float32",
    }
    config.update(special_ids(meta))
    return config


def _per_layer(meta: dict[str, Any], key: str, layers: int, default: Any) -> list[Any]:
    """A GGUF hyperparameter that may be one value or one per layer, as a per-layer list."""
    value = meta.get(key, default)
    if isinstance(value, list):
        if len(value) != layers:
            raise ModelLoadError(f"GGUF key {key!r} has {len(value)} entries for {layers} layers")
        return value
    return [value] * layers


def _one_value(values: list[Any], what: str) -> Any:
    if len(set(values)) > 1:
        raise ModelLoadError(
            f"GGUF file: {what} differ from layer to layer ({sorted(set(values))})"
        )
    return values[0]


def gemma4_config(
    meta: dict[str, Any], tensor_names: set[str], small_tensor: SmallTensorReader
) -> dict[str, Any]:
    """Gemma4ForCausalLM's config.json for a gemma4 GGUF (text stack only), as llama.cpp's
    converter writes one: per-layer sliding pattern and KV head counts, the full layers' head
    size in ``key_length`` and the sliding layers' in ``key_length_swa``, no ``attn_v`` on full
    layers whose V is their K (``attention_k_eq_v``), and the full layers' proportional partial
    RoPE as a ``rope_freqs`` tensor (1 for a rotated pair of dimensions, 1e30 for one left alone).
    Features of the other Gemma 4 sizes are refused here, before any tensor is converted."""
    arch = "gemma4"
    layers = int(require(meta, f"{arch}.block_count"))
    hidden = int(require(meta, f"{arch}.embedding_length"))
    if int(meta.get(f"{arch}.embedding_length_per_layer_input", 0) or 0):
        raise ModelLoadError(
            "gemma4 GGUF: per-layer input embeddings (the E2B/E4B sizes) are not supported"
        )
    if int(meta.get(f"{arch}.attention.shared_kv_layers", 0) or 0):
        raise ModelLoadError("gemma4 GGUF: KV sharing across layers is not supported")
    if int(meta.get(f"{arch}.expert_count", 0) or 0):
        raise ModelLoadError(
            "gemma4 GGUF: mixture-of-experts blocks (the 26B A4B size) are not supported"
        )
    heads = int(
        _one_value(
            _per_layer(meta, f"{arch}.attention.head_count", layers, None), "attention head counts"
        )
    )
    ffn = int(
        _one_value(
            _per_layer(meta, f"{arch}.feed_forward_length", layers, None),
            "feed-forward widths (use_double_wide_mlp)",
        )
    )
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [
            bool(x)
            for x in _per_layer(meta, f"{arch}.attention.sliding_window_pattern", layers, None)
        ]
    else:
        period = int(pattern or 6)
        sliding = [(index + 1) % period != 0 for index in range(layers)]
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    full_layers = [i for i, s in enumerate(sliding) if not s]
    sliding_layers = [i for i, s in enumerate(sliding) if s]

    full_head_dim = int(meta.get(f"{arch}.attention.key_length", 512))
    head_dim = int(meta.get(f"{arch}.attention.key_length_swa", full_head_dim))
    kv = [int(x) for x in _per_layer(meta, f"{arch}.attention.head_count_kv", layers, heads)]
    without_v = [i for i in full_layers if f"blk.{i}.attn_v.weight" not in tensor_names]
    if any(f"blk.{i}.attn_v.weight" not in tensor_names for i in sliding_layers):
        raise ModelLoadError("gemma4 GGUF: a sliding layer has no attn_v tensor")
    if without_v and len(without_v) != len(full_layers):
        raise ModelLoadError("gemma4 GGUF: only some full-attention layers have an attn_v tensor")
    k_eq_v = bool(without_v)
    kv_sliding = _one_value([kv[i] for i in sliding_layers] or [kv[0]], "KV head counts")
    kv_full = _one_value([kv[i] for i in full_layers] or [kv_sliding], "KV head counts")
    if kv_full != kv_sliding and not k_eq_v:
        raise ModelLoadError(
            "gemma4 GGUF: full layers with their own KV head count must take V from K "
            "(attention_k_eq_v), as Gemma 4's config ties the two"
        )

    rotated_swa = int(meta.get(f"{arch}.rope.dimension_count_swa", head_dim))
    sliding_rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base_swa", 10_000.0)),
    }
    if rotated_swa != head_dim:
        sliding_rope["partial_rotary_factor"] = rotated_swa / head_dim
    freqs = small_tensor("rope_freqs.weight")
    if freqs is not None:  # 1 rotates a pair of dimensions, 1e30 leaves it alone
        partial = 2 * int(np.count_nonzero(freqs < 1e10)) / full_head_dim
    else:
        partial = int(meta.get(f"{arch}.rope.dimension_count", full_head_dim)) / full_head_dim
    full_rope = {
        "rope_type": "proportional",
        "partial_rotary_factor": partial,
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 1_000_000.0)),
    }
    softcap = meta.get(f"{arch}.final_logit_softcapping")
    config: dict[str, Any] = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": vocab_size_of(meta, arch),
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_sliding,
        "num_global_key_value_heads": kv_full if k_eq_v else None,
        "head_dim": head_dim,
        "global_head_dim": full_head_dim,
        "attention_k_eq_v": k_eq_v,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 262_144)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_parameters": {"sliding_attention": sliding_rope, "full_attention": full_rope},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": int(meta.get(f"{arch}.attention.sliding_window", 1024)),
        "layer_types": layer_types,
        "final_logit_softcapping": float(softcap) if softcap else None,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    config.update(special_ids(meta))
    return config


def text_layers(meta: dict[str, Any], arch: str) -> int | None:
    """The text model's layer count: llama.cpp appends multi-token-prediction blocks after it
    (``nextn_predict_layers`` of them), which the model does not use."""
    blocks = meta.get(f"{arch}.block_count")
    if blocks is None:
        return None
    return int(blocks) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)


def qwen35moe_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Qwen3_5MoeForCausalLM's config.json for a qwen35moe GGUF (text stack only), as llama.cpp's
    converter writes one: the Gated DeltaNet sizes under ``ssm.*`` (group count = key heads,
    time-step rank = value heads, state size = key head size, inner size = value heads x value
    head size), the full-attention layers those with an ``attn_q`` tensor, the rotary share as
    ``rope.dimension_count`` / head size, MTP blocks after the text layers."""
    arch = "qwen35moe"
    layers = text_layers(meta, arch)
    if layers is None:
        raise ModelLoadError(f"GGUF file lacks the metadata key '{arch}.block_count'")
    heads = int(require(meta, f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", 256))
    value_heads = int(require(meta, f"{arch}.ssm.time_step_rank"))
    inner = int(require(meta, f"{arch}.ssm.inner_size"))
    rotated = int(meta.get(f"{arch}.rope.dimension_count", head_dim // 4))
    layer_types = [
        "full_attention" if f"blk.{i}.attn_q.weight" in tensor_names else "linear_attention"
        for i in range(layers)
    ]
    config: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size_of(meta, arch),
        "hidden_size": int(require(meta, f"{arch}.embedding_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": int(require(meta, f"{arch}.ssm.conv_kernel")),
        "linear_key_head_dim": int(require(meta, f"{arch}.ssm.state_size")),
        "linear_num_key_heads": int(require(meta, f"{arch}.ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "num_experts": int(require(meta, f"{arch}.expert_count")),
        "num_experts_per_tok": int(require(meta, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(require(meta, f"{arch}.expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(
            require(meta, f"{arch}.expert_shared_feed_forward_length")
        ),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 262_144)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10_000_000.0)),
            "partial_rotary_factor": rotated / head_dim,
        },
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "use_cache": True,
    }
    config.update(special_ids(meta))
    return config


def llama_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """LlamaForCausalLM's config.json for a llama GGUF."""
    arch = "llama"
    hidden = int(require(meta, f"{arch}.embedding_length"))
    heads = int(require(meta, f"{arch}.attention.head_count"))
    head_dim = int(
        meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", 0))
        or hidden // heads
    )
    rope_theta = float(meta.get(f"{arch}.rope.freq_base", 10_000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size_of(meta, arch),
        "hidden_size": hidden,
        "intermediate_size": int(require(meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(require(meta, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "initializer_range": 0.02,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "use_cache": True,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_scaling": None,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    config.update(special_ids(meta))
    return config


SmallTensorReader = Callable[[str], "np.ndarray | None"]
CONFIG_BUILDERS: dict[
    str, Callable[[dict[str, Any], set[str], SmallTensorReader], dict[str, Any]]
] = {
    "gemma3": lambda meta, names, _: gemma3_config(meta, names),
    "gemma4": gemma4_config,
    "llama": lambda meta, names, _: llama_config(meta, names),
    "qwen35moe": lambda meta, names, _: qwen35moe_config(meta, names),
}

# ---------------------------------------------------------------------------------------------
# Tensor names and the value changes llama.cpp made

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA_SANDWICH_NAMES = {
    **BLOCK_NAMES_COMMON,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
BLOCK_NAMES = {
    "llama": {**BLOCK_NAMES_COMMON, "ffn_norm": "post_attention_layernorm"},
    "gemma3": GEMMA_SANDWICH_NAMES,
    "gemma4": GEMMA_SANDWICH_NAMES,
    "qwen35moe": {
        **BLOCK_NAMES_COMMON,
        "post_attention_norm": "post_attention_layernorm",
        "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z",
        "ssm_beta": "linear_attn.in_proj_b",
        "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_out": "linear_attn.out_proj",
        "ssm_norm": "linear_attn.norm",
        "ssm_conv1d": "linear_attn.conv1d",
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
}
# a block tensor whose HF counterpart is a bare parameter or buffer, not a module's ".weight".
# qwen35moe's ffn_gate_exps / ffn_up_exps ([E, I, H] each) are the halves of the fused
# gate_up_proj; they are handed on one expert at a time (`expert_pieces`).
BLOCK_BUFFERS = {
    "gemma4": {"layer_output_scale": "layer_scalar"},
    "qwen35moe": {
        "ssm_a": "linear_attn.A_log",
        "ssm_dt": "linear_attn.dt_bias",
        "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
    },
}
SKIPPED_TENSORS = ("rope_freqs.weight",)  # llama 3 RoPE factors: not an HF parameter


def hf_tensor_name(arch: str, gguf_name: str, layers: int | None = None) -> str | None:
    """The HF parameter name of a GGUF tensor, or None when it has no HF counterpart (blocks
    from `layers` on are llama.cpp's multi-token-prediction head: skipped)."""
    if gguf_name in SKIPPED_TENSORS:
        return None
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    is_block = len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit()
    if is_block and layers is not None and int(parts[1]) >= layers:
        return None
    if is_block and len(parts) in (3, 4):
        buffer = BLOCK_BUFFERS.get(arch, {}).get(parts[2])
        if buffer is not None and (len(parts) == 3 or parts[3] in ("weight", "bias")):
            return f"model.layers.{parts[1]}.{buffer}"
        target = BLOCK_NAMES[arch].get(parts[2])
        if target is not None:
            return f"model.layers.{parts[1]}.{target}.{parts[3]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no known {arch} counterpart")


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, rows were reordered from HF's
    [first halves..., second halves...] rotary layout to interleaved pairs.

    weight: [heads * head_dim, ...] in GGUF order -> same shape in HF order.
    """
    head_dim = weight.shape[0] // heads
    grouped = weight.reshape(heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def untile_v_heads(values: np.ndarray, axis: int, config: dict[str, Any], head_dim: int) -> Any:
    """Undo llama.cpp's order of Gated DeltaNet value heads along `axis`: it stores them tiled
    over the key heads ([per key head][key head][head_dim]); HF groups them by key head
    ([key head][per key head][head_dim]). A no-op when there are as many of each."""
    keys, per_key = config["linear_num_key_heads"], config["linear_per_key"]
    if per_key == 1:
        return values
    moved = np.moveaxis(values, axis, 0)
    rest = moved.shape[1:]
    grouped = moved.reshape(per_key, keys, head_dim, *rest).swapaxes(0, 1)
    return np.moveaxis(grouped.reshape(-1, *rest), 0, axis)


def qwen35_row_order(gguf_name: str, rows: int, config: dict[str, Any]) -> np.ndarray | None:
    """The HF order of a qwen35moe matrix's rows (indices into the GGUF's), or None when
    llama.cpp kept them in HF order."""
    parts = gguf_name.split(".")
    kind = parts[2] if len(parts) > 2 and parts[0] == "blk" else ""
    value_dim = config["linear_value_head_dim"]
    if kind == "attn_qkv":  # q and k rows, then the value heads
        qk = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
        v = untile_v_heads(np.arange(qk, rows), 0, config, value_dim)
        return np.concatenate([np.arange(qk), v])
    if kind == "attn_gate":
        return untile_v_heads(np.arange(rows), 0, config, value_dim)
    if kind in ("ssm_alpha", "ssm_beta"):
        return untile_v_heads(np.arange(rows), 0, config, 1)
    return None


def qwen35_values(gguf_name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """llama.cpp's qwen35moe changes undone: norms stored as 1 + w (except the DeltaNet
    output norm), ssm_a = -exp(A_log), conv1d squeezed to [C, K], value heads tiled."""
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else gguf_name
    if gguf_name.endswith("norm.weight") and kind != "ssm_norm":
        return values - np.float32(1.0)
    if kind == "ssm_a":
        return np.log(-untile_v_heads(values, 0, config, 1))
    if kind == "ssm_dt":
        return untile_v_heads(values, 0, config, 1)
    if kind == "ssm_conv1d":  # [C, K]: q and k channels, then the value heads'
        qk = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
        v = untile_v_heads(values[qk:], 0, config, config["linear_value_head_dim"])
        return np.concatenate([values[:qk], v])[:, None, :]
    if kind == "ssm_out":  # columns: the value heads
        return untile_v_heads(values, 1, config, config["linear_value_head_dim"])
    order = qwen35_row_order(gguf_name, values.shape[0], config) if values.ndim == 2 else None
    return values if order is None else values[order]


def gguf_layout(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The sizes the value changes need, from the GGUF's metadata."""
    heads = meta.get(f"{arch}.attention.head_count")
    layout: dict[str, Any] = {
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
    }
    if arch == "qwen35moe":
        keys = int(require(meta, f"{arch}.ssm.group_count"))
        values = int(require(meta, f"{arch}.ssm.time_step_rank"))
        layout.update(
            linear_num_key_heads=keys,
            linear_per_key=values // keys,
            linear_key_head_dim=int(require(meta, f"{arch}.ssm.state_size")),
            linear_value_head_dim=int(require(meta, f"{arch}.ssm.inner_size")) // values,
        )
    return layout


def expert_pieces(
    name: str, values: Any, take: Callable[[int, int, int], Any] | None = None
) -> Iterator[tuple[str, Any]]:
    """A stacked-experts tensor (``mlp.experts.gate_proj`` / ``up_proj`` [E, I, H], the fused
    ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) as the per-expert tensors the model's
    loader takes, one expert's rows at a time; any other tensor as it is. ``take(expert,
    first_row, end_row)`` cuts a piece (default: ``values[expert, first_row:end_row]``)."""
    prefix, _, kind = name.rpartition(".")
    if not prefix.endswith(".mlp.experts"):
        yield name, values
        return
    count, rows = values.shape[0], values.shape[1]
    cut = take or (lambda expert, first, end: values[expert, first:end])
    for expert in range(count):
        if kind == "gate_up_proj":
            yield f"{prefix}.{expert}.gate_proj.weight", cut(expert, 0, rows // 2)
            yield f"{prefix}.{expert}.up_proj.weight", cut(expert, rows // 2, rows)
        else:
            yield f"{prefix}.{expert}.{kind}.weight", cut(expert, 0, rows)


def hf_tensor_values(
    arch: str, gguf_name: str, values: np.ndarray, config: dict[str, Any]
) -> np.ndarray:
    """Turn a dequantized GGUF tensor's values into the HF parameter's values."""
    if arch == "qwen35moe":
        return qwen35_values(gguf_name, values, config)
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return values - np.float32(1.0)  # llama.cpp stores Gemma 3's (1 + w); Gemma 4's is w
    if arch == "llama" and ".attn_q." in gguf_name and values.ndim >= 1:
        return unpermute_rows(values, config["num_attention_heads"])
    if arch == "llama" and ".attn_k." in gguf_name and values.ndim >= 1:
        return unpermute_rows(values, config["num_key_value_heads"])
    return values


# ---------------------------------------------------------------------------------------------
# Streaming safetensors writer


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # HF name
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(tensors: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Split tensors, in order, into shards of at most `max_bytes` (a big tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return [shard for shard in shards if shard]


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor: the header first (shapes are known up
    front), then each tensor's bytes in the planned order, so only one tensor is in memory."""

    def __init__(self, path: Path, tensors: list[PlannedTensor]) -> None:
        self.order = [t.name for t in tensors]
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor in tensors:
            header[tensor.name] = {
                "dtype": TORCH_TO_SAFETENSORS[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + tensor.nbytes],
            }
            offset += tensor.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.handle = path.open("wb")
        self.handle.write(len(raw).to_bytes(8, "little") + raw)
        self.planned = {t.name: t for t in tensors}
        self.written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.order[self.written] != name:
            raise RuntimeError(f"tensor {name!r} written out of order")
        planned = self.planned[name]
        if tuple(tensor.shape) != planned.shape or tensor.dtype != planned.dtype:
            raise RuntimeError(f"tensor {name!r} does not match its planned shape/dtype")
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        self.handle.write(memoryview(data))
        self.written += 1

    def close(self) -> None:
        self.handle.close()


# ---------------------------------------------------------------------------------------------
# The conversion


def dequantized(tensor: Any) -> np.ndarray:
    """One GGUF tensor's values as float32 in HF (row-major, outermost first) shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(tensor.tensor_type)
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        values = dequantize(np.asarray(tensor.data), kind)
    else:
        values = dequantize(tensor.data, kind)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    return values if values.flags.writeable else values.copy()  # F32 data is a read-only map


def iter_hf_tensors(
    reader: Any, arch: str, config: dict[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    layers = int(config["num_hidden_layers"])
    for tensor in reader.tensors:
        name = hf_tensor_name(arch, tensor.name, layers)
        if name is None:
            continue
        try:
            values = dequantized(tensor)
        except Exception as exc:
            raise ModelLoadError(
                f"cannot dequantize GGUF tensor {tensor.name!r} ({exc}); corrupt file?"
            ) from exc
        yield name, hf_tensor_values(arch, tensor.name, values, config)


def save_tokenizer(backend: Any, path: Path) -> None:
    """Save a tokenizers Tokenizer; merges as "left right" strings when no piece has a space
    (the older, equivalent spelling tokenizers parses about a third faster than pairs)."""
    document = json.loads(backend.to_str())
    merges = document.get("model", {}).get("merges")
    if merges and isinstance(merges[0], list):
        if not any(" " in left or " " in right for left, right in merges):
            document["model"]["merges"] = [f"{left} {right}" for left, right in merges]
    path.write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_into(
    gguf_path: Path, out_dir: Path, dtype: torch.dtype, progress: bool, weights: bool = True
) -> None:
    """Convert `gguf_path` into `out_dir` (an empty directory); without `weights`, only its
    config, tokenizer and source (what a load that reads the tensors from the GGUF needs)."""
    from worker.loading.tokenizer import build_gguf_tokenizer, write_token_bytes_sidecar

    if progress:
        what = "converting it once" if weights else "reading its config and tokenizer once"
        print(f"reading {gguf_path} (first use: {what} into {out_dir.parent})",
              file=sys.stderr, flush=True)  # fmt: skip
    reader = open_reader(gguf_path)
    meta = metadata(reader)
    arch = str(meta.get("general.architecture", ""))
    if arch not in CONFIG_BUILDERS:
        raise ModelLoadError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    by_name = {t.name: t for t in reader.tensors}

    def small_tensor(name: str) -> np.ndarray | None:
        tensor = by_name.get(name)
        return None if tensor is None else dequantized(tensor)

    config = CONFIG_BUILDERS[arch](meta, set(by_name), small_tensor)
    config["torch_dtype"] = dtype_name(dtype)

    if weights and arch == "qwen35moe":
        raise ModelLoadError(
            f"{gguf_path}: a qwen35moe GGUF is read in place; no dequantized copy is written"
        )
    planned = [
        PlannedTensor(name, tuple(int(d) for d in reversed(t.shape.tolist())), dtype)
        for t in reader.tensors
        if (name := hf_tensor_name(arch, t.name, text_layers(meta, arch))) is not None
    ]
    if not weights:
        config.pop("torch_dtype", None)  # no weights here: they stay in the GGUF
        planned = []
    shards = plan_shards(planned, MAX_SHARD_BYTES)
    bar = Progress(f"converting {gguf_path.name}", len(planned) + 1, progress)

    tokenizer_files = build_gguf_tokenizer(meta, arch)
    save_tokenizer(tokenizer_files.backend, out_dir / "tokenizer.json")
    write_token_bytes_sidecar(out_dir / "tokenizer.json")
    write_json(out_dir / "tokenizer_config.json", tokenizer_files.tokenizer_config)
    write_json(out_dir / "generation_config.json", tokenizer_files.generation_config)
    bar.advance()

    weight_map: dict[str, str] = {}
    tensors = iter_hf_tensors(reader, arch, config)
    for index, shard in enumerate(shards):
        filename = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        writer = SafetensorsWriter(out_dir / filename, shard)
        try:
            for planned_tensor in shard:
                name, values = next(tensors)
                if name != planned_tensor.name:
                    raise RuntimeError(
                        f"GGUF tensor order changed: {name} != {planned_tensor.name}"
                    )
                writer.write(name, torch.from_numpy(values).to(dtype))
                weight_map[name] = filename
                bar.advance()
        finally:
            writer.close()
    if len(shards) > 1:
        total = sum(t.nbytes for t in planned)
        write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    write_json(out_dir / "config.json", config)
    write_json(
        out_dir / "gguf_source.json",
        {
            "path": str(gguf_path),
            "size": gguf_path.stat().st_size,
            "architecture": arch,
            "name": meta.get("general.name"),
            "file_type": meta.get("general.file_type"),
            "converter_version": CONVERTER_VERSION,
            "dtype": dtype_name(dtype) if weights else None,
            "weights": weights,
        },
    )
    bar.close()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    root: Path | None = None,
    weights: bool = True,
) -> Path:
    """The cached HF-layout directory of a GGUF file, converting it on first use.

    Without `weights` the directory holds the config and tokenizer only (seconds, a few MB):
    enough for a load that reads every tensor from the GGUF itself (``--quantize auto``) and for
    `info`. A directory with the weights in `dtype`, made earlier, serves such a call too.
    Thread/process safe: concurrent callers wait on a lock and reuse one conversion.
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if not weights and cached_dir_for(path, dtype, root).is_dir():
        return cached_dir_for(path, dtype, root)
    target = cached_dir_for(path, dtype, root, weights)
    if target.is_dir():
        return target
    with file_lock(target.parent / f".{target.name}.lock"):
        if target.is_dir():
            return target
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        os.chmod(scratch, 0o755)
        try:
            convert_into(path, scratch, dtype, progress, weights)
            try:
                os.rename(scratch, target)
            except OSError:
                if not target.is_dir():  # another process won the race: reuse its directory
                    raise
                shutil.rmtree(scratch, ignore_errors=True)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    with contextlib.suppress(OSError):
        (target.parent / f".{target.name}.lock").unlink()
    return target
