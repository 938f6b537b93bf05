"""ModelConfig: the validated, frozen view of a Hugging Face ``config.json`` that our models need.

``ModelConfig.from_hf(config_dict)`` accepts both the transformers 5 layout (``rope_parameters``,
``per_layer_config``) and the older hub layout (``rope_theta``, ``rope_scaling``,
``rope_local_base_freq``, ``sliding_window_pattern``, ``global_head_dim``). Multimodal wrappers
(``Gemma3ForConditionalGeneration``...) are read through their ``text_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

AttentionKind = Literal["full", "sliding", "linear"]  # linear: a Gated DeltaNet layer, no KV
Family = Literal["llama", "gemma3", "gemma4", "qwen3_5_moe"]

# architecture name -> family
SUPPORTED_ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}

# model_type -> architecture, for configs without an ``architectures`` list
_MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}

# transformers' defaults for keys the hub's Gemma configs often leave out (Gemma3TextConfig,
# Gemma4TextConfig); the text_config of the multimodal checkpoints is sparse
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "query_pre_attn_scalar": 256,
}
_GEMMA4_DEFAULTS: dict[str, Any] = {
    **_GEMMA3_DEFAULTS,
    "vocab_size": 262_144,
    "num_hidden_layers": 30,
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters of one layer type (see worker/layers/rope.py)."""

    rope_type: str = "default"
    theta: float = 10_000.0
    factor: float = 1.0
    partial_rotary_factor: float = 1.0  # only "proportional" uses it
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class LayerSpec:
    """The attention geometry of one decoder layer."""

    kind: AttentionKind
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # no v_proj: V comes from the k projection (gemma4 full layers)
    rope: RopeSpec


@dataclass(frozen=True)
class DeltaNetSpec:
    """The Gated DeltaNet geometry of the ``linear`` layers (qwen3_5_moe)."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class MoESpec:
    """A sparse MoE MLP: top-k softmax router, fused experts, a sigmoid-gated shared expert."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model families read; built once by ``from_hf`` and never mutated."""

    architecture: str
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    attention_scale: float  # multiplies q·k
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # keys a query sees on a sliding layer, itself included
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None  # the checkpoint's dtype name, if the config says
    deltanet: DeltaNetSpec | None = None  # the linear layers' geometry (qwen3_5_moe)
    moe: MoESpec | None = None  # every layer's MLP is this MoE (qwen3_5_moe)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @property
    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        return tuple(layer.kind for layer in self.layers)

    @staticmethod
    def from_hf(config: dict[str, Any]) -> ModelConfig:
        """Validate an HF config dict; raise ValueError naming what is wrong or unsupported."""
        if not isinstance(config, dict):
            raise ValueError(f"model config must be a JSON object, got {type(config).__name__}")
        arch = _architecture(config)
        family = SUPPORTED_ARCHITECTURES[arch]
        text = config.get("text_config") if arch.endswith("ForConditionalGeneration") else None
        if arch.endswith("ForConditionalGeneration"):
            if not isinstance(text, dict):
                raise ValueError(f"{arch} config has no text_config object")
            # the text stack reads its own keys; tying and token ids may live at the top level
            merged = {k: v for k, v in config.items() if k != "text_config"}
            merged.update(text)
            text = merged
        else:
            text = config
        if family == "llama":
            result = _llama_config(arch, text)
        elif family == "gemma3":
            result = _gemma3_config(arch, text)
        elif family == "qwen3_5_moe":
            result = _qwen3_5_moe_config(arch, text)
        else:
            result = _gemma4_config(arch, text)
        for i, layer in enumerate(result.layers):
            if layer.head_dim < 2 or layer.head_dim % 2:
                raise ValueError(f"layer {i}: head_dim must be even and >= 2, got {layer.head_dim}")
        return result


# ---------------------------------------------------------------------------------------------
# helpers


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures")
    names: list[str] = []
    if isinstance(archs, list):
        names = [a for a in archs if isinstance(a, str)]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    model_type = config.get("model_type")
    if not names and isinstance(model_type, str) and model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    shown = names or [f"model_type={model_type!r}"]
    raise ValueError(
        f"unsupported model architecture {', '.join(map(str, shown))}; "
        f"SUPPORTED_ARCHITECTURES: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )


def _req_int(cfg: dict[str, Any], key: str, minimum: int = 1) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config key {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"config key {key!r} must be >= {minimum}, got {value}")
    return value


def _opt_int(cfg: dict[str, Any], key: str, default: int | None) -> int | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config key {key!r} must be an integer or null, got {value!r}")
    return value


def _opt_float(cfg: dict[str, Any], key: str, default: float | None) -> float | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config key {key!r} must be a number or null, got {value!r}")
    return float(value)


def _eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        return tuple(eos)
    raise ValueError(f"config key 'eos_token_id' must be an int or a list of ints, got {eos!r}")


def _rope_spec(params: dict[str, Any] | None, default_theta: float, where: str) -> RopeSpec:
    """One rope parameter dict (``rope_parameters`` entry or old ``rope_scaling``) -> RopeSpec."""
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} in {where}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = _opt_float(params, "rope_theta", default_theta)
    assert theta is not None
    factor = params.get("factor")
    if rope_type in ("linear", "llama3") and not isinstance(factor, (int, float)):
        raise ValueError(f"rope type {rope_type!r} in {where} needs a numeric 'factor'")
    original = _opt_int(params, "original_max_position_embeddings", None)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if not isinstance(params.get(key), (int, float)):
                raise ValueError(f"rope type 'llama3' in {where} needs {key!r}")
        if original is None:
            raise ValueError(
                f"rope type 'llama3' in {where} needs original_max_position_embeddings"
            )
    return RopeSpec(
        rope_type=rope_type,
        theta=theta,
        factor=float(factor) if isinstance(factor, (int, float)) else 1.0,
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=_opt_float(params, "attention_factor", None),
        mscale=_opt_float(params, "mscale", None),
        mscale_all_dim=_opt_float(params, "mscale_all_dim", None),
        truncate=bool(params.get("truncate", True)),
    )


def _check_heads(cfg: dict[str, Any]) -> tuple[int, int, int]:
    hidden = _req_int(cfg, "hidden_size")
    heads = _req_int(cfg, "num_attention_heads")
    kv_heads = _opt_int(cfg, "num_key_value_heads", heads) or heads
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    return hidden, heads, kv_heads


def _common(cfg: dict[str, Any]) -> dict[str, Any]:
    eps = _opt_float(cfg, "rms_norm_eps", 1e-6)
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    return dict(
        vocab_size=_req_int(cfg, "vocab_size"),
        intermediate_size=_req_int(cfg, "intermediate_size"),
        num_hidden_layers=_req_int(cfg, "num_hidden_layers"),
        rms_norm_eps=eps if eps is not None else 1e-6,
        max_position_embeddings=_opt_int(cfg, "max_position_embeddings", 2048) or 2048,
        bos_token_id=_opt_int(cfg, "bos_token_id", None),
        eos_token_ids=_eos_ids(cfg),
        pad_token_id=_opt_int(cfg, "pad_token_id", None),
        torch_dtype=dtype if isinstance(dtype, str) else None,
        raw=dict(cfg),
    )


def _layer_types(cfg: dict[str, Any], n_layers: int, default_pattern: int | None) -> list[str]:
    """``layer_types`` if given, else every ``pattern``-th layer full (None: all full)."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern"))
        pattern = pattern if isinstance(pattern, int) and pattern > 0 else default_pattern
        if pattern is None:
            return ["full_attention"] * n_layers
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
        ]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ValueError(f"layer_types must be a list of {n_layers} entries, got {types!r}")
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise ValueError(f"unsupported layer type {t!r} (full_attention, sliding_attention)")
    return list(types)


def _kind(layer_type: str) -> AttentionKind:
    return "sliding" if layer_type == "sliding_attention" else "full"


def _window(
    cfg: dict[str, Any], kinds: list[AttentionKind], default: int | None = None
) -> int | None:
    if "sliding" not in kinds:
        return None
    window = _opt_int(cfg, "sliding_window", default)
    if window is None or window < 1:
        raise ValueError(f"sliding layers need a positive sliding_window, got {window!r}")
    return window


# ---------------------------------------------------------------------------------------------
# families


def _llama_config(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    hidden, heads, kv_heads = _check_heads(cfg)
    head_dim = _opt_int(cfg, "head_dim", None) or hidden // heads
    n_layers = _req_int(cfg, "num_hidden_layers")

    # rope: transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`
    rope_params = cfg.get("rope_parameters")
    if not isinstance(rope_params, dict):
        rope_params = dict(cfg.get("rope_scaling") or {})
        if "rope_theta" in cfg:
            rope_params["rope_theta"] = cfg["rope_theta"]
    rope = _rope_spec(rope_params, 10_000.0, "rope_parameters")
    if rope.rope_type == "proportional" or rope.partial_rotary_factor != 1.0:
        raise ValueError(f"{arch}: partial rotary embeddings are not supported")

    # sliding windows: Mistral uses one everywhere when set; Qwen2/3 only with use_sliding_window
    if arch == "MistralForCausalLM":
        kinds: list[AttentionKind] = (
            ["sliding"] * n_layers if cfg.get("sliding_window") else ["full"] * n_layers
        )
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        kinds = [_kind(t) for t in _layer_types(cfg, n_layers, None)]
    else:
        kinds = ["full"] * n_layers
    window = _window(cfg, kinds)

    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    layers = tuple(LayerSpec(kind, head_dim, kv_heads, False, rope) for kind in kinds)
    return ModelConfig(
        architecture=arch,
        family="llama",
        hidden_size=hidden,
        num_attention_heads=heads,
        layers=layers,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        attention_scale=head_dim**-0.5,
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=window,
        **_common(cfg),
    )


def _gemma3_config(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    cfg = {**_GEMMA3_DEFAULTS, **cfg}
    hidden, heads, kv_heads = _check_heads(cfg)
    head_dim = _opt_int(cfg, "head_dim", 256) or 256
    n_layers = _req_int(cfg, "num_hidden_layers")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("gemma3: use_bidirectional_attention is not supported")

    rope_params = cfg.get("rope_parameters")
    if isinstance(rope_params, dict) and "full_attention" in rope_params:
        global_rope = _rope_spec(rope_params.get("full_attention"), 1e6, "full_attention rope")
        local_rope = _rope_spec(rope_params.get("sliding_attention"), 1e4, "sliding rope")
    else:
        # old layout: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq local
        global_params = dict(cfg.get("rope_scaling") or {})
        global_params.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
        global_rope = _rope_spec(global_params, 1e6, "rope_scaling")
        local_rope = RopeSpec(theta=float(cfg.get("rope_local_base_freq", 1e4)))

    kinds = [_kind(t) for t in _layer_types(cfg, n_layers, 6)]
    window = _window(cfg, kinds, 4096)  # transformers' default
    layers = tuple(
        LayerSpec(kind, head_dim, kv_heads, False, local_rope if kind == "sliding" else global_rope)
        for kind in kinds
    )
    scalar = _opt_float(cfg, "query_pre_attn_scalar", 256.0) or 256.0
    # attn_logit_softcapping is ignored, as transformers' Gemma 3 attention ignores it
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        family="gemma3",
        hidden_size=hidden,
        num_attention_heads=heads,
        layers=layers,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        hidden_act=str(
            cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        ),
        attention_scale=scalar**-0.5,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=True,
        sliding_window=window,
        final_logit_softcapping=_opt_float(cfg, "final_logit_softcapping", None),
        **_common(cfg),
    )


def _gemma4_config(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    cfg = {**_GEMMA4_DEFAULTS, **cfg}
    hidden, heads, kv_heads = _check_heads(cfg)
    head_dim = _opt_int(cfg, "head_dim", 256) or 256
    n_layers = _req_int(cfg, "num_hidden_layers")
    # features of other Gemma 4 sizes that the 31B text stack does not use
    if cfg.get("hidden_size_per_layer_input", 256):
        raise ValueError(
            "gemma4: per-layer input embeddings (hidden_size_per_layer_input > 0) are not supported"
        )
    if cfg.get("num_kv_shared_layers", 0):
        raise ValueError(
            "gemma4: KV sharing across layers (num_kv_shared_layers > 0) is not supported"
        )
    if cfg.get("enable_moe_block", False):
        raise ValueError("gemma4: mixture-of-experts blocks (enable_moe_block) are not supported")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("gemma4: use_bidirectional_attention='all' is not supported")

    layer_types = _layer_types(cfg, n_layers, 6)
    if layer_types[-1] != "full_attention":
        layer_types[-1] = "full_attention"  # transformers forces this as well
    kinds = [_kind(t) for t in layer_types]
    window = _window(cfg, kinds, 512)  # transformers' default
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))

    rope_params = cfg.get("rope_parameters") or {}
    full_rope = _rope_spec(
        rope_params.get(
            "full_attention",
            {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        ),
        1e6,
        "full_attention rope",
    )
    sliding_rope = _rope_spec(
        rope_params.get("sliding_attention", {"rope_type": "default", "rope_theta": 1e4}),
        1e4,
        "sliding_attention rope",
    )

    # per-layer head_dim / kv heads: `per_layer_config` (transformers 5) or the global_* keys
    per_layer = cfg.get("per_layer_config")
    overrides: dict[int, dict[str, Any]] = {}
    if isinstance(per_layer, dict):
        for key, value in per_layer.items():
            if str(key).isdigit() and isinstance(value, dict):
                overrides[int(key)] = value
    else:
        global_head_dim = _opt_int(cfg, "global_head_dim", 512) or 512
        global_kv = _opt_int(cfg, "num_global_key_value_heads", None) if k_eq_v else None
        for i, kind in enumerate(kinds):
            if kind == "full":
                overrides[i] = {"head_dim": global_head_dim}
                if global_kv is not None:
                    overrides[i]["num_key_value_heads"] = global_kv

    layers = []
    for i, kind in enumerate(kinds):
        o = overrides.get(i, {})
        layer_head_dim = int(o.get("head_dim", head_dim))
        layer_kv = int(o.get("num_key_value_heads", kv_heads))
        if heads % layer_kv:
            raise ValueError(
                f"gemma4 layer {i}: {heads} heads not a multiple of {layer_kv} kv heads"
            )
        rope = sliding_rope if kind == "sliding" else full_rope
        layers.append(LayerSpec(kind, layer_head_dim, layer_kv, k_eq_v and kind == "full", rope))

    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        family="gemma4",
        hidden_size=hidden,
        num_attention_heads=heads,
        layers=tuple(layers),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        hidden_act=str(
            cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        ),
        attention_scale=1.0,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=True,
        sliding_window=window,
        final_logit_softcapping=_opt_float(cfg, "final_logit_softcapping", None),
        **_common(cfg),
    )


def _qwen3_5_moe_config(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    """Qwen3.5-MoE text stack: Gated DeltaNet ``linear_attention`` layers and gated
    ``full_attention`` layers (partial rotary), every MLP a sparse MoE. Missing keys take
    transformers' Qwen3_5MoeTextConfig defaults (the 35B-A3B shape)."""
    cfg = {**_QWEN3_5_MOE_DEFAULTS, **cfg}
    hidden, heads, kv_heads = _check_heads(cfg)
    head_dim = _opt_int(cfg, "head_dim", 256) or 256
    n_layers = _req_int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        interval = _opt_int(cfg, "full_attention_interval", 4) or 4
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(n_layers)
        ]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ValueError(f"layer_types must be a list of {n_layers} entries, got {types!r}")
    for t in types:
        if t not in ("full_attention", "linear_attention"):
            raise ValueError(f"unsupported layer type {t!r} (full_attention, linear_attention)")

    # text-only positions make the multimodal rope (mrope) plain rope on the rotated dims
    rope_params = cfg.get("rope_parameters")
    if not isinstance(rope_params, dict):
        rope_params = dict(cfg.get("rope_scaling") or {})
        rope_params.setdefault("rope_theta", cfg.get("rope_theta", 10_000.0))
    rope_params = {
        k: v for k, v in rope_params.items() if k not in ("mrope_section", "mrope_interleaved")
    }
    rope_params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    rope = _rope_spec(rope_params, 10_000.0, "rope_parameters")
    if rope.rope_type != "default":
        raise ValueError(f"{arch}: rope type {rope.rope_type!r} is not supported (default only)")
    rotary = int(head_dim * rope.partial_rotary_factor)
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise ValueError(f"{arch}: partial_rotary_factor gives {rotary} rotated dims of {head_dim}")

    deltanet = DeltaNetSpec(
        num_key_heads=_req_int(cfg, "linear_num_key_heads"),
        num_value_heads=_req_int(cfg, "linear_num_value_heads"),
        key_head_dim=_req_int(cfg, "linear_key_head_dim"),
        value_head_dim=_req_int(cfg, "linear_value_head_dim"),
        conv_kernel=_req_int(cfg, "linear_conv_kernel_dim", minimum=2),
    )
    if deltanet.num_value_heads % deltanet.num_key_heads:
        raise ValueError(
            f"linear_num_value_heads ({deltanet.num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({deltanet.num_key_heads})"
        )
    moe = MoESpec(
        num_experts=_req_int(cfg, "num_experts"),
        top_k=_req_int(cfg, "num_experts_per_tok"),
        expert_intermediate_size=_req_int(cfg, "moe_intermediate_size"),
        shared_intermediate_size=_req_int(cfg, "shared_expert_intermediate_size"),
    )
    if moe.top_k > moe.num_experts:
        raise ValueError(f"num_experts_per_tok ({moe.top_k}) > num_experts ({moe.num_experts})")
    kinds: list[AttentionKind] = ["full" if t == "full_attention" else "linear" for t in types]
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        family="qwen3_5_moe",
        hidden_size=hidden,
        num_attention_heads=heads,
        layers=tuple(LayerSpec(kind, head_dim, kv_heads, False, rope) for kind in kinds),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        attention_scale=head_dim**-0.5,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=True,
        deltanet=deltanet,
        moe=moe,
        **_common(cfg),
    )


# transformers' Qwen3_5MoeTextConfig defaults (the 35B-A3B shape)
_QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248_320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 32_768,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
    "intermediate_size": 512,  # unused: every MLP is the MoE
}
