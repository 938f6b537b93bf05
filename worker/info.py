"""`tokenpipe info`: the model's metadata as JSON, without loading the weights.

Reads config.json, the tokenizer and the safetensors headers (a GGUF file is converted into its
cache directory first, once). Memory per session comes from the KV cache the model would build
for one slot at `--context` tokens, computed on the meta device (no memory allocated).

`device_estimate` is what a CUDA worker started with the same flags holds at its peak (in its
dtype: bfloat16 unless `--dtype` says, where the other figures default to float32): the
weights, `--max-resident` (else `--max-sessions`) cache slots, the activations of one
`--prefill-chunk` step, and a fixed allowance for the CUDA context, kernel code and the engine's
graphs and buffers, measured (BENCHMARKS.md, session 31). A hybrid model's step is counted for
the DeltaNet prefill this environment would run (flash-linear-attention's kernels where ``fla``
is installed, else the torch form: twice the memory). With `--gpu-memory-gb`, whether that
fits, and how many slots / how long a context would.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import torch

from worker.device.memory import (
    CUDA_PREFILL_CHUNK,
    FRAGMENTATION_BYTES,
    GIB,
    GRAPHS_BYTES,
    MIN_PREFIX_TOKENS,
    QUANTIZED_PREFILL_CHUNK,
    default_prefix_pool_bytes,
    fit_prefill_chunk,
    prefill_step_bytes,
)
from worker.engine.prefix_cache import DEFAULT_BLOCK as PREFIX_BLOCK
from worker.loading.checkpoint import Checkpoint, ModelLoadError, text_config
from worker.loading.quantize import HEAD, QuantizeOptions, describe_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

RUNTIME_BYTES = int(0.8 * GIB) + GRAPHS_BYTES + FRAGMENTATION_BYTES
"""What a CUDA worker holds on the card besides weights, caches and a step's activations: the
CUDA context and kernel code (0.79 GiB on an H100 with torch 2.11 / CUDA 13: the card's used
memory less the allocator's reservation), the engine's CUDA graphs and buffers
(``memory.GRAPHS_BYTES``) and the allocator's unusable gaps (``memory.FRAGMENTATION_BYTES``):
two 12,032-token slots of Gemma 4 31B int4 under 23.5 GiB, 23.5 GiB without the gaps, did not
start (BENCHMARKS.md, session 31)."""


def checkpoint_dtype(checkpoint: Checkpoint) -> str | None:
    """The dtype the weights are stored in (the most common one in the headers)."""
    counts: dict[str, int] = {}
    for entry in checkpoint.tensors.values():
        counts[entry.dtype] = counts.get(entry.dtype, 0) + entry.numel
    if not counts:
        value = text_config(checkpoint.config).get("torch_dtype") or checkpoint.config.get("dtype")
        return str(value) if value else None
    from worker.loading.checkpoint import SAFETENSORS_DTYPES

    stored = max(counts, key=lambda name: counts[name])
    return str(SAFETENSORS_DTYPES[stored][0]).removeprefix("torch.")


def gguf_file_type(path: Any) -> str | None:
    """A GGUF's `general.file_type` by llama.cpp's name ("Q4_K_M"), from the header."""
    from gguf import LlamaFileType

    from worker.loading.gguf_quant import read_index

    value = read_index(path)[0].get("general.file_type")
    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_") if value is not None else None
    except ValueError:
        return str(value)


def kv_bytes_from_config(config: dict[str, Any], context: int, dtype: torch.dtype) -> int:
    """KV bytes of one session when the model code cannot say: per layer 2 x kv heads x
    head_dim x tokens x element size, sliding layers capped at their window."""
    cfg = text_config(config)
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or ["full_attention"] * layers
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer_type in types[:layers]:
        tokens = (
            min(context, int(window)) if layer_type == "sliding_attention" and window else context
        )
        total += 2 * kv_heads * head_dim * tokens * element
    return total


def describe(
    path: str | None,
    context: int | None,
    dtype: torch.dtype,
    progress: bool = True,
    quantize: QuantizeOptions | None = None,
    tokenizer_path: str | None = None,
    slots: int = 2,
    prefill_chunk: int | None = None,
    gpu_memory_gb: float | None = None,
    device_dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """The metadata `tokenpipe info` prints (see the module docstring); `slots` device cache
    slots (the worker's --max-resident, else --max-sessions: one named session and the scratch
    one by default); `device_dtype` the CUDA worker's dtype for device_estimate (else
    `dtype`); `kv_cache_dtype` the worker's --kv-cache-dtype; `prefill_chunk` the worker's
    --prefill-chunk (None: its CUDA default, 2,048, or ``QUANTIZED_PREFILL_CHUNK`` where a
    quantized model's step fits)."""
    from worker.layers.kv import kv_cache_dtype as parse_kv_dtype
    from worker.loading.loader import open_model_files

    checkpoint, config, tokenizer, gguf_source = open_model_files(
        path, dtype, require_weights=False, progress=progress, tokenizer_path=tokenizer_path
    )
    quantize = quantize or QuantizeOptions()
    kv_dtype = parse_kv_dtype(kv_cache_dtype)
    context = config.context_length if context is None else context
    if context < 1:
        raise ModelLoadError(f"--context must be >= 1, got {context}")
    text_tensors = checkpoint.text_tensors()
    if text_tensors:
        parameters = sum(
            entry.numel
            for name, entry in text_tensors.items()
            if not (name == "lm_head.weight" and config.tie_word_embeddings)
        )
    else:
        parameters = None
    try:
        from worker.models.registry import build_model

        skeleton = build_model(config, "meta", dtype)
        if parameters is None:
            parameters = sum(p.numel() for p in skeleton.parameters())
        bytes_per_session = int(
            skeleton.make_kv_cache(1, context, kv_dtype=kv_dtype).bytes_per_slot
        )
        plan = _plan(skeleton, gguf_source, quantize)
        weights = _weights(skeleton, plan, quantize.mode, dtype, int6_planes=False)
    except ImportError:
        skeleton = None
        bytes_per_session = kv_bytes_from_config(checkpoint.config, context, kv_dtype or dtype)
        weights = {}
    out = {
        "model": str(gguf_source or checkpoint.path),
        "checkpoint_dir": str(checkpoint.path),
        "gguf_source": str(gguf_source) if gguf_source else None,
        "architecture": config.architecture,
        "parameters": parameters,
        "checkpoint_dtype": gguf_file_type(gguf_source)
        if gguf_source
        else checkpoint_dtype(checkpoint),
        "dtype": str(dtype).removeprefix("torch."),
        "context_length": config.context_length,
        "vocab_size": config.vocab_size,
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "num_hidden_layers": config.num_hidden_layers,
        "sliding_window": config.sliding_window,
        "bos_id": tokenizer.bos_id,
        "bos_token": tokenizer.bos_token,
        "eos_ids": sorted(tokenizer.eos_ids),
        "eos_token": tokenizer.eos_token,
        "prefix_ids": tokenizer.prefix_ids,
        "chat_template": tokenizer.chat_template is not None,
        "context": context,
        "kv_cache_dtype": str(kv_dtype or dtype).removeprefix("torch."),
        "bytes_per_session": bytes_per_session,
        **weights,
    }
    if "weights_bytes" in weights:  # what a GPU must hold for one session, before activations
        out["weights_plus_one_session_bytes"] = weights["weights_bytes"] + bytes_per_session
        on_device = device_dtype or dtype
        if on_device != dtype:  # the CUDA worker's own dtype (bf16 unless --dtype says)
            skeleton = build_model(config, "meta", on_device)
        weights = _weights(skeleton, plan, quantize.mode, on_device)  # int6 in GPU planes

        def estimate(
            weights: dict[str, Any], plan: dict[str, Any], kv: torch.dtype | None = kv_dtype
        ) -> dict[str, Any]:
            dense, experts = _dequantized_matmuls(skeleton, plan)
            preferred = 0  # the worker's longer chunk for weights a prefill step dequantizes
            if prefill_chunk is None and (dense or experts):
                preferred = QUANTIZED_PREFILL_CHUNK
            return device_estimate(
                checkpoint.config, weights, (context, config.context_length), on_device, slots,
                prefill_chunk or CUDA_PREFILL_CHUNK,
                _session_bytes(skeleton, checkpoint.config, on_device, kv), gpu_memory_gb,
                fla=_fla_installed(on_device), preferred=preferred, experts_only=not dense,
            )  # fmt: skip

        fitted = estimate(weights, plan)
        if fitted.get("fits") is False and quantize.mode != "int4":  # what int4 would hold
            as_int4 = quantize.as_int4()
            int4_plan = _plan(skeleton, gguf_source, as_int4)
            int4 = estimate(_weights(skeleton, int4_plan, as_int4.mode, on_device), int4_plan)
            fitted["with_quantize_int4"] = {key: int4[key] for key in INT4_FIGURES}
        if fitted.get("fits") is False and kv_dtype is None:  # what an fp8 cache would hold
            fp8 = estimate(weights, plan, parse_kv_dtype("fp8"))
            if fp8["max_context_at_slots"] > fitted["max_context_at_slots"]:  # weights fit
                fitted["with_kv_cache_fp8"] = {key: fp8[key] for key in INT4_FIGURES}
        out["device_estimate"] = {"dtype": str(on_device).removeprefix("torch."), **fitted}
    return out


LOAD_HOLES_BYTES = 1 << 30
"""What `device_estimate` leaves beside the longer prefill chunk's step for the allocator's
holes between the weights, which the worker leaves out of that chunk's room
(``memory.holes_bytes``): 0.93 GiB after the 31B's quantize-at-load (session 47), 0.01-0.27
GiB after a GGUF kept (session 41)."""

INT4_FIGURES = (
    "weights_bytes",
    "total_bytes",
    "fits",
    "fits_with_prefill_chunk",
    "max_slots_at_context",
    "max_context_at_slots",
)
"""``device_estimate.with_quantize_int4``: where the flags' weights do not fit
``--gpu-memory-gb``, the same estimate with ``--quantize int4`` (a Gemma 4 31B Q4_K_M file kept
as it is does not leave room for an 8k session on a 24 GB card; requantized to int4 it does)."""


def fit_advice(estimate: dict[str, Any]) -> str | None:
    """A line for stderr where `estimate` (``device_estimate``) does not fit its
    ``--gpu-memory-gb``: what it needs, and what ``--quantize int4`` would; None where it fits
    or no limit was given."""
    if estimate.get("fits") is not False:
        return None
    need = estimate["total_bytes"] / GIB
    line = (
        f"does not fit --gpu-memory-gb {estimate['gpu_memory_gb']:g}: these flags need "
        f"{need:.2f} GiB ({estimate['slots']} slots of {estimate['context']} tokens; "
        f"{estimate['max_context_at_slots']} tokens would fit)"
    )
    int4 = estimate.get("with_quantize_int4")
    if int4 is not None:
        verdict = "fits" if int4["fits"] else f"{int4['max_context_at_slots']} tokens would fit"
        line += (
            f"; --quantize int4 would need {int4['total_bytes'] / GIB:.2f} GiB "
            f"({int4['weights_bytes'] / GIB:.2f} GiB of weights): {verdict}"
        )
    fp8 = estimate.get("with_kv_cache_fp8")
    if fp8 is not None:
        verdict = "fits" if fp8["fits"] else f"{fp8['max_context_at_slots']} tokens would fit"
        line += f"; --kv-cache-dtype fp8 would need {fp8['total_bytes'] / GIB:.2f} GiB: {verdict}"
    return line


def _dequantized_matmuls(skeleton: Any, plan: dict[str, Any]) -> tuple[bool, bool]:
    """Whether `plan` quantizes a dense matmul of `skeleton` besides its LM head, and whether
    it quantizes a sparse MoE's experts: a worker's prefill dequantizes either a chunk at a
    time (experts only with their float scratch) and then takes the longer default chunk where
    it fits (``worker.main._dequantizes_per_chunk``)."""
    from worker.layers.moe import FusedExperts

    dense = experts = False
    for name, fmt in plan.items():
        if fmt is None or name == HEAD:
            continue
        try:
            module = skeleton.get_submodule(name)
        except AttributeError:  # a tensor the model folds elsewhere
            continue
        dense |= isinstance(module, torch.nn.Linear)
        experts |= isinstance(module, FusedExperts)
    return dense, experts


def _fla_installed(dtype: torch.dtype) -> bool:
    """Whether a CUDA worker here would prefill DeltaNet layers with fla's kernels (in bf16/fp16,
    ``deltanet.fla_installed``), without importing fla."""
    from worker.layers.deltanet import fla_installed

    return dtype in (torch.bfloat16, torch.float16) and fla_installed()


def _session_bytes(
    skeleton: Any, config: dict[str, Any], dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> Any:
    """One slot's cache bytes at a context: the model's own cache layout on the meta device
    (its attention layers in `kv_dtype`, None: the model's), or the config's KV arithmetic for a
    family without one."""
    if skeleton is not None:
        return lambda tokens: int(
            skeleton.make_kv_cache(1, tokens, kv_dtype=kv_dtype).bytes_per_slot
        )
    return lambda tokens: kv_bytes_from_config(config, tokens, kv_dtype or dtype)


def device_estimate(
    config: dict[str, Any],
    weights: dict[str, Any],
    contexts: tuple[int, int],
    dtype: torch.dtype,
    slots: int,
    prefill_chunk: int,
    session_bytes: Any,
    gpu_memory_gb: float | None = None,
    fla: bool = False,
    preferred: int = 0,
    experts_only: bool = False,
) -> dict[str, Any]:
    """What a CUDA worker with `slots` cache slots of `context` tokens (`contexts`: it and the
    model's longest) holds at its peak (see the module docstring), and with `gpu_memory_gb`
    whether it fits, the prefill chunk the worker's default would fall back to where it does not
    (None where none does), the most slots of `context` and the longest context of `slots` that
    would at `prefill_chunk`. The step counts the prefix cache's states at block ends (on by
    default); its pool is left out: the worker sizes it from what is left (15%; with
    `gpu_memory_gb` reported as ``prefix_pool_bytes``, 0 where it would hold less than
    ``MIN_PREFIX_TOKENS`` tokens and the worker leaves it off, and then no states).
    `fla`: a hybrid model's DeltaNet prefill runs fla's kernels (reported as
    ``deltanet_prefill``). `preferred`: the worker's longer default chunk for quantized
    weights (``QUANTIZED_PREFILL_CHUNK``; 0: none), which ``fits_with_prefill_chunk`` names
    where its step fits beside the slots, the pool and ``LOAD_HOLES_BYTES``, as the worker
    takes it (`experts_only`: the quantized weights are a sparse MoE's experts, which need
    room for twice their float scratch too). The figures above stay at `prefill_chunk`: the
    longer step only takes room nothing else claims."""
    context, longest = contexts
    session = session_bytes(context)
    every = PREFIX_BLOCK  # the prefix cache on: a hybrid step keeps states at block ends
    pool = None
    if gpu_memory_gb is not None:  # the pool the worker would size, and whether it holds anything
        plain = prefill_step_bytes(config, prefill_chunk, dtype, 0, fla)
        left = int(gpu_memory_gb * GIB) - weights["weights_bytes"] - RUNTIME_BYTES
        pool = default_prefix_pool_bytes(left - slots * session - plain)
        if pool < session_bytes(MIN_PREFIX_TOKENS):
            every = pool = 0  # left off, as the worker does
    step = prefill_step_bytes(config, prefill_chunk, dtype, every, fla)
    fixed = weights["weights_bytes"] + step + RUNTIME_BYTES
    out: dict[str, Any] = {
        "slots": slots,
        "context": context,
        "weights_bytes": weights["weights_bytes"],
        "sessions_bytes": slots * session,
        "prefill_step_bytes": step,
        "runtime_bytes": RUNTIME_BYTES,
        "total_bytes": fixed + slots * session,
    }
    if text_config(config).get("linear_num_value_heads"):
        out["deltanet_prefill"] = "fla" if fla else "torch"
    scratch = weights.get("expert_scratch_bytes", 0)
    if scratch:  # the faster MoE prefill's scratch, used only where twice it fits
        out["expert_scratch_bytes"] = scratch
    if gpu_memory_gb is None:
        return out
    out["prefix_pool_bytes"] = pool
    limit = int(gpu_memory_gb * GIB)
    room = limit - fixed
    out["gpu_memory_gb"] = gpu_memory_gb
    out["fits"] = out["total_bytes"] <= limit
    out["fits_with_prefill_chunk"] = fit_prefill_chunk(  # as the worker's default falls back
        config, prefill_chunk, dtype, limit - (out["total_bytes"] - step), every, fla
    )
    preferred = min(preferred, context)  # as the worker: no prompt is longer than a session
    beside = limit - (out["total_bytes"] - step) - (pool or 0)
    if experts_only and beside < 2 * scratch:  # the experts run on their codes: nothing is
        preferred = 0  # dequantized a chunk at a time
    if preferred > prefill_chunk:
        need = prefill_step_bytes(config, preferred, dtype, every, fla) + LOAD_HOLES_BYTES
        if need <= beside:
            out["fits_with_prefill_chunk"] = preferred
    out["max_slots_at_context"] = max(0, room // session) if session else None
    out["max_context_at_slots"] = _longest_context(session_bytes, room // slots, longest)
    return out


def _longest_context(session_bytes: Any, budget: int, ceiling: int) -> int:
    """The longest context <= `ceiling` (to 256 tokens) whose one slot costs <= `budget`; 0 if
    none does. Cache bytes grow with the context, so a bisection over 256-token steps."""
    low, high = 0, ceiling // 256
    while low < high:
        middle = (low + high + 1) // 2
        if session_bytes(middle * 256) <= budget:
            low = middle
        else:
            high = middle - 1
    return low * 256


def _plan(skeleton: Any, gguf_source: Any, quantize: QuantizeOptions) -> dict[str, Any]:
    """Each weight's format under `quantize`: the GGUF's own (its header read once) for auto
    on a GGUF, else the plan the loader would make from the shapes (any dtype's skeleton)."""
    from worker.loading.quantize import plan_for_gguf, plan_for_model

    if quantize.mode == "auto" and gguf_source is not None:
        return plan_for_gguf(gguf_source)
    return plan_for_model(skeleton, quantize)


def _weights(
    skeleton: Any,
    plan: dict[str, Any],
    mode: str,
    dtype: torch.dtype,
    int6_planes: bool = True,
) -> dict[str, Any]:
    """`mode` (--quantize), each tensor group's format and bytes under `plan` (``_plan``), and
    the bytes a decode step reads (the CPU and the CUDA paths keep the same formats). int6:
    with `int6_planes` (the device estimate) in a GPU's 6-bit planes, 7 bits a weight at g16,
    which a worker chooses where memory is tight; else (the top level's figures, a CPU
    worker's) as int8 bytes, as a CPU, or a GPU with room to spare, holds them."""
    described = describe_weights(skeleton, plan, dtype, int6_planes)
    stored = sum(entry["bytes"] for entry in described["formats"].values())
    out = {"quantize": mode, **described, "weights_bytes": stored}
    scratch = expert_scratch_bytes(skeleton, plan, dtype)
    return {**out, "expert_scratch_bytes": scratch} if scratch else out


def expert_scratch_bytes(skeleton: Any, plan: dict[str, Any], dtype: torch.dtype) -> int:
    """Quantized MoE experts' float scratch for a prefill step (one layer's experts dequantized,
    ``quant_experts.dequant_scratch_bytes`` once loaded): 0 where no experts are quantized."""
    from worker.layers.moe import FusedExperts

    element = torch.empty((), dtype=dtype).element_size()
    return max(
        (
            (module.gate_up_proj.numel() + module.down_proj.numel()) * element
            for name, module in skeleton.named_modules()
            if isinstance(module, FusedExperts) and plan.get(name) is not None
        ),
        default=0,
    )


@click.command("info")
@click.option("--model", "model_path", default=None, help="HF checkpoint dir or .gguf file.")
@click.option("--model_path", "model_path_alias", default=None, hidden=True)
@click.option("--context", type=int, default=None, help="Tokens per session (default: model's).")
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPES)),
    default=None,
    help="Compute dtype the memory figures assume (default: float32, a CPU worker's; "
    "device_estimate: bfloat16, a CUDA worker's).",
)
@click.option(
    "--quantize",
    type=click.Choice(["auto", "none", "int8", "int4", "int4-mixed", "int4-experts"]),
    default="auto",
    show_default=True,
    help="The weight formats to report (as the worker's flag).",
)
@click.option("--group-size", type=click.IntRange(min=2), default=None)
@click.option("--tokenizer_path", "--tokenizer-path", "tokenizer_path", default=None,
              help="tokenizer.json, where the model directory has none.")  # fmt: skip
@click.option("--max-sessions", type=click.IntRange(min=1), default=2, show_default=True,
              help="As the worker's flag: device cache slots in device_estimate (one named "
              "session and the scratch one by default).")  # fmt: skip
@click.option(
    "--max-resident",
    type=click.IntRange(min=1),
    default=None,
    help="As the worker's flag: the slots on the device when fewer than sessions.",
)
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=None,
              help="As the worker's flag (default 2048, its CUDA default; 4096 where dense "
              "matmuls are quantized and that step fits).")  # fmt: skip
@click.option(
    "--gpu-memory-gb",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="A card's memory: whether device_estimate fits it, and what would.",
)
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", "fp8"]),
    default="auto",
    show_default=True,
    help="As the worker's flag: the KV cache's format (fp8: half a bf16 cache's bytes).",
)
def command(
    model_path: str | None,
    model_path_alias: str | None,
    context: int | None,
    dtype: str | None,
    quantize: str,
    group_size: int | None,
    tokenizer_path: str | None,
    max_sessions: int,
    max_resident: int | None,
    prefill_chunk: int | None,
    gpu_memory_gb: float | None,
    kv_cache_dtype: str,
) -> None:
    """Print the model's metadata as JSON (architecture, parameters, context, vocabulary,
    BOS/EOS ids, chat template, KV memory per session, weight formats, and what a CUDA worker
    with these flags would hold: device_estimate) without loading the weights."""
    try:
        if max_resident is not None and max_resident > max_sessions:
            raise ValueError(
                f"--max-resident {max_resident} is above --max-sessions {max_sessions}"
            )
        options = QuantizeOptions(quantize, group_size)
        info = describe(
            model_path or model_path_alias, context, DTYPES[dtype or "float32"],
            quantize=options, tokenizer_path=tokenizer_path, slots=max_resident or max_sessions,
            prefill_chunk=prefill_chunk, gpu_memory_gb=gpu_memory_gb,
            device_dtype=DTYPES[dtype or "bfloat16"], kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
    except (ModelLoadError, ValueError) as exc:
        click.echo(f"tokenpipe info: error: {exc}", err=True)
        sys.exit(1)
    advice = fit_advice(info.get("device_estimate", {}))
    if advice is not None:
        click.echo(f"tokenpipe info: {advice}", err=True)
    click.echo(json.dumps(info, indent=2))
