"""Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), SmolLM2.

Pre-norm decoder layers, llama RMSNorm (weight * normed.to(dtype)), SiLU gated MLP, unscaled
embeddings, lm_head tied when ``tie_word_embeddings``. The differences are all in ModelConfig.
"""

from __future__ import annotations

import torch

from worker.layers.blocks import LLAMA_NORM, PreNormDecoderLayer
from worker.models.causal_lm import CausalLM
from worker.models.config import ModelConfig


def build_llama(config: ModelConfig, dtype: torch.dtype) -> CausalLM:
    def make_layer(cfg: ModelConfig, i: int) -> PreNormDecoderLayer:
        return PreNormDecoderLayer(cfg, i, dtype=dtype)

    return CausalLM(config, make_layer, LLAMA_NORM, scale_embeddings=False, dtype=dtype)
