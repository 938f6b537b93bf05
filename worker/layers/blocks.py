"""The building blocks every family shares: norms, the gated MLP, attention, decoder layers.

Module and parameter names follow Hugging Face so a checkpoint loads by name. All modules take
the flattened step layout: hidden states are [T, hidden] (no batch dimension).

On CUDA (``worker.device.kernels.attention.use_triton``) the norms, the residual adds, the
q/k norm + rotary and the gated activation run as fused Triton kernels
(``worker.device.kernels.rmsnorm``), with
the torch path's roundings. On the CPU in fp32, after ``CausalLM.prepare_for_cpu`` (the
``cpu_kernel`` flags), the norms, the q/k norm + rotary and the residual add + norm pairs are one
call each into the C helpers of ``worker.device.cpu_gemv``, with the same roundings; otherwise the
torch code below runs unchanged. After ``fuse_projections()`` (a post-load step: CUDA and the CPU
kernel path) q/k/v and gate/up are one matmul each, split with views; the HF parameter names are
gone then.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.device import cpu_gemv
from worker.device.kernels.attention import use_triton
from worker.layers.attention import AttentionPlan, attend
from worker.layers.kv import LayerCache
from worker.layers.quant import QuantLinear, concat
from worker.layers.rope import apply_rotary
from worker.models.config import ModelConfig


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
        self._scale: torch.Tensor | None = None  # offset + weight (float32), for the CPU path
        self._scale_key: tuple[int, int] | None = None
        self.cpu_kernel = False  # set by CausalLM.prepare_for_cpu (worker.device.cpu_gemv)

    @property
    def round_first(self) -> bool:
        """The llama style: the normed value is rounded before the weight multiplies it."""
        return not self.style.scale_in_float

    @property
    def cpu_scale(self) -> torch.Tensor | None:
        """The scale the CPU kernel helpers take: `float_scale()`, None without a weight; once
        ``freeze_cpu_scale`` ran (``CausalLM.prepare_for_cpu``: the weights are final), the
        stored tensor without re-checking the weight (~0.3 ms of a 26 ms decode step)."""
        frozen = self.__dict__.get("_frozen_scale", False)
        if frozen is not False:
            return frozen  # type: ignore[no-any-return]
        return None if self.weight is None else self.float_scale()

    def freeze_cpu_scale(self) -> None:
        self.__dict__["_frozen_scale"] = None if self.weight is None else self.float_scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel and _on_cpu_kernel(x):
            # in float32 every style is x_normed * (offset + w); one kernel call
            return cpu_gemv.rms_norm(x, self.cpu_scale, self.eps)
        if x.dim() in (2, 3) and use_triton(x):
            from worker.device.kernels.rmsnorm import rms_norm_triton

            return rms_norm_triton(x, self.weight, self.eps, self.style.offset, self.round_first)
        shape = (x.shape[-1],)
        if self.weight is not None and self.style.scale_in_float:
            # x * rsqrt(mean(x²) + eps) * (offset + w), all in float32, one op
            return F.rms_norm(x.float(), shape, self.float_scale(), self.eps).to(x.dtype)
        normed = F.rms_norm(x.float(), shape, eps=self.eps)  # x * rsqrt(mean(x²) + eps)
        if self.weight is None:
            return normed.to(x.dtype)
        return (self.style.offset + self.weight) * normed.to(x.dtype)

    def float_scale(self) -> torch.Tensor:
        """offset + weight in float32, recomputed only when the weight changes."""
        assert self.weight is not None
        key = (self.weight.data_ptr(), self.weight._version)
        if self._scale_key != key:
            self._scale = self.style.offset + self.weight.detach().float()
            self._scale_key = key
        return self._scale


def _on_cpu_kernel(x: torch.Tensor) -> bool:
    """x is one the CPU kernel helpers take (their ``cpu_kernel`` flag aside)."""
    return x.dtype == torch.float32 and x.device.type == "cpu"


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
        self.act_name = config.hidden_act
        self.inner = inner
        self.gate_up_proj: nn.Linear | None = None  # set by fuse_projections
        self.cpu_kernel = False  # set by CausalLM.prepare_for_cpu: no Triton check

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one gate_up_proj ([2 * inner, hidden]); nothing
        when a wider matmul took them already (``SparseMoE.fuse_projections``)."""
        if self.gate_up_proj is not None or not hasattr(self, "gate_proj"):
            return
        fused = _concat_linears([self.gate_proj, self.up_proj])
        if fused is None:
            return  # weights of different formats stay two matmuls
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self._down(self.gate_proj(x), self.up_proj(x), x)
        if isinstance(self.gate_up_proj, QuantLinear) and not self.cpu_kernel:
            gated = self.gate_up_proj.gated(x, self.act_name)  # the split sum + activation fused
            if gated is not None:
                out: torch.Tensor = self.down_proj(gated)
                return out
        return self.down_from_gate_up(self.gate_up_proj(x), x)

    def down_from_gate_up(self, gate_up: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 * inner] (gate columns first; may be a view of a wider matmul's
        output), x the input it came from -> down(act(gate) * up) [T, hidden]."""
        return self._down(gate_up[:, : self.inner], gate_up[:, self.inner :], x)

    def _down(self, gate: torch.Tensor, up: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not self.cpu_kernel and x.dim() == 2 and use_triton(x):
            from worker.device.kernels.rmsnorm import GATED_ACTIVATIONS, gated_act_triton

            if self.act_name in GATED_ACTIVATIONS:
                # one row with the down matrix on the decode GEMV: the activation in its loads
                config = getattr(self.down_proj, "decode_gemv_config", None)
                one_row = gate.shape[0] == 1 and gate.stride(-1) == 1 and up.stride(-1) == 1
                if config is not None and one_row:
                    from worker.device.kernels.gemv import gated_gemv_triton

                    act = GATED_ACTIVATIONS[self.act_name]
                    return gated_gemv_triton(gate, up, self.down_proj.weight, act, config)
                out: torch.Tensor = self.down_proj(gated_act_triton(gate, up, self.act_name))
                return out
        out = self.down_proj(self.act(gate) * up)
        return out


def _concat_linears(parts: list[Any]) -> Any:
    """One Linear whose output is the parts' outputs concatenated (weights moved, not kept);
    quantized parts of one format give one QuantLinear; None for parts that cannot be merged
    (float and quantized, or two quantized formats)."""
    if any(isinstance(p, QuantLinear) for p in parts):
        return _concat_quantized(parts)
    if not all(isinstance(p, nn.Linear) for p in parts):
        return None
    first = parts[0]
    bias = first.bias is not None
    weight = torch.cat([p.weight.detach() for p in parts], dim=0)
    fused = nn.Linear(
        first.in_features, weight.shape[0], bias=bias, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if bias:
            biases = [p.bias.detach() for p in parts if p.bias is not None]
            fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    for p in parts:  # free the originals now, one layer at a time
        p.weight = None  # type: ignore[assignment]
        p.bias = None
    return fused


def _concat_quantized(parts: list[Any]) -> QuantLinear | None:
    if not all(isinstance(p, QuantLinear) and p.quantized is not None for p in parts):
        return None
    weight = concat([p.quantized for p in parts])
    if weight is None:
        return None
    biases = [p.bias for p in parts if p.bias is not None]
    if biases and len(biases) != len(parts):
        return None
    fused = QuantLinear.from_weight(weight, torch.cat(biases) if biases else None)
    for p in parts:
        p.quantized = None
    return fused


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
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections
        self.cpu_kernel = False  # set by CausalLM.prepare_for_cpu (worker.device.cpu_gemv)

    def fuse_projections(self) -> None:
        """Replace q_proj, k_proj (and v_proj) by one qkv_proj: rows q, then k, then v."""
        if self.qkv_proj is not None:
            return
        parts = [self.q_proj, self.k_proj] + ([self.v_proj] if self.v_proj is not None else [])
        fused = _concat_linears(parts)
        if fused is None:
            return  # weights of different formats stay separate matmuls
        self.qkv_proj = fused
        del self.q_proj, self.k_proj
        self.v_proj = None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, D], k, v [T, KVH, D] (views; v is k when K=V)."""
        t = x.shape[0]
        kv_width = self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)  # [T, (H + KVH (+ KVH)) * D]
            q_width = self.num_heads * self.head_dim
            q = qkv[:, :q_width].view(t, self.num_heads, self.head_dim)
            k = qkv[:, q_width : q_width + kv_width].view(t, self.num_kv_heads, self.head_dim)
            if self.k_eq_v:
                return q, k, k
            v = qkv[:, q_width + kv_width :].view(t, self.num_kv_heads, self.head_dim)
            return q, k, v
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        # K=V: V is the k projection before k_norm and rotary
        v = k if self.v_proj is None else self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, head_dim]
        cache: LayerCache,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self._project(x)
        cos, sin = cos_sin
        if self.cpu_kernel and _on_cpu_kernel(x):
            q, k, v = self._norm_rope_cpu(q, k, v, cos, sin)
        elif use_triton(x):
            if hasattr(plan, "attend_stored") and _qkv_store_fused():
                o = plan.attend_stored(self._norm_rope_store(q, k, v, cos, sin, cache, plan),
                                       cache, self.scale)  # fmt: skip
            else:
                q, k, v = self._norm_rope_fused(q, k, v, cos, sin)
                o = attend(q, k, v, cache, plan, self.scale)  # [T, H, D]
            fused: torch.Tensor = self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
            return fused
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.v_norm is not None:
                v = self.v_norm(v)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attend(q, k, v, cache, plan, self.scale)  # [T, H, D]
        out: torch.Tensor = self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
        return out

    def _norm_rope_cpu(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The torch path's norms and rotary, one kernel call per tensor (the same roundings)."""

        def norm_rope(x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
            if norm is None:
                return cpu_gemv.norm_rope(x, None, 0.0, cos, sin, norm=False)
            return cpu_gemv.norm_rope(x, norm.cpu_scale, norm.eps, cos, sin)

        has_qk_norm = self.q_norm is not None and self.k_norm is not None
        if self.v_norm is not None:
            v = cpu_gemv.rms_norm(v, None, self.v_norm.eps)
        q = norm_rope(q, self.q_norm if has_qk_norm else None)
        k = norm_rope(k, self.k_norm if has_qk_norm else None)
        return q, k, v

    def _norm_rope_fused(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The torch path's norms and rotary, one Triton launch per tensor."""
        from worker.device.kernels.rmsnorm import rms_norm_rope_triton, rms_norm_triton

        def norm_rope(x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
            if norm is None:
                return rms_norm_rope_triton(x, None, cos, sin, 0.0, 0.0, False, norm=False)
            return rms_norm_rope_triton(
                x, norm.weight, cos, sin, norm.eps, norm.style.offset, norm.round_first
            )

        has_qk_norm = self.q_norm is not None and self.k_norm is not None
        v_out = v
        if self.v_norm is not None:
            v_out = rms_norm_triton(v, None, self.v_norm.eps, 0.0, False)
        q_out = norm_rope(q, self.q_norm if has_qk_norm else None)
        k_out = norm_rope(k, self.k_norm if has_qk_norm else None)
        return q_out, k_out, v_out

    def _norm_rope_store(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, cache: LayerCache, plan: Any,
    ) -> torch.Tensor:  # fmt: skip
        """A decode step's `_norm_rope_fused` and the plan's store of k and v into ``cache``
        in one launch -> q, normed and rotated (the plan then attends without storing)."""
        from worker.device.kernels.rmsnorm import qkv_norm_rope_store_triton

        norms = None
        if self.q_norm is not None and self.k_norm is not None:
            q_norm, k_norm = self.q_norm, self.k_norm
            norms = (q_norm.weight, k_norm.weight, q_norm.eps, q_norm.style.offset,
                     q_norm.round_first)  # fmt: skip
        v_eps = self.v_norm.eps if self.v_norm is not None else None
        return qkv_norm_rope_store_triton(q, k, v, norms, v_eps, cos, sin, cache.k, cache.v,
                                          plan.slots, plan.positions)  # fmt: skip


def _qkv_store_fused() -> bool:
    """Decode's q/k norms, rotary, V norm and KV store as one kernel where the attention plan
    allows it (`decode_graphs.FusedDecodePlan`); TOKENPIPE_QKV_STORE=0 keeps four launches."""
    return os.environ.get("TOKENPIPE_QKV_STORE", "1") != "0"


class PreNormDecoderLayer(nn.Module):
    """Llama layout: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int, **factory: Any) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = Attention(config, layer_idx, LLAMA_NORM, v_norm=False, **factory)
        self.mlp = GatedMLP(config, **factory)
        self.input_layernorm = RMSNorm(hidden, eps, LLAMA_NORM, **factory)
        self.post_attention_layernorm = RMSNorm(hidden, eps, LLAMA_NORM, **factory)
        self.cpu_kernel = False  # set by CausalLM.prepare_for_cpu (worker.device.cpu_gemv)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos_sin, cache, plan)
        post = self.post_attention_layernorm
        if self.cpu_kernel and _on_cpu_kernel(x):
            x, h = cpu_gemv.add_rms_norm(x, attn, None, None, post.cpu_scale, post.eps)
            assert h is not None
            return x + self.mlp(h)
        if use_triton(x):
            from worker.device.kernels.rmsnorm import add_rms_norm_triton

            x, h = add_rms_norm_triton(
                attn, x, None, post.weight, None, post.eps, post.style.offset, post.round_first
            )
            assert h is not None
            return x + self.mlp(h)
        x = x + attn
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
        self.cpu_kernel = False  # set by CausalLM.prepare_for_cpu (worker.device.cpu_gemv)
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
        if self.cpu_kernel and _on_cpu_kernel(x):
            return self._tail_cpu(x, attn)
        if use_triton(x) and self.post_attention_layernorm.weight is not None:
            return self._tail_fused(x, attn)[0]
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        x = x + self.post_feedforward_layernorm(mlp)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar
        return x

    def _tail_cpu(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Everything after attention in two kernel calls (+ the MLP), the same roundings."""
        post_attn, pre_ff = self.post_attention_layernorm, self.pre_feedforward_layernorm
        post_ff = self.post_feedforward_layernorm
        # x + post_attn(attn), and pre_ff of that sum
        x, h = cpu_gemv.add_rms_norm(
            x, attn, post_attn.cpu_scale, post_attn.eps, pre_ff.cpu_scale, pre_ff.eps
        )
        assert h is not None
        mlp = self.mlp(h)
        x, _ = cpu_gemv.add_rms_norm(x, mlp, post_ff.cpu_scale, post_ff.eps, None, None)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar
        return x

    def chainable(self, x: torch.Tensor, next_norm: RMSNorm) -> bool:
        """`forward_chained` serves x: the fused tail runs, and ``next_norm`` (the next
        layer's input norm, or the model's final one) has the weight, style and eps of its own
        norms, so its last kernel can apply it."""
        post = self.post_attention_layernorm
        return (
            not self.cpu_kernel and use_triton(x) and post.weight is not None
            and next_norm.weight is not None and next_norm.eps == post.eps
            and next_norm.style == post.style
        )  # fmt: skip

    def forward_chained(
        self, x: torch.Tensor, normed: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor], cache: LayerCache, plan: AttentionPlan,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`forward` with its input norm already applied by the layer before (``normed``:
        input_layernorm(x); None: applied here) -> (x, next_norm(x)), both from its last
        kernel: one norm launch a layer fewer (see ``chainable``)."""
        if normed is None:
            normed = self.input_layernorm(x)
        attn = self.self_attn(normed, cos_sin, cache, plan)
        x, h = self._tail_fused(x, attn, next_norm)
        assert h is not None
        return x, h

    def _tail_fused(
        self, x: torch.Tensor, attn: torch.Tensor, next_norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Everything after attention in two norm kernels (+ the MLP); with ``next_norm``,
        the second also returns next_norm of the layer's output."""
        from worker.device.kernels.rmsnorm import add_rms_norm_triton

        post_attn, pre_ff = self.post_attention_layernorm, self.pre_feedforward_layernorm
        post_ff = self.post_feedforward_layernorm
        eps, offset, first = post_attn.eps, post_attn.style.offset, post_attn.round_first
        # x + post_attn(attn), and pre_ff of that sum
        x, h = add_rms_norm_triton(attn, x, post_attn.weight, pre_ff.weight, None, eps, offset,
                                   first)  # fmt: skip
        assert h is not None
        mlp = self.mlp(h)
        # (x + post_ff(mlp)) * layer_scalar, and next_norm of that
        next_weight = next_norm.weight if next_norm is not None else None
        return add_rms_norm_triton(mlp, x, post_ff.weight, next_weight, self.layer_scalar, eps,
                                   offset, first)  # fmt: skip


def norm_chain(layers: Any, final_norm: Any, x: torch.Tensor) -> list[RMSNorm] | None:
    """The norm each layer's last kernel applies for the next (its input norm; the final norm
    after the last layer) when every layer can (`SandwichDecoderLayer.chainable`), else None.
    TOKENPIPE_NORM_CHAIN=0: None."""
    if os.environ.get("TOKENPIPE_NORM_CHAIN", "1") == "0" or not isinstance(final_norm, RMSNorm):
        return None
    layers = list(layers)
    if not all(isinstance(layer, SandwichDecoderLayer) for layer in layers):
        return None
    nexts = [layer.input_layernorm for layer in layers[1:]] + [final_norm]
    if not all(layer.chainable(x, n) for layer, n in zip(layers, nexts, strict=True)):
        return None
    return nexts
