"""CausalLM: the decoder stack every family shares, with the model contract of ARCHITECTURE.md.

    model.load_weights(pairs)                   # (HF name, tensor) pairs
    kv = model.make_kv_cache(num_slots, max_context)
    logits = model(step, kv)                    # [B, vocab] float32, last new token of each seq

Families (llama.py, gemma3.py, gemma4.py) only choose the decoder layer, the norm style and
whether embeddings are scaled by sqrt(hidden).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from worker.device.cpu_gemv import PackedEmbedding, PackedLinear
from worker.layers.attention import AttentionPlan
from worker.layers.blocks import NormStyle, RMSNorm
from worker.layers.kv import DEFAULT_RING_SLACK, KVCache
from worker.layers.quant import QuantEmbedding, QuantizedWeight, QuantLinear
from worker.layers.rope import Rotary
from worker.models.config import ModelConfig, RopeSpec
from worker.models.step import StepInput

_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

LayerFactory = Callable[[ModelConfig, int], nn.Module]

# checkpoint name prefixes of multimodal wrappers -> our text-only names
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
# parts of multimodal checkpoints a text-only model does not use
_IGNORED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.embed_vision.",
    "model.audio_tower.",
    "model.embed_audio.",
)


@dataclass
class LoadReport:
    loaded: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


class DecoderStack(nn.Module):
    """``model.*`` in HF names: embed_tokens, layers, norm."""

    def __init__(
        self, config: ModelConfig, make_layer: LayerFactory, norm: NormStyle, dtype: torch.dtype
    ) -> None:
        super().__init__()
        # _weight skips nn.Embedding's own init: its normal_ on the meta device imports
        # torch._dynamo (~3 s of a cached load); build_model never initialises anyway
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
        )
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm, dtype=dtype)


class CausalLM(nn.Module):
    # on CUDA, the decode step's small kernels as dependent launches (``kernels.dependent_small``)
    small_kernel_dependents = True

    def __init__(
        self,
        config: ModelConfig,
        make_layer: LayerFactory,
        norm: NormStyle,
        scale_embeddings: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, make_layer, norm, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )
        self.embed_scale = config.hidden_size**0.5 if scale_embeddings else None
        # tensor parallel (worker/parallel/shard.py): the vocabulary-split embedding and head
        self.tensor_parallel: Any = None
        # the KV cache's dtype (--kv-cache-dtype; worker/layers/kv.py); None: the model's
        self.kv_cache_dtype: torch.dtype | None = None
        # one rotary table per distinct (rope, head_dim); layer i uses self._rope_keys[i]
        self._rope_keys: list[tuple[RopeSpec, int]] = [(s.rope, s.head_dim) for s in config.layers]
        self._rotaries = {
            key: Rotary(key[0], key[1], config.max_position_embeddings)
            for key in dict.fromkeys(self._rope_keys)
        }

    # -- the contract --------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device  # the embedding may be packed (prepare_for_cpu)

    def make_kv_cache(
        self,
        num_slots: int,
        max_context: int,
        ring_slack: int = DEFAULT_RING_SLACK,
        device: torch.device | str | None = None,  # "meta": sizes without allocating
        kv_dtype: torch.dtype | None = None,  # default: kv_cache_dtype, else the model's
    ) -> KVCache:
        return KVCache(
            self.config.layers,
            self.config.sliding_window,
            num_slots,
            max_context,
            self.device if device is None else torch.device(device),
            kv_dtype or self.kv_cache_dtype or self.model.norm.weight.dtype,
            ring_slack=ring_slack,
        )

    @torch.inference_mode()
    def forward(self, step: StepInput, kv: KVCache, every_position: bool = False) -> torch.Tensor:
        """-> [B, vocab] float32 logits of the last new token of each sequence (with
        ``every_position``: [T, vocab], every new token's; the quality tools use it)."""
        device = self.device
        input_ids = step.input_ids.to(device)
        positions = step.positions.to(device)
        plan = AttentionPlan.build(step, device)

        tp = self.tensor_parallel
        if tp is None:
            x = self.model.embed_tokens(input_ids)  # [T, hidden]
        else:
            x = tp.embed(self.model.embed_tokens, input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        dtype = x.dtype
        tables = {key: rot.cos_sin(positions, dtype) for key, rot in self._rotaries.items()}

        layers = zip(self.model.layers, self._rope_keys, kv.layers, strict=True)
        # cuDNN attention builds a graph per new shape (that is, every step): milliseconds each
        with sdpa_kernel(_SDPA_BACKENDS):
            for layer, rope_key, cache in layers:
                x = layer(x, tables[rope_key], cache, plan)

        rows = x if every_position else x[plan.last_rows]
        last = self.model.norm(rows)  # [B, hidden]: never [T, vocab] unless asked
        logits = self._lm_head(last)  # [B, vocab] float32
        if tp is not None:
            logits = tp.gather_logits(logits)  # the rank's vocabulary rows -> all of them
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _lm_head(self, last: torch.Tensor) -> torch.Tensor:
        """last [B, hidden] -> [B, vocab] float32 logits."""
        if isinstance(self.lm_head, (PackedLinear, QuantLinear)):
            return self.lm_head(last).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if last.is_cuda or last.shape[0] == 1:
            return F.linear(last, weight).float()
        # CPU, a few rows against a [vocab, hidden] matrix: W @ h^T streams W once; the
        # h @ W^T form took 2.2x longer at 4 rows (MKL, 262k x 640, one thread)
        return torch.matmul(weight, last.T).T.float().contiguous()

    def prepare_for_cpu(self) -> int:
        """The CPU post-load step (after ``load_weights``; the HF names are gone after it):
        merge the projections (``fuse_projections``), store every fp32 matmul weight, the
        LM head and a tied embedding included, in the streaming layout of
        ``worker.device.cpu_gemv`` (decode steps read each weight once at close to the memory
        bandwidth) and let the norms, rotary and residual adds use its one-call helpers. A
        no-op returning 0 where that kernel cannot run or the weights are not fp32 on the CPU;
        else the number of weights packed."""
        from worker.device import cpu_gemv

        embed = self.model.embed_tokens
        norm = self.model.norm.weight
        if cpu_gemv.kernel() is None or norm.dtype != torch.float32 or norm.device.type != "cpu":
            return 0
        if isinstance(embed, nn.Embedding) and not cpu_gemv.can_pack(embed.weight):
            return 0
        self.fuse_projections()
        for module in self.modules():
            if hasattr(module, "cpu_kernel"):  # norms, attention (norm + rotary), MLP, tails
                module.cpu_kernel = True
            if isinstance(module, RMSNorm):
                module.freeze_cpu_scale()
        packed = 0
        for module in list(self.model.layers.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and cpu_gemv.can_pack(child.weight):
                    setattr(module, name, PackedLinear.from_linear(child))
                    packed += 1
        if isinstance(self.lm_head, nn.Linear) and cpu_gemv.can_pack(self.lm_head.weight):
            self.lm_head = PackedLinear.from_linear(self.lm_head)
            packed += 1
        packed += _pack_quantized(self)
        if isinstance(embed, QuantEmbedding):
            return packed
        table = cpu_gemv.pack(embed.weight)  # [vocab / 8, hidden, 8]
        self.model.embed_tokens = PackedEmbedding(table)
        if self.lm_head is None:  # tied: one packed table for both
            self.lm_head = PackedLinear(table)
        return packed + 1

    def _quantized_targets(self) -> dict[str, QuantLinear | QuantEmbedding]:
        tied = self.config.tie_word_embeddings
        return {
            f"{name}.weight": module
            for name, module in self.named_modules()
            if isinstance(module, (QuantLinear, QuantEmbedding))
            and not (tied and name == "lm_head")
        }

    def _load_tied_head(self, embedding: QuantLinear | QuantEmbedding, value: object) -> None:
        """The quantized head of a tied model: the embedding's table when the formats agree,
        else its own quantization of the same tensor."""
        head = self.lm_head
        assert isinstance(head, QuantLinear)
        if embedding.quantized is not None and head.format == embedding.format:
            head.quantized = embedding.quantized
            head.cpu_packed = None
        else:
            head.load(value)  # type: ignore[arg-type]

    def fuse_projections(self) -> int:
        """Merge each layer's q/k/v and gate/up weights into one matrix each (a post-load
        step for the GPU: one GEMV instead of two or three). The HF names are gone after it,
        so it runs after ``load_weights``. Returns the number of modules merged."""
        merged = 0
        for module in list(self.modules()):
            fuse = getattr(module, "fuse_projections", None)
            if module is not self and callable(fuse):
                fuse()
                merged += 1
        return merged

    def load_weights(
        self, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> LoadReport:
        """Copy (HF name, tensor) pairs into the parameters (cast to the model's dtype/device).

        Raises ValueError on a shape mismatch (naming the tensor and both shapes) and, when
        ``strict``, if any parameter was not supplied or any name is unknown.
        """
        targets = self.state_dict(keep_vars=True)  # name -> Parameter / persistent buffer
        quantized = self._quantized_targets()  # HF weight name -> QuantLinear / QuantEmbedding
        tied_head = self.config.tie_word_embeddings and isinstance(self.lm_head, QuantLinear)
        seen: set[str] = set()
        report = LoadReport()
        with torch.no_grad():
            for raw_name, tensor in tensors:
                name = _canonical_name(raw_name)
                if name is None:
                    continue
                if name == "lm_head.weight" and (self.lm_head is None or tied_head):
                    continue  # tied: the embedding is the head
                layer = quantized.get(name)
                if layer is not None:
                    if tensor.device != self.device:  # a GGUF's blocks, read on the host
                        tensor = tensor.to(self.device)
                    layer.load(tensor)  # a float tensor is quantized here, one at a time
                    if tied_head and name == "model.embed_tokens.weight":
                        self._load_tied_head(layer, tensor)
                    seen.add(name)
                    report.loaded += 1
                    continue
                if isinstance(tensor, QuantizedWeight):  # a quantized source, a float layer
                    tensor = tensor.dequantize()
                target = targets.get(name)
                if target is None:
                    report.unexpected.append(raw_name)
                    continue
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"tensor {raw_name!r}: checkpoint shape {tuple(tensor.shape)} does not "
                        f"match model shape {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                seen.add(name)
                report.loaded += 1
        report.missing = sorted((set(targets) | set(quantized)) - seen)
        if strict and (report.missing or report.unexpected):
            raise ValueError(
                f"checkpoint does not match {self.config.architecture}: "
                f"missing {_shorten(report.missing)}, unexpected {_shorten(report.unexpected)}"
            )
        return report


def _pack_quantized(model: nn.Module) -> int:
    """Quantized layers into the CPU kernel's layout (``worker.device.cpu_quant``); a tied
    head and embedding share one packed table. Returns the number packed."""
    from worker.device import cpu_quant

    packed: dict[int, object] = {}
    count = 0
    for module in model.modules():
        if not isinstance(module, (QuantLinear, QuantEmbedding)) or module.quantized is None:
            continue
        if not cpu_quant.can_pack(module.quantized):
            continue  # the torch reference
        key = id(module.quantized)
        if key not in packed:
            packed[key] = cpu_quant.pack(module.quantized)
            count += 1
        module.cpu_packed = packed[key]
    for module in model.modules():  # the canonical copies are not needed any more
        if isinstance(module, (QuantLinear, QuantEmbedding)) and module.cpu_packed is not None:
            module.quantized = None
    return count


def _canonical_name(name: str) -> str | None:
    """Our parameter name for a checkpoint name; None for tensors a text model ignores."""
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    if name.startswith(_IGNORED_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def _shorten(names: list[str], limit: int = 8) -> str:
    if not names:
        return "[]"
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return "[" + ", ".join(names[:limit]) + more + "]"
