"""`tokenpipe info`: the model's metadata as JSON, without loading the weights.

Reads config.json, the tokenizer and the safetensors headers (a GGUF file is converted into its
cache directory first, once). Memory per session comes from the KV cache the model would build
for one slot at `--context` tokens, computed on the meta device (no memory allocated).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import torch

from worker.loading.checkpoint import Checkpoint, ModelLoadError, text_config
from worker.loading.quantize import QuantizeOptions, describe_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
) -> dict[str, Any]:
    """The metadata `tokenpipe info` prints (see the module docstring)."""
    from worker.loading.loader import open_model_files

    checkpoint, config, tokenizer, gguf_source = open_model_files(
        path, dtype, require_weights=False, progress=progress
    )
    quantize = quantize or QuantizeOptions()
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
        bytes_per_session = int(skeleton.make_kv_cache(1, context).bytes_per_slot)
        weights = _weights(skeleton, gguf_source, quantize, dtype)
    except ImportError:
        bytes_per_session = kv_bytes_from_config(checkpoint.config, context, dtype)
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
        "bytes_per_session": bytes_per_session,
        **weights,
    }
    if "weights_bytes" in weights:  # what a GPU must hold for one session, before activations
        out["weights_plus_one_session_bytes"] = weights["weights_bytes"] + bytes_per_session
    return out


def _weights(
    skeleton: Any, gguf_source: Any, quantize: QuantizeOptions, dtype: torch.dtype
) -> dict[str, Any]:
    """`quantize`, each tensor group's format and bytes, and the bytes a decode step reads
    (the CPU and the CUDA paths keep the same formats)."""
    from worker.loading.quantize import plan_for_gguf, plan_for_model

    if quantize.mode == "auto" and gguf_source is not None:
        plan = plan_for_gguf(gguf_source)
    else:
        plan = plan_for_model(skeleton, quantize)
    described = describe_weights(skeleton, plan, dtype)
    stored = sum(entry["bytes"] for entry in described["formats"].values())
    return {"quantize": quantize.mode, **described, "weights_bytes": stored}


@click.command("info")
@click.option("--model", "model_path", default=None, help="HF checkpoint dir or .gguf file.")
@click.option("--model_path", "model_path_alias", default=None, hidden=True)
@click.option("--context", type=int, default=None, help="Tokens per session (default: model's).")
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPES)),
    default="float32",
    show_default=True,
    help="Compute dtype the memory figures assume.",
)
@click.option(
    "--quantize",
    type=click.Choice(["auto", "none", "int8", "int4", "int4-mixed", "int4-experts"]),
    default="auto",
    show_default=True,
    help="The weight formats to report (as the worker's flag).",
)
@click.option("--group-size", type=click.IntRange(min=2), default=None)
def command(
    model_path: str | None,
    model_path_alias: str | None,
    context: int | None,
    dtype: str,
    quantize: str,
    group_size: int | None,
) -> None:
    """Print the model's metadata as JSON (architecture, parameters, context, vocabulary,
    BOS/EOS ids, chat template, KV memory per session) without loading the weights."""
    try:
        options = QuantizeOptions(quantize, group_size)
        info = describe(model_path or model_path_alias, context, DTYPES[dtype], quantize=options)
    except (ModelLoadError, ValueError) as exc:
        click.echo(f"tokenpipe info: error: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(info, indent=2))
