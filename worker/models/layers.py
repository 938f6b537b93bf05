"""The building blocks every family shares: norms, the gated MLP, attention, decoder layers.

Module and parameter names follow Hugging Face so a checkpoint loads by name. All modules take
the flattened step layout: hidden states are [T, hidden] (no batch dimension).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.attention import AttentionPlan, attend
from worker.models.config import ModelConfig
from worker.models.kv import LayerCache
from worker.models.rope import apply_rotary


@dataclass(frozen=True)
class NormStyle:
    """How a family's RMSNorm applies its weight.

    llama:  weight * x_normed.to(dtype)          (offset 0, scale_in_float False)
    gemma3: (x_normed * (1 + weight)).to(dtype)  (offset 1, scale_in_float True)
    gemma4: (x_normed * weight).to(dtype)        (offset 0, scale_in_float True)
    """

    offset: float
    scale_in_float: bool


LLAMA_NORM = NormStyle(offset=0.0, scale_in_float=False)
GEMMA3_NORM = NormStyle(offset=1.0, scale_in_float=True)
GEMMA4_NORM = NormStyle(offset=0.0, scale_in_float=True)


class RMSNorm(nn.Module):
    """RMS norm over the last dimension, computed in float32; ``with_scale=False`` has no weight."""

    def __init__(
        self, dim: int, eps: float, style: NormStyle, with_scale: bool = True, **factory: Any
    ) -> None:
        super().__init__()
        self.eps = eps
        self.style = style
        self.weight = nn.Parameter(torch.empty(dim, **factory)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # x * rsqrt(mean(x²) + eps)
        if self.weight is None:
            return normed.to(x.dtype)
        if self.style.scale_in_float:
            return (normed * (self.style.offset + self.weight.float())).to(x.dtype)
        return (self.style.offset + self.weight) * normed.to(x.dtype)


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, **factory)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, **factory)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out


class Attention(nn.Module):
    """Self-attention of one layer with optional q/k norms, K=V and a weightless V norm."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, norm: NormStyle, v_norm: bool, **factory: Any
    ) -> None:
        super().__init__()
        spec = config.layers[layer_idx]
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads, spec.num_kv_heads, spec.head_dim
        self.k_eq_v = spec.k_eq_v
        self.scale = config.attention_scale
        bias = config.qkv_bias
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, **factory)
        self.v_proj = (
            None
            if spec.k_eq_v
            else nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, **factory)
        )
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=config.o_bias, **factory)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, norm, **factory) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, norm, **factory) if config.qk_norm else None
        self.v_norm = RMSNorm(self.head_dim, eps, norm, with_scale=False) if v_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, head_dim]
        cache: LayerCache,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        # K=V: V is the k projection before k_norm and rotary
        v = k if self.v_proj is None else self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attend(q, k, v, cache, plan, self.scale)  # [T, H, D]
        out: torch.Tensor = self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
        return out


class PreNormDecoderLayer(nn.Module):
    """Llama layout: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int, **factory: Any) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = Attention(config, layer_idx, LLAMA_NORM, v_norm=False, **factory)
        self.mlp = GatedMLP(config, **factory)
        self.input_layernorm = RMSNorm(hidden, eps, LLAMA_NORM, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, LLAMA_NORM, **factory)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, cache, plan)
        mlp: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp


class SandwichDecoderLayer(nn.Module):
    """Gemma layout: norms before and after both attention and MLP.

    With ``layer_scalar`` (gemma4) the layer's output is multiplied by a stored scalar buffer.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        norm: NormStyle,
        v_norm: bool = False,
        layer_scalar: bool = False,
        **factory: Any,
    ) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = Attention(config, layer_idx, norm, v_norm=v_norm, **factory)
        self.mlp = GatedMLP(config, **factory)
        self.input_layernorm = RMSNorm(hidden, eps, norm, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, norm, **factory)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, norm, **factory)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, norm, **factory)
        self.layer_scalar: torch.Tensor | None
        if layer_scalar:
            self.register_buffer("layer_scalar", torch.empty(1, **factory))  # [1], persistent
        else:
            self.layer_scalar = None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos_sin, cache, plan)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        x = x + self.post_feedforward_layernorm(mlp)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar
        return x
