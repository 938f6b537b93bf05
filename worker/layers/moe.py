"""Sparse mixture-of-experts MLP (qwen3_5_moe): top-k softmax router, fused experts, and a
shared expert behind a sigmoid gate.

    weights, experts = topk(softmax(gate(x)), k)        renormalised to sum 1
    y = sum_k weights_k * down_e(act(gate_e(x)) * up_e(x)) + sigmoid(shared_gate(x)) * shared(x)

The experts are stored fused as transformers 5 does: ``experts.gate_up_proj`` [E, 2I, H] (gate
rows first) and ``experts.down_proj`` [E, H, I]. The (token, expert) pairs of a step are sorted by
expert so each expert that was hit runs one matmul over its tokens, contiguous rows. On the CPU
that is a Python loop over the experts actually hit (at most T * k of them, 8 for a decode
token), never over all E. On CUDA (``use_triton``, SiLU experts) it is one grouped-GEMM launch
per matrix for every expert hit, with no host sync, so a decode step can be captured in a CUDA
graph (``worker.device.kernels.moe``).

With ``--quantize int8|int4`` the experts are a ``QuantExperts`` (``worker.layers.quant_experts``):
the CPU loop dequantizes the experts it runs, the CUDA path runs the same grouped GEMMs over the
quantized words (``worker.device.kernels.moe_quant``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.device.kernels.attention import use_triton
from worker.layers.blocks import GatedMLP, _concat_linears, activation
from worker.layers.quant_experts import QuantExperts
from worker.models.config import ModelConfig

GATE_IN_COMBINE_MAX_TOKENS = 64
"""Steps of up to this many tokens compute the shared expert gate's logit in the combine
launch (``gate_in_combine``; each of a token's programs does the H-long dot, free at decode
sizes); longer steps (prefill chunks) run its one-row matmul instead."""


class FusedExperts(nn.Module):
    """``mlp.experts``: every expert's weights in two tensors (HF names)."""

    def __init__(self, num_experts: int, hidden: int, inner: int, **factory: Any) -> None:
        super().__init__()
        self.num_experts, self.inner = num_experts, inner
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner, **factory))


class SparseMoE(nn.Module):
    """``mlp`` of a qwen3_5_moe layer."""

    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        spec = config.moe
        assert spec is not None
        hidden = config.hidden_size
        self.top_k = spec.top_k
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False, **factory)  # the router
        self.experts: FusedExperts | QuantExperts = FusedExperts(
            spec.num_experts, hidden, spec.expert_intermediate_size, **factory
        )
        shared = dataclasses.replace(
            config, intermediate_size=spec.shared_intermediate_size, mlp_bias=False
        )
        self.shared_expert = GatedMLP(shared, **factory)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, **factory)
        self.act = activation(config.hidden_act)
        self.act_name = config.hidden_act
        self.in_proj: nn.Linear | None = None  # set by fuse_projections (CUDA)
        self.gate_in_combine = False  # set by fuse_projections

    def fuse_projections(self) -> None:
        """On CUDA: the router and the shared expert's gate/up rows read the same x: one matmul
        (``in_proj``, rows in that order; those HF names are gone afterwards, ``shared_expert``
        keeps its ``down_proj``). A float ``shared_expert_gate`` (one row) stays apart: the
        kernels' combine computes its logit from x (``gate_in_combine``), so the merged rows
        (E + 2I) stay a multiple of 8, which cuBLAS needs for its aligned GEMMs (E + 1 + 2I
        rows ran an unaligned ``cutlass_75 ... align1`` kernel, 10.6 us a layer at 32 rows on
        the H200); otherwise it is merged too (between the router and the shared rows). The
        CPU path keeps them all apart."""
        import worker.layers.deltanet as deltanet

        stores = [*self.experts.parameters(), *self.experts.buffers()]
        device = stores[0].device.type  # the projections may be quantized (no .weight)
        if self.in_proj is not None or device not in deltanet.FUSED_PROJECTION_DEVICES:
            return
        shared = self.shared_expert
        if shared.gate_up_proj is not None:
            return  # merged on its own already
        gate = self.shared_expert_gate
        apart = (
            type(gate) is nn.Linear
            and gate.bias is None
            and os.environ.get("TOKENPIPE_MOE_GATE_IN_COMBINE") != "0"  # (for comparison)
        )
        parts = [self.gate, shared.gate_proj, shared.up_proj]
        fused = _concat_linears(parts if apart else [self.gate, gate, *parts[1:]])
        if fused is None:
            return
        self.in_proj = fused
        self.gate_in_combine = apart
        del self.gate, shared.gate_proj, shared.up_proj
        if not apart:
            del self.shared_expert_gate

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """x [T, hidden] -> router logits [T, E], the shared expert's gate logit [T, 1] (None
        when ``gate_in_combine``: the kernels compute it) and its output [T, hidden] (views of
        one matmul's output once merged)."""
        if self.in_proj is None:
            return self.gate(x), self.shared_expert_gate(x), self.shared_expert(x)
        shared = self.shared_expert
        if self.gate_in_combine:
            widths = [self.experts.num_experts, 2 * shared.inner]
            logits, gate_up = torch.split(self.in_proj(x), widths, dim=-1)
            return logits, None, shared.down_from_gate_up(gate_up, x)
        widths = [self.experts.num_experts, 1, 2 * shared.inner]
        logits, gate, gate_up = torch.split(self.in_proj(x), widths, dim=-1)
        return logits, gate, shared.down_from_gate_up(gate_up, x)

    def route(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (weights [T, k] in ``dtype``, expert ids [T, k])."""
        if use_triton(logits):
            from worker.device.kernels.moe import route_triton

            return route_triton(logits, self.top_k)  # the lines below, one launch
        probs = F.softmax(logits.float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(dtype), ids

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; with ``residual`` [T, hidden]: residual + that, added
        in the kernels' last launch on their path (the torch path's rounding: each sum rounded
        to x's dtype)."""
        logits, shared_gate, shared = self._project(x)
        if self._grouped_kernels(x):  # routed + shared (+ residual) in the kernels
            return self._fused_triton(x, logits, shared, shared_gate, residual)
        if shared_gate is None:
            shared_gate = self.shared_expert_gate(x)
        weights, ids = self.route(logits, x.dtype)
        routed = self._experts(x, weights, ids)
        out = routed + torch.sigmoid(shared_gate) * shared
        return out if residual is None else residual + out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), tokens grouped by expert (the CPU
        path's loop)."""
        t, k = ids.shape
        flat = ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order within
        tokens = order // k  # [T * k] token of each sorted pair
        counts = torch.bincount(flat, minlength=self.experts.num_experts)
        hit = torch.nonzero(counts).flatten()
        # one host sync: which experts ran and how many tokens each (CPU path)
        hit_list, sizes = hit.tolist(), counts[hit].tolist()
        gathered = x[tokens]  # [T * k, hidden]
        out = torch.empty_like(gathered)
        inner = self.experts.inner
        start = 0
        for expert, size in zip(hit_list, sizes, strict=True):
            rows = slice(start, start + size)
            gate_up_weight, down_weight = self._expert_weights(expert, x.dtype)
            gate_up = F.linear(gathered[rows], gate_up_weight)  # [n, 2I]
            hidden = self.act(gate_up[:, :inner]) * gate_up[:, inner:]
            out[rows] = F.linear(hidden, down_weight)
            start += size
        out = out * weights.reshape(-1)[order, None]
        result = torch.zeros_like(x)
        result.index_add_(0, tokens, out)
        return result

    def _expert_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert: views of the float tensors, or the
        quantized expert dequantized (only the experts a step hit are)."""
        experts = self.experts
        if isinstance(experts, QuantExperts):
            gate_up = experts.expert_weight("gate_up_proj", expert, dtype)
            return gate_up, experts.expert_weight("down_proj", expert, dtype)
        return experts.gate_up_proj[expert], experts.down_proj[expert]

    def _grouped_kernels(self, x: torch.Tensor) -> bool:
        """The Triton grouped GEMMs run this step (CUDA, SiLU experts; quantized experts in
        groups the kernels take)."""
        if self.act_name != "silu" or not use_triton(x):
            return False
        if isinstance(self.experts, QuantExperts):
            from worker.device.kernels.moe_quant import supports

            return supports(self.experts)
        return True

    def _fused_triton(
        self, x: torch.Tensor, logits: torch.Tensor, shared: torch.Tensor,
        shared_gate: torch.Tensor | None, residual: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """The kernels' path: routing (with the pairs' alignment in the same launch for a
        few tokens), the grouped GEMMs, and the sum with the shared expert (and residual;
        ``shared_gate`` None: its logit from x and ``shared_expert_gate``'s weight)."""
        from worker.device.kernels.moe import (
            ROUTE_ALIGN_MAX_PAIRS,
            choose_blocks,
            fused_moe_triton,
            route_align_triton,
        )

        experts = self.experts
        if shared_gate is None and x.shape[0] > GATE_IN_COMBINE_MAX_TOKENS:
            shared_gate = self.shared_expert_gate(x)  # every combine program would redo the dot
        gate_weight = self.shared_expert_gate.weight if shared_gate is None else None
        quantized = isinstance(experts, QuantExperts)
        blocks = choose_blocks(x.shape[0], x.shape[1], experts.inner, quantized)
        aligned = None
        pairs = x.shape[0] * self.top_k
        if quantized:
            from worker.device.kernels.moe_quant import use_gemv

            gemv = use_gemv(pairs)
        else:
            from worker.device.kernels.moe_gemv import use_float_gemv

            gemv = use_float_gemv(pairs)
        if not gemv and pairs <= ROUTE_ALIGN_MAX_PAIRS and logits.stride(1) == 1:
            weights, ids, aligned = route_align_triton(logits, self.top_k, blocks.block_m)
        else:  # (the per-pair GEMVs need no alignment)
            weights, ids = self.route(logits, x.dtype)
        if isinstance(experts, QuantExperts):
            from worker.device.kernels.moe_quant import fused_moe_quant_triton

            return fused_moe_quant_triton(
                x, experts.matrix("gate_up_proj"), experts.matrix("down_proj"), weights, ids,
                blocks, shared, shared_gate, residual, aligned, gemv,
                shared_gate_weight=gate_weight,
            )  # fmt: skip
        if gemv:
            from worker.device.kernels.moe_gemv import moe_float_gemv

            return moe_float_gemv(
                x, experts.gate_up_proj, experts.down_proj, weights, ids, shared, shared_gate,
                residual, shared_gate_weight=gate_weight,
            )  # fmt: skip
        return fused_moe_triton(
            x, experts.gate_up_proj, experts.down_proj, weights, ids, blocks, shared,
            shared_gate, residual, aligned, gate_weight,
        )  # fmt: skip
