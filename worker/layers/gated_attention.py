"""Gated full attention (qwen3_5_moe ``full_attention`` layers).

Like ``worker.layers.blocks.Attention`` with q/k RMS norms, plus:

- ``q_proj`` yields 2 x heads x head_dim: per head, the query then an output gate;
  the attention output is multiplied by sigmoid(gate) before ``o_proj``;
- partial rotary: only the first ``rotary_dim`` dims of each head rotate (rotate-half within
  them), the rest pass through; the cos/sin tables are ``rotary_dim`` wide.

Attention itself is ``worker.layers.attention.attend`` over the KV cache (its CUDA kernels
included), or the plan's own ``attend`` for a tensor-only decode plan (the CUDA decode graphs'
``FusedDecodePlan``), so the layer has no device code of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.device.kernels.attention import use_triton
from worker.layers.attention import AttentionPlan, attend
from worker.layers.blocks import GEMMA3_NORM, RMSNorm, _concat_linears
from worker.layers.kv import LayerCache
from worker.layers.rope import apply_rotary
from worker.models.config import ModelConfig


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, rotary_dim] -> x with its first rotary_dim dims
    rotated."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    turned = apply_rotary(x[..., :rotary_dim], cos, sin)
    return torch.cat([turned, x[..., rotary_dim:]], dim=-1)


class GatedAttention(nn.Module):
    """``self_attn`` of a qwen3_5_moe full layer (HF names)."""

    def __init__(self, config: ModelConfig, layer_idx: int, **factory: Any) -> None:
        super().__init__()
        spec = config.layers[layer_idx]
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads, spec.num_kv_heads, spec.head_dim
        self.scale = config.attention_scale
        bias = config.qkv_bias
        d = self.head_dim
        self.q_proj = nn.Linear(hidden, 2 * heads * d, bias=bias, **factory)  # query + gate
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias, **factory)
        self.o_proj = nn.Linear(heads * d, hidden, bias=config.o_bias, **factory)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(d, eps, GEMMA3_NORM, **factory)  # (1 + w), in float32
        self.k_norm = RMSNorm(d, eps, GEMMA3_NORM, **factory)
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections (CUDA)

    def fuse_projections(self) -> None:
        """On CUDA: ``q_proj``, ``k_proj`` and ``v_proj`` become one matmul (``qkv_proj``, rows
        in that order; the HF names are gone afterwards). The CPU path keeps them apart."""
        import worker.layers.deltanet as deltanet

        assert self.q_norm.weight is not None
        device = self.q_norm.weight.device.type  # the projections may be quantized
        if self.qkv_proj is not None or device not in deltanet.FUSED_PROJECTION_DEVICES:
            return
        fused = _concat_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is None:
            return
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> query and gate [T, H, 2D], k, v [T, KVH, D] (views of one matmul's
        output once merged)."""
        t, h, d, kvh = x.shape[0], self.num_heads, self.head_dim, self.num_kv_heads
        if self.qkv_proj is None:
            query_gate = self.q_proj(x).view(t, h, 2 * d)
            return query_gate, self.k_proj(x).view(t, kvh, d), self.v_proj(x).view(t, kvh, d)
        query_gate, k, v = torch.split(self.qkv_proj(x), [2 * h * d, kvh * d, kvh * d], dim=-1)
        return query_gate.view(t, h, 2 * d), k.view(t, kvh, d), v.view(t, kvh, d)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, rotary_dim]
        cache: LayerCache,
        plan: AttentionPlan,  # or a plan with its own `attend` (module doc)
    ) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        query_gate, k, v = self._project(x)
        q, gate = query_gate[..., :d], query_gate[..., d:]  # [T, H, D] each
        cos, sin = cos_sin
        if use_triton(x):  # each norm and its rotary in one launch
            from worker.device.kernels.rmsnorm import rms_norm_partial_rope_triton

            def norm_rope(part: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
                assert norm.weight is not None
                return rms_norm_partial_rope_triton(
                    part, norm.weight, cos, sin, norm.eps, norm.style.offset, norm.round_first
                )

            q, k = norm_rope(q, self.q_norm), norm_rope(k, self.k_norm)
        else:
            q = apply_partial_rotary(self.q_norm(q), cos, sin)
            k = apply_partial_rotary(self.k_norm(k), cos, sin)
        if isinstance(plan, AttentionPlan):
            o = attend(q, k, v.contiguous(), cache, plan, self.scale)  # [T, H, D]
        else:
            o = plan.attend(q, k, v, cache, self.scale)
        if use_triton(x):  # sigmoid(gate) * o in one launch, per (token, head) row
            from worker.device.kernels.rmsnorm import gated_act_triton

            gated = gated_act_triton(gate.reshape(t * h, d), o.reshape(t * h, d), "sigmoid")
            out: torch.Tensor = self.o_proj(gated.view(t, h * d))
            return out
        o = o * torch.sigmoid(gate)
        out = self.o_proj(o.reshape(t, h * d))
        return out
