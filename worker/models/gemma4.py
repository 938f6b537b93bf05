"""Gemma 4 text stack (Gemma4ForCausalLM / gemma4_text), as used by Gemma 4 31B.

Differences from Gemma 3: RMSNorm multiplies by w (not 1 + w); attention scale 1.0 (q/k norms
do the scaling); a weightless RMS norm on V; full layers may have their own head_dim and KV heads
and, with ``attention_k_eq_v``, no v_proj (V is the k projection before k_norm and rotary);
full layers use proportional partial RoPE; every layer ends by multiplying with its
``layer_scalar`` buffer. Per-layer input embeddings, KV sharing and MoE blocks (other Gemma 4
sizes) are rejected by ModelConfig.from_hf.
"""

from __future__ import annotations

import torch

from worker.layers.blocks import GEMMA4_NORM, SandwichDecoderLayer
from worker.models.causal_lm import CausalLM
from worker.models.config import ModelConfig


def build_gemma4(config: ModelConfig, dtype: torch.dtype) -> CausalLM:
    def make_layer(cfg: ModelConfig, i: int) -> SandwichDecoderLayer:
        return SandwichDecoderLayer(
            cfg, i, GEMMA4_NORM, v_norm=True, layer_scalar=True, dtype=dtype
        )

    return CausalLM(config, make_layer, GEMMA4_NORM, scale_embeddings=True, dtype=dtype)
