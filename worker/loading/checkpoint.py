"""Opening a Hugging Face checkpoint directory.

`open_checkpoint(path)` reads `config.json`, finds the weights (one or many `*.safetensors`,
with `model.safetensors.index.json` when sharded), the tokenizer, the chat template and the EOS
ids, and validates every safetensors header up front, so a truncated or corrupt file fails here
with a `ModelLoadError` naming the file instead of halfway through loading.

Weights are read one tensor at a time (`Checkpoint.iter_tensors`). Each tensor is read with
`readinto` straight from the file into a fresh tensor instead of through a memory map: pages of a
mapped file count towards the process's resident set while the file stays open, so mapping a
single-file 1 GB checkpoint and copying it into the model would show 2 GB peak RSS. Reading keeps
the host's peak near the model plus one tensor. Nothing here unpickles (no `torch.load`, ever).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class ModelLoadError(Exception):
    """A model could not be loaded; the message says what is wrong and what to do about it."""


# safetensors dtype names -> (torch dtype, bytes per element)
SAFETENSORS_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
TORCH_TO_SAFETENSORS = {dtype: name for name, (dtype, _) in SAFETENSORS_DTYPES.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024

# Multimodal checkpoints (Gemma 3/4 ConditionalGeneration) nest the text stack; these prefixes
# are renamed to the text model's names, and the towers/projectors of other modalities skipped.
TEXT_PREFIX_RENAMES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
NON_TEXT_PREFIXES: tuple[str, ...] = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.multi_modal_projector.",
    "model.embed_vision.",
    "model.embed_audio.",
    "vision_tower.",
    "audio_tower.",
    "multi_modal_projector.",
    "embed_vision.",
    "embed_audio.",
    "model.visual.",  # Qwen3.5's vision tower
    "mtp.",  # Qwen3.5's multi-token-prediction head
)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, absolute byte range, dtype and shape (from the header)."""

    name: str
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute offset of the first byte in `file`
    end: int  # absolute offset one past the last byte

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def text_model_name(name: str) -> str | None:
    """The text model's name for a checkpoint tensor name, or None to skip it (vision, audio)."""
    for prefix in NON_TEXT_PREFIXES:
        if name.startswith(prefix):
            return None
    for old, new in TEXT_PREFIX_RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate one safetensors file's header; raise ModelLoadError if it is corrupt.

    Checks: the 8-byte length prefix, valid JSON, known dtypes, byte ranges that match the shape
    and lie inside the file (a truncated download fails here).
    """
    try:
        file_size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelLoadError(f"{path}: not a safetensors file (only {file_size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise ModelLoadError(
                    f"{path}: corrupt or truncated safetensors file (header claims {header_len} "
                    f"bytes, file has {file_size}); re-download it"
                )
            raw = handle.read(header_len)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc})") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(
            f"{path}: corrupt safetensors header ({exc}); re-download the file"
        ) from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: corrupt safetensors entry for {name!r}") from exc
        if dtype not in SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        itemsize = SAFETENSORS_DTYPES[dtype][1]
        if end - begin != math.prod(shape) * itemsize or begin < 0:
            raise ModelLoadError(
                f"{path}: corrupt safetensors entry for {name!r}: shape {list(shape)} of {dtype} "
                f"does not fit byte range [{begin}, {end})"
            )
        if data_start + end > file_size:
            raise ModelLoadError(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                f"{data_start + end} but the file has {file_size} bytes; re-download it"
            )
        entries[name] = TensorEntry(name, path, dtype, shape, data_start + begin, data_start + end)
    return entries


def read_tensor(entry: TensorEntry, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read one tensor from its file into `out` (a contiguous CPU tensor of the same dtype and
    shape, e.g. the model's parameter) or a new CPU tensor. No memory map, no pickle."""
    dtype, _ = SAFETENSORS_DTYPES[entry.dtype]
    tensor = torch.empty(entry.shape, dtype=dtype) if out is None else out.detach()
    buffer = memoryview(tensor.view(-1).view(torch.uint8).numpy())
    with entry.file.open("rb", buffering=0) as handle:
        handle.seek(entry.begin)
        filled = 0
        while filled < len(buffer):
            count = handle.readinto(buffer[filled:])
            if not count:
                raise ModelLoadError(f"{entry.file}: truncated while reading tensor {entry.name!r}")
            filled += count
    return tensor if out is None else out


def can_read_into(entry: TensorEntry, target: torch.Tensor | None) -> bool:
    """Whether `entry` can be read straight into `target` (same dtype/shape, contiguous CPU)."""
    return (
        target is not None
        and target.device.type == "cpu"
        and target.dtype == SAFETENSORS_DTYPES[entry.dtype][0]
        and tuple(target.shape) == entry.shape
        and target.is_contiguous()
    )


def load_json(path: Path, what: str) -> dict[str, Any]:
    """Read a JSON object file, turning any failure into a ModelLoadError."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {what} {path}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{what} {path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{what} {path} is not a JSON object")
    return value


def as_id_list(value: Any) -> list[int]:
    """An `eos_token_id`-style field (int, list of ints or null) as a list."""
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: `text_config` of a multimodal config, else the config itself."""
    nested = config.get("text_config")
    if isinstance(nested, dict) and "hidden_size" in nested:
        return nested
    return config


@dataclass(frozen=True)
class Checkpoint:
    """An opened Hugging Face checkpoint directory. Weights are read lazily, one at a time."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorEntry]  # by the checkpoint's own names
    tokenizer_path: Path | None
    tokenizer_config: dict[str, Any] | None
    generation_config: dict[str, Any] | None
    chat_template: str | None
    chat_template_path: Path | None
    weight_files: tuple[Path, ...] = field(default=())

    @property
    def eos_ids(self) -> list[int]:
        """EOS ids from config.json and generation_config.json, in order, deduplicated."""
        ids = as_id_list(text_config(self.config).get("eos_token_id"))
        ids += as_id_list(self.config.get("eos_token_id"))
        if self.generation_config:
            ids += as_id_list(self.generation_config.get("eos_token_id"))
        return list(dict.fromkeys(ids))

    def text_tensors(self) -> dict[str, TensorEntry]:
        """The text model's tensors by HF text-model name (multimodal prefixes mapped away)."""
        renamed: dict[str, TensorEntry] = {}
        for name, entry in self.tensors.items():
            target = text_model_name(name)
            if target is not None:
                renamed[target] = entry
        return renamed

    def parameter_count(self) -> int:
        """Elements in the text model's tensors, from the headers only."""
        return sum(entry.numel for entry in self.text_tensors().values())

    def iter_tensors(
        self,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        targets: Mapping[str, torch.Tensor] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, tensor)` one at a time, in file order.

        Floating tensors are converted to `dtype` and moved to `device` when given; at most one
        tensor (plus its converted copy) is alive on the host at a time. Vision/audio tensors of
        multimodal checkpoints are skipped and the text stack's names mapped to the text model's.

        `targets` (the model's `state_dict(keep_vars=True)`): a tensor whose target is a CPU
        tensor of the same dtype and shape is read straight into it and the target itself is
        yielded (the model's `copy_` of a tensor into itself is free): no staging copy at all.
        """
        ordered = sorted(self.text_tensors().items(), key=lambda kv: (str(kv[1].file), kv[1].begin))
        for name, entry in ordered:
            target = targets.get(name) if targets is not None else None
            if can_read_into(entry, target) and (dtype is None or target.dtype == dtype):
                yield name, read_tensor(entry, out=target)
                continue
            tensor = read_tensor(entry)
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype=dtype)
            if device is not None:
                tensor = tensor.to(device=device)
            yield name, tensor


def find_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint (from the shard index when there is one)."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        index = load_json(index_path, "shard index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"shard index {index_path} has no weight_map")
        names = list(dict.fromkeys(str(v) for v in weight_map.values()))
        files = [directory / name for name in names]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(
                f"{directory}: shard index names files that are missing: {', '.join(missing)}"
            )
        return files
    return sorted(directory.glob("*.safetensors"))


def read_chat_template(
    directory: Path, tokenizer_config: dict[str, Any] | None
) -> tuple[str | None, Path | None]:
    """The chat template: `chat_template.jinja` wins, else tokenizer_config's `chat_template`."""
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.exists():
        return jinja_path.read_text(encoding="utf-8"), jinja_path
    json_path = directory / "chat_template.json"
    if json_path.exists():
        template = load_json(json_path, "chat template").get("chat_template")
        if isinstance(template, str):
            return template, json_path
    if tokenizer_config is not None:
        template = tokenizer_config.get("chat_template")
        if isinstance(template, str):
            return template, None
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            chosen = by_name.get("default") or next(iter(by_name.values()), None)
            if isinstance(chosen, str):
                return chosen, None
    return None, None


def open_checkpoint(path: str | os.PathLike[str], require_weights: bool = True) -> Checkpoint:
    """Open an HF checkpoint directory (or its `config.json`) and validate its files.

    Raises ModelLoadError for a missing directory or config, no weights (when required), a shard
    index naming missing files, or a corrupt/truncated safetensors header.
    """
    root = Path(path).expanduser()
    if root.is_file() and root.name.endswith(".json"):
        root = root.parent
    if not root.exists():
        raise ModelLoadError(f"model path {root} does not exist")
    if not root.is_dir():
        raise ModelLoadError(
            f"model path {root} is neither a checkpoint directory nor a .gguf file"
        )
    config_path = root / "config.json"
    if not config_path.exists():
        raise ModelLoadError(
            f"{root} has no config.json; pass a Hugging Face checkpoint directory "
            "(config.json, *.safetensors, tokenizer.json) or a .gguf file"
        )
    config = load_json(config_path, "config")

    weight_files = find_weight_files(root)
    if require_weights and not weight_files:
        pickled = sorted(p.name for p in root.glob("*.bin")) + sorted(
            p.name for p in root.glob("*.pt")
        )
        hint = (
            f" (found {', '.join(pickled)}: pickle checkpoints are never loaded; convert them "
            "to safetensors)"
            if pickled
            else ""
        )
        raise ModelLoadError(f"{root} has no *.safetensors weights{hint}")
    tensors: dict[str, TensorEntry] = {}
    for weight_file in weight_files:
        for name, entry in read_safetensors_header(weight_file).items():
            if name in tensors:
                raise ModelLoadError(f"{root}: tensor {name!r} appears in two weight files")
            tensors[name] = entry

    tokenizer_path = root / "tokenizer.json"
    tokenizer_config_path = root / "tokenizer_config.json"
    generation_config_path = root / "generation_config.json"
    tokenizer_config = (
        load_json(tokenizer_config_path, "tokenizer config")
        if tokenizer_config_path.exists()
        else None
    )
    generation_config = (
        load_json(generation_config_path, "generation config")
        if generation_config_path.exists()
        else None
    )
    chat_template, chat_template_path = read_chat_template(root, tokenizer_config)
    return Checkpoint(
        path=root,
        config=config,
        tensors=tensors,
        tokenizer_path=tokenizer_path if tokenizer_path.exists() else None,
        tokenizer_config=tokenizer_config,
        generation_config=generation_config,
        chat_template=chat_template,
        chat_template_path=chat_template_path,
        weight_files=tuple(weight_files),
    )
