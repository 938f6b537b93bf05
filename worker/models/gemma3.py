"""Gemma 3 text stack (Gemma3ForCausalLM / gemma3_text; the text part of the multimodal ones).

Sandwich-norm decoder layers with Gemma RMSNorm (normed * (1 + w)), q/k norms, attention scale
query_pre_attn_scalar**-0.5, sliding layers (window, local rope base) and full layers (global rope
base, optional rope scaling), embeddings times sqrt(hidden) in the compute dtype, gelu-tanh MLP,
optional attention and final logit soft-capping. All of it is read from ModelConfig.
"""

from __future__ import annotations

import torch

from worker.layers.blocks import GEMMA3_NORM, SandwichDecoderLayer
from worker.models.causal_lm import CausalLM
from worker.models.config import ModelConfig


def build_gemma3(config: ModelConfig, dtype: torch.dtype) -> CausalLM:
    def make_layer(cfg: ModelConfig, i: int) -> SandwichDecoderLayer:
        return SandwichDecoderLayer(cfg, i, GEMMA3_NORM, dtype=dtype)

    return CausalLM(config, make_layer, GEMMA3_NORM, scale_embeddings=True, dtype=dtype)
