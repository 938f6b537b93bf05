"""`load_model`: the one entry point the engine uses to get a model and its tokenizer.

    loaded = load_model(path_or_None, device, dtype)
    loaded.model        CausalLM (HF parameter names, the model contract of ARCHITECTURE.md)
    loaded.tokenizer    Tokenizer
    loaded.config       ModelConfig
    loaded.meta         dict: source, checkpoint_dir, architecture, parameters, dtype, ...

`path` is an HF checkpoint directory (or its config.json), a `.gguf` file (converted once into a
cached HF-layout directory), or None for the default model. Every failure a user can fix is a
`ModelLoadError` with a message saying what is wrong.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worker.loading.checkpoint import Checkpoint, ModelLoadError, open_checkpoint
from worker.loading.gguf_convert import Progress, convert_gguf, dtype_name
from worker.loading.quantize import begin_load
from worker.loading.staged_load import StagingStats, staged_tensors
from worker.loading.tokenizer import Tokenizer, TokenizerError

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "resolve_checkpoint_dir"]


@dataclass
class LoadedModel:
    model: Any  # worker.models.causal_lm.CausalLM
    tokenizer: Tokenizer
    config: Any  # worker.models.config.ModelConfig
    meta: dict[str, Any] = field(default_factory=dict)


def cache_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype a GGUF is dequantized into for the cache: float32 unless the compute dtype is a
    16-bit float (then that, halving the cache and the load)."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def resolve_checkpoint_dir(
    path: str | os.PathLike[str] | None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    gguf_weights: bool = False,
) -> tuple[Path, Path | None]:
    """(HF checkpoint directory, the GGUF file it came from or None) for a `--model` value.
    A GGUF's directory holds its config and tokenizer (loads read the tensors from the file
    itself), and its weights dequantized only with `gguf_weights` (for tools that hand the
    directory to transformers)."""
    if path is None:
        from worker.loading.default_model import default_model_path

        path = default_model_path()
    source = Path(path).expanduser()
    if source.is_dir() and not (source / "config.json").exists():
        ggufs = sorted(source.glob("*.gguf"))
        if len(ggufs) == 1:  # a directory holding just one GGUF file means that file
            source = ggufs[0]
    if source.suffix.lower() == ".gguf" or (source.is_file() and _is_gguf(source)):
        if not source.is_file():
            raise ModelLoadError(f"GGUF file {source} does not exist")
        directory = convert_gguf(
            source, cache_dtype_for(dtype), progress=progress, weights=gguf_weights
        )
        return directory, source
    return source, None


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def open_model_files(
    path: str | os.PathLike[str] | None,
    dtype: torch.dtype = torch.float32,
    require_weights: bool = True,
    tokenizer_path: str | os.PathLike[str] | None = None,
    progress: bool = True,
    gguf_weights: bool = False,
) -> tuple[Checkpoint, Any, Tokenizer, Path | None]:
    """Everything but the weights: (checkpoint, ModelConfig, Tokenizer, GGUF source or None).
    A GGUF is dequantized into the cache only with `gguf_weights`."""
    from worker.models.config import ModelConfig
    from worker.models.registry import SUPPORTED_ARCHITECTURES

    directory, gguf_source = resolve_checkpoint_dir(path, dtype, progress, gguf_weights)
    checkpoint = open_checkpoint(
        directory, require_weights=require_weights and (gguf_source is None or gguf_weights)
    )
    try:
        config = ModelConfig.from_hf(checkpoint.config)
    except (ValueError, KeyError, TypeError) as exc:
        message = str(exc)
        if "upported" in message and "architecture" in message:
            raise ModelLoadError(message) from exc
        names = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelLoadError(
            f"{directory / 'config.json'}: {message} (supported architectures: {names})"
        ) from exc
    tokenizer_file = Path(tokenizer_path) if tokenizer_path else checkpoint.tokenizer_path
    if tokenizer_file is None or not tokenizer_file.exists():
        missing = tokenizer_file if tokenizer_file is not None else directory / "tokenizer.json"
        raise ModelLoadError(
            f"tokenizer file {missing} is missing; the checkpoint needs a tokenizer.json "
            "(or pass --tokenizer_path)"
        )
    try:
        tokenizer = Tokenizer.from_file(
            tokenizer_file,
            tokenizer_config=checkpoint.tokenizer_config,
            generation_config=checkpoint.generation_config,
            config=checkpoint.config,
            chat_template=checkpoint.chat_template,
        )
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from exc
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"tokenizer {tokenizer_file} has {tokenizer.vocab_size} tokens but the model's "
            f"embedding has {config.vocab_size} rows (config.json vocab_size); the tokenizer "
            "does not belong to this model"
        )
    return checkpoint, config, tokenizer, gguf_source


def check_shapes(tensors: dict[str, Any], model: torch.nn.Module) -> None:
    """Fail before reading any weight if a tensor's shape disagrees with the config
    (`tensors`: HF name -> an entry with `.shape` and `.file`)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    for name, entry in tensors.items():
        shape = expected.get(name)
        if shape is not None and shape != tuple(entry.shape):
            raise ModelLoadError(
                f"config does not match the weights: tensor {name!r} has shape "
                f"{list(entry.shape)} in {entry.file.name} but config.json implies {list(shape)}"
            )


def _with_progress(
    pairs: Iterable[tuple[str, torch.Tensor]], total: int, label: str, enabled: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    bar = Progress(label, total, enabled)
    try:
        for pair in pairs:
            yield pair
            bar.advance()
    finally:
        bar.close()


def draw_random_weights(model: torch.nn.Module, device: torch.device, seed: int) -> None:
    """`--random-weights`: drawn on the GPU when the model is there (seconds for 31B), else
    from the CPU generator (the values the CPU tests rely on)."""
    if device.type == "cuda":
        from worker.device.kernels.random_weights import init_random_weights_on_device

        init_random_weights_on_device(model, seed)
        torch.cuda.synchronize(device)
    else:
        from worker.loading.random_init import init_random_weights

        init_random_weights(model, seed)


def load_model(
    path: str | os.PathLike[str] | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    random_weights: bool = False,
    progress: bool = True,
    tokenizer_path: str | os.PathLike[str] | None = None,
    seed: int = 0,
    quantize: Any = None,
    shard: Any = None,
) -> LoadedModel:
    """Load a model and its tokenizer onto `device` in `dtype` (see the module docstring).

    With `random_weights`, `path` only needs a config.json (and a tokenizer.json); weights are
    drawn from `seed` on the device itself (on CUDA: `init_random_weights_on_device`, whose
    values differ from the CPU draw). On CUDA the safetensors bytes go through reused pinned
    staging buffers straight into the parameters, reads overlapped with copies
    (`worker.loading.staged_load`); on the CPU each tensor is read straight into its parameter.
    With `shard` (a `worker.parallel.group.TensorParallelGroup`), the model is one tensor-parallel
    rank's: built from its config, given its slice of each tensor, its collectives installed.
    """
    from worker.models.registry import build_model

    started = time.monotonic()
    phases: dict[str, float] = {}
    # a GGUF's tensors are read from the file itself, kept quantized or dequantized as they
    # stream (on a GPU, there): its cache directory holds the config and tokenizer only, never
    # a dequantized copy (62 GB for 31B in bf16)
    checkpoint, config, tokenizer, gguf_source = open_model_files(
        path,
        dtype,
        require_weights=not random_weights,
        tokenizer_path=tokenizer_path,
        progress=progress,
    )
    device = torch.device(device)
    if shard is not None:
        shard = shard.bind(config)
    phases["files"] = time.monotonic() - started
    # on the meta device first: the quantized modules go in before any storage is given, so
    # a planned weight never has a float copy on the device (a 31B model into 24 GB)
    model = build_model(config if shard is None else shard.config(), "meta", dtype)
    # counted on the float skeleton: quantized modules keep their weights in buffers
    parameters = sum(p.numel() for p in model.parameters())
    stored_tensors: dict[str, Any] = checkpoint.text_tensors()
    if gguf_source is not None and not random_weights:
        from worker.loading.gguf_quant import gguf_tensor_entries

        stored_tensors = gguf_tensor_entries(gguf_source)
    if not random_weights and shard is None:
        check_shapes(stored_tensors, model)
    # `quantize` (a QuantizeOptions): quantized layers planned and installed here, before
    # any weight is read; a GGUF kept quantized is its own tensor source
    quantized = begin_load(model, quantize, None if random_weights else gguf_source, device, dtype)
    model = model.to_empty(device=device).eval()
    weights_started = time.monotonic()
    staging: StagingStats | None = None  # where a staged (CUDA) load's time went
    phases["allocate"] = weights_started - started - phases["files"]
    if random_weights and shard is not None:
        shard.draw_random(model, device, dtype, seed)  # the full model's draw, then a slice
    elif random_weights:
        draw_random_weights(model, device, seed)
        if quantized is not None:
            quantized.draw_random(model, seed)
    else:
        targets = model.state_dict(keep_vars=True)
        pairs: Iterable[tuple[str, Any]]
        if quantized is not None and quantized.pairs is not None:
            pairs = quantized.pairs
        elif gguf_source is not None:  # read as floats (`--quantize none|int8|int4`)
            from worker.loading.gguf_quant import iter_gguf_tensors

            pairs = iter_gguf_tensors(gguf_source, dtype, {}, warn=False, device=device)
        elif shard is not None:  # whole tensors read on the host, the rank's slice moved
            pairs = checkpoint.iter_tensors(dtype=dtype, targets=targets)
        elif device.type == "cuda":
            transient = quantized.transient_names(model) if quantized is not None else None
            views = getattr(model, "staging_views", None)  # tensors that land inside a parameter
            staged = {**targets, **views()} if callable(views) else targets
            staging = StagingStats()
            pairs = staged_tensors(
                checkpoint.text_tensors(), staged, transient=transient, device=device,
                stats=staging,
            )  # fmt: skip
        else:
            pairs = checkpoint.iter_tensors(device=device, dtype=dtype, targets=targets)
        if shard is not None:
            pairs = shard.tensors(pairs, device)
        total = len(stored_tensors)
        label = f"loading {(gguf_source or checkpoint.path).name}"
        try:
            model.load_weights(_with_progress(pairs, total, label, progress and total > 0))
        except ValueError as exc:
            raise ModelLoadError(f"{checkpoint.path}: {exc}") from exc
        if quantized is not None:
            quantized.finish(model)
    if shard is not None:
        shard.parallelize(model)
    if quantized is not None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the float temporaries of the quantization
        if progress:
            from worker.loading.quantize import summary

            parts = ", ".join(
                f"{key} {entry['tensors']} tensors {entry['bytes'] / 1e9:.2f} GB"
                for key, entry in summary(model).items()
            )
            print(f"[tokenpipe quantize] weights on {device}: {parts}", file=sys.stderr)
    weights_seconds = phases["weights"] = time.monotonic() - weights_started
    meta: dict[str, Any] = {
        "model": str(gguf_source or checkpoint.path),
        "checkpoint_dir": str(checkpoint.path),
        "gguf_source": str(gguf_source) if gguf_source else None,
        "architecture": config.architecture,
        "parameters": parameters,
        "dtype": dtype_name(dtype),
        "device": str(device),
        "context_length": config.context_length,
        "vocab_size": config.vocab_size,
        "random_weights": random_weights,
        "load_seconds": round(time.monotonic() - started, 3),
        "weights_seconds": round(weights_seconds, 3),
        "load_phases": {name: round(seconds, 3) for name, seconds in phases.items()},
    }
    if staging is not None:
        meta["staging"] = staging.as_dict()
    if progress and not random_weights:
        stored = sum(e.end - e.begin for e in stored_tensors.values())
        rate = stored / max(weights_seconds, 1e-9) / 1e9
        print(
            f"read {stored / 1e9:.2f} GB of weights in {weights_seconds:.1f}s ({rate:.2f} GB/s)",
            file=sys.stderr,
        )
        if staging is not None:
            print(f"  staged: {staging.describe()}", file=sys.stderr)
    elif progress:
        print(f"drew random weights on {device} in {weights_seconds:.1f}s", file=sys.stderr)
    if progress:
        print(
            f"loaded {meta['model']} ({config.architecture}, {parameters / 1e6:.0f}M parameters, "
            f"{meta['dtype']}, {device}) in {meta['load_seconds']:.1f}s ("
            + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in phases.items())
            + ")",
            file=sys.stderr,
        )
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, meta=meta)
