"""Qwen3.5-MoE text stack (Qwen3_5MoeForCausalLM / the text of ..ForConditionalGeneration).

Pre-norm layers, Gemma-style RMSNorm (1 + w) in float32, unscaled embeddings, untied head.
Each layer mixes tokens with either a Gated DeltaNet (``linear_attention``, worker/layers/
deltanet.py) or gated full attention (``full_attention``, worker/layers/gated_attention.py,
partial rotary), then a sparse MoE (worker/layers/moe.py). The session state is a
``HybridCache``: the full layers' KV plus each DeltaNet layer's conv and recurrent state, with
snapshots for rollbacks (worker/layers/hybrid_cache.py).

Checkpoints: the text model's names (``model.layers...``), a multimodal one's
(``model.language_model.layers...``, the vision tower ``model.visual.`` skipped), the
multi-token-prediction head (``mtp.``) skipped; experts fused (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) or one tensor per expert
(``mlp.experts.<e>.{gate,up,down}_proj.weight``). Quantized experts (``--quantize int8|int4``:
``QuantExperts``) take either form, quantized as it streams in, one tensor at a time.

On CUDA the layers pick their Triton kernels themselves (grouped-GEMM MoE, in-place DeltaNet
decode step, fla's chunked prefill when it imports) and ``GraphedCausalLM`` replays decode steps
from CUDA graphs over the hybrid cache, with decode ahead at small batches (the step launched ahead
behind a copy of its slots' DeltaNet states, put back on a miss: worker/device/graphed_lm.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from worker.device.kernels.attention import use_triton
from worker.layers.attention import AttentionPlan
from worker.layers.blocks import GEMMA3_NORM, RMSNorm
from worker.layers.deltanet import GatedDeltaNet, prefill_states
from worker.layers.gated_attention import GatedAttention
from worker.layers.hybrid_cache import DEFAULT_SNAPSHOTS, HybridCache
from worker.layers.kv import DEFAULT_RING_SLACK
from worker.layers.moe import SparseMoE
from worker.layers.quant import QuantizedWeight
from worker.layers.quant_experts import QuantExperts
from worker.layers.rope import Rotary
from worker.models.causal_lm import CausalLM, LoadReport
from worker.models.config import ModelConfig, RopeSpec
from worker.models.step import StepInput

# parts of a Qwen3.5 checkpoint the text model does not use
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen35MoeDecoderLayer(nn.Module):
    """x + mixer(norm(x)), then x + moe(norm(x)); the mixer is ``linear_attn`` or
    ``self_attn``."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.is_linear = config.layers[layer_idx].kind == "linear"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, dtype=dtype)
        else:
            self.self_attn = GatedAttention(config, layer_idx, dtype=dtype)
        self.mlp = SparseMoE(config, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, eps, GEMMA3_NORM, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, GEMMA3_NORM, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: Any,  # LayerCache (full) or DeltaNetLayerCache (linear)
        plan: AttentionPlan,
    ) -> torch.Tensor:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        mixed = mixer(self.input_layernorm(x), cos_sin, cache, plan)
        post = self.post_attention_layernorm
        if use_triton(x):  # the residual add and the next norm in one launch
            from worker.device.kernels.rmsnorm import add_rms_norm_triton

            x, h = add_rms_norm_triton(
                mixed, x, None, post.weight, None, post.eps, post.style.offset, post.round_first
            )
            assert h is not None
        else:
            x = x + mixed
            h = post(x)
        moe: torch.Tensor
        if isinstance(self.mlp, SparseMoE):  # the sum in the MoE's last launch (not under
            moe = self.mlp(h, residual=x)  # tensor parallel: its all-reduce comes first)
            return moe
        moe = self.mlp(h)
        return x + moe


class Qwen35MoeForCausalLM(CausalLM):
    """The shared CausalLM with a hybrid cache, partial rotary tables and expert loading."""

    # the decode step's small kernels as plain launches: between them run DeltaNet, routing
    # and the MoE kernels, which are not dependent launches; with them dependent, batch 1 lost
    # 0.4-0.9% in three A/B pairs on an H200 (BENCHMARKS "Backlog from session 16, measured",
    # "session 18")
    small_kernel_dependents = False

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        def make_layer(cfg: ModelConfig, i: int) -> Qwen35MoeDecoderLayer:
            return Qwen35MoeDecoderLayer(cfg, i, dtype)

        super().__init__(config, make_layer, GEMMA3_NORM, scale_embeddings=False, dtype=dtype)
        # the rotary tables are rotary_dim wide (default rope over the rotated dims only)
        spec = config.layers[0]
        rotary_dim = int(spec.head_dim * spec.rope.partial_rotary_factor)
        key = (RopeSpec(theta=spec.rope.theta), rotary_dim)
        self._rope_keys = [key] * len(config.layers)
        self._rotaries = {key: Rotary(key[0], rotary_dim, config.max_position_embeddings)}

    def make_kv_cache(  # type: ignore[override]
        self,
        num_slots: int,
        max_context: int,
        ring_slack: int = DEFAULT_RING_SLACK,
        snapshots: int = DEFAULT_SNAPSHOTS,
        device: torch.device | str | None = None,  # "meta": sizes without allocating
        kv_dtype: torch.dtype | None = None,  # default: kv_cache_dtype, else the model's
    ) -> HybridCache:
        norm = self.model.norm.weight
        assert self.config.deltanet is not None and norm is not None
        where = self.device if device is None else torch.device(device)
        return HybridCache(
            self.config.layers,
            self.config.deltanet,
            num_slots,
            max_context,
            where,
            norm.dtype,
            snapshots=snapshots,
            ring_slack=ring_slack,
            free_split=prefill_states(where if where.type != "meta" else self.device, norm.dtype),
            kv_dtype=kv_dtype or self.kv_cache_dtype,
        )

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self, step: StepInput, kv: HybridCache, every_position: bool = False
    ) -> torch.Tensor:
        kv.begin_step(step)
        logits = super().forward(step, kv, every_position)  # type: ignore[arg-type]
        kv.end_step()
        return logits

    def load_weights(
        self, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> LoadReport:
        """The shared loader, with per-expert tensors copied into the fused ones and the
        vision tower and MTP head skipped."""
        pieces: dict[str, set[tuple[int, str]]] = {}  # fused prefix -> (expert, kind) loaded
        report = super().load_weights(self._fuse_experts(tensors, pieces), strict=False)
        experts = self.config.moe.num_experts if self.config.moe else 0
        complete = {p for p, got in pieces.items() if len(got) == 3 * experts}
        for name, module in self.named_modules():  # not parameters: never reported missing
            if isinstance(module, QuantExperts) and name not in pieces:
                pieces[name] = set()
        for prefix in complete:
            for name in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"):
                if name in report.missing:
                    report.missing.remove(name)
                    report.loaded += 1
        missing = report.missing + [f"{p}.<experts>" for p in set(pieces) - complete]
        report.missing = sorted(missing)
        if strict and (report.missing or report.unexpected):
            raise ValueError(
                f"checkpoint does not match {self.config.architecture}: "
                f"missing {report.missing[:8]}, unexpected {report.unexpected[:8]}"
            )
        return report

    def staging_views(self) -> dict[str, torch.Tensor]:
        """Per-expert checkpoint name -> the contiguous view of the fused parameter it fills
        (the staged CUDA load copies such a tensor's bytes straight into place; without a
        target it would only be described, as a meta tensor)."""
        views = {}
        for name, module in self.named_modules():
            experts = getattr(module, "gate_up_proj", None)
            down = getattr(module, "down_proj", None)
            if not isinstance(experts, nn.Parameter) or experts.dim() != 3:
                continue
            assert isinstance(down, nn.Parameter)
            inner = experts.shape[1] // 2
            for e in range(experts.shape[0]):
                views[f"{name}.{e}.gate_proj.weight"] = experts.detach()[e, :inner]
                views[f"{name}.{e}.up_proj.weight"] = experts.detach()[e, inner:]
                views[f"{name}.{e}.down_proj.weight"] = down.detach()[e]
        return views

    def _fuse_experts(
        self, tensors: Iterable[tuple[str, torch.Tensor]], pieces: dict[str, set[tuple[int, str]]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass tensors through, except per-expert ones (copied into the fused parameter here)
        and the parts of the checkpoint the text model does not use."""
        params = dict(self.named_parameters())
        quantized = {n: m for n, m in self.named_modules() if isinstance(m, QuantExperts)}
        for raw_name, tensor in tensors:
            name = raw_name.replace("model.language_model.", "model.", 1)
            if name.startswith(_SKIPPED_PREFIXES):
                continue
            prefix, _, matrix = name.rpartition(".")
            if prefix in quantized and matrix in ("gate_up_proj", "down_proj"):  # fused, float
                quantized[prefix].load(matrix, tensor)
                kinds = ("down_proj",) if matrix == "down_proj" else ("gate_proj", "up_proj")
                got = pieces.setdefault(prefix, set())
                got.update(
                    (e, kind) for e in range(quantized[prefix].num_experts) for kind in kinds
                )
                continue
            match = _PER_EXPERT.match(name)
            if match is None:
                yield name, tensor
                continue
            prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
            if prefix in quantized:
                experts = quantized[prefix]
                first_row = experts.inner if kind == "up_proj" else 0
                matrix = "down_proj" if kind == "down_proj" else "gate_up_proj"
                n, k = experts.shapes[matrix]
                want = (n if kind == "down_proj" else experts.inner, k)
                if tuple(tensor.shape) != want:
                    raise ValueError(
                        f"tensor {raw_name!r}: checkpoint shape {tuple(tensor.shape)} does not "
                        f"match model shape {want}"
                    )
                experts.load_rows(matrix, expert, first_row, tensor)
                pieces.setdefault(prefix, set()).add((expert, kind))
                continue
            fused = params.get(f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}")
            if fused is None:
                yield name, tensor  # reported as unexpected
                continue
            inner = fused.shape[1] // 2 if kind != "down_proj" else fused.shape[2]
            if kind == "gate_proj":
                target = fused[expert, :inner]
            elif kind == "up_proj":
                target = fused[expert, inner:]
            else:
                target = fused[expert]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"tensor {raw_name!r}: checkpoint shape {tuple(tensor.shape)} does not "
                    f"match model shape {tuple(target.shape)}"
                )
            if isinstance(tensor, QuantizedWeight):  # a GGUF's blocks, float experts
                tensor = tensor.dequantize()
            with torch.no_grad():
                target.copy_(tensor)
            pieces.setdefault(prefix, set()).add((expert, kind))


def build_qwen3_5_moe(config: ModelConfig, dtype: torch.dtype) -> CausalLM:
    return Qwen35MoeForCausalLM(config, dtype)
