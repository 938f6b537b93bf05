"""GGUF tensors kept quantized: llama.cpp blocks repacked into ``worker.layers.quant`` formats.

    Q4_K  (256-weight super-blocks, 8 sub-blocks of 32: d * sc * q - dmin * m, q 4-bit)
          -> int4 g32: scale = d * sc, offset = -dmin * m (fp16 roundings of those products)
    Q4_0  (32 weights: d * (q - 8), q 4-bit)      -> int4 g32: scale = d, offset = -8 d, exact
          (Google's QAT checkpoints of Gemma ship as Q4_0 GGUFs)
    Q4_1  (32 weights: d * q + m, q 4-bit)        -> int4 g32: scale = d, offset = m, exact
    Q8_0  (32 weights: d * q, q int8)             -> int8 g32, exact
    Q5_0  (32 weights: d * (q - 16), q 5-bit)     -> int8 g32, exact
    Q6_K  (256-weight super-blocks, 16 sub-blocks of 16: d * sc * (q - 32), q 6-bit)
          -> int6 g16: scale = d * sc (the fp16 rounding of the product); int8 bytes on the
          CPU, 7 bits a weight on a GPU (``worker.device.kernels.int6_matmul``)

F32/F16/BF16 tensors stay float. A matrix of another quantized type (Q5_K and Q5_1, which
llama.cpp's Q4_K_M and Q5_K_M mixes use; the 2-3 bit K-quants and IQ types) is dequantized by
the gguf package and quantized again as it loads, into int8 g32 from 5 bits and more, else
int4 g32: it stays about its own size (a bf16 copy would be 2-4x) at an error well under its own
grid's, and one notice names the tensors. Anything else of such a type is dequantized, with a
warning. (Issue 14 asked for every other type dequantized; a Qwen3.5-35B-A3B Q4_K_M's Q5_K
DeltaNet projections would then take 1 GB of bf16.) ``gguf_formats`` says what each tensor
becomes without reading the data, so a load plans its layers (and rejects a tensor type it
cannot read) before any weight is read.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.layers.quant import INT4, INT6, INT8, QuantFormat, QuantizedWeight, pack_nibbles
from worker.loading.checkpoint import ModelLoadError
from worker.loading.gguf_convert import (
    expert_pieces,
    gguf_layout,
    hf_tensor_name,
    hf_tensor_values,
    qwen35_row_order,
    text_layers,
    unpermute_rows,
    untile_v_heads,
)

FLOAT_TYPES = ("F32", "F16", "BF16")
KEPT_FORMATS = {
    "Q4_K": QuantFormat(INT4, 32),
    "Q4_0": QuantFormat(INT4, 32),
    "Q4_1": QuantFormat(INT4, 32),
    "Q8_0": QuantFormat(INT8, 32),
    "Q5_0": QuantFormat(INT8, 32),
    "Q6_K": QuantFormat(INT6, 16),
}
# quantized again from their dequantized values (not repacked): the format by their bits
REQUANTIZED_FORMATS = {
    **dict.fromkeys(("Q5_1", "Q5_K", "Q8_1", "Q8_K"), QuantFormat(INT8, 32)),
    **dict.fromkeys(
        ("Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
         "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0"),
        QuantFormat(INT4, 32),
    ),
}  # fmt: skip


# The repackers work on torch uint8 blocks [B, block bytes] on any device: a load repacks on
# the device it loads to, a few MiB of blocks at a time (numpy on the host took 43 s for the
# 1.16 GB Q6_K embedding of a Gemma 4 31B file on the 2-core box; this, 5.7 s).
REPACK_CHUNK_BYTES = 16 << 20


def _half(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 2] little-endian fp16 -> float32 [B]."""
    return raw.contiguous().view(torch.float16)[:, 0].float()


def repack_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 34] -> q int8 [B, 32], scale fp32 [B]."""
    return blocks[:, 2:34].contiguous().view(torch.int8), _half(blocks[:, 0:2])


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes of a 32-weight block -> uint8 [B, 32]: weights 0-15 are the low nibbles,
    16-31 the high ones (Q4_0, Q4_1, Q5_0's low bits)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def repack_q5_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 22] (d, 32 high bits, 16 bytes of low nibbles) -> q int8 [B, 32] in [-16, 15], d."""
    high = blocks[:, 2:6].contiguous().view(torch.int32)  # [B, 1]: bit i is weight i's bit 4
    bits = (high >> torch.arange(32, dtype=torch.int32, device=blocks.device)) & 1
    q = (_nibbles_32(blocks[:, 6:22]).to(torch.int32) | (bits << 4)) - 16
    return q.to(torch.int8), _half(blocks[:, 0:2])


def repack_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, 18] (d, 16 bytes of nibbles) -> q uint8 [B, 32] in [0, 15], scale d, offset -8 d
    (fp32 [B]; -8 d is exact in fp16 too)."""
    d = _half(blocks[:, 0:2])
    return _nibbles_32(blocks[:, 2:18]), d, -8.0 * d


def repack_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, 20] (d, m, 16 bytes of nibbles) -> q uint8 [B, 32] in [0, 15], scale d, offset m."""
    return _nibbles_32(blocks[:, 4:20]), _half(blocks[:, 0:2]), _half(blocks[:, 2:4])


def repack_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, 144] -> q uint8 [B, 256] in [0, 15], scale [B, 8], offset [B, 8] (fp32)."""
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    low, high, extra = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]  # 6-bit scales, mins
    sc = torch.cat([low & 0x3F, (extra & 0x0F) | ((low >> 6) << 4)], dim=1)
    mins = torch.cat([high & 0x3F, (extra >> 4) | ((high >> 6) << 4)], dim=1)
    qs = blocks[:, 16:144].reshape(-1, 4, 32)  # chunk c: sub-block 2c low, 2c + 1 high nibbles
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 256)
    return q, d.unsqueeze(1) * sc.float(), -(dmin.unsqueeze(1) * mins.float())


def repack_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 210] (128 low nibbles, 64 high 2-bit pairs, 16 int8 scales, d) -> q int8 [B, 256]
    in [-32, 31], scale fp32 [B, 16]."""
    ql, qh = blocks[:, 0:128].reshape(-1, 2, 64), blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    # half h (128 weights) of a super-block: low nibbles of ql[64h:64h+64] then its high nibbles
    low = torch.stack([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 256)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
    high = (qh.reshape(-1, 2, 1, 32) >> shifts.reshape(1, 1, 4, 1)) & 0x03  # [B, 2, 4, 32]
    q = (low | (high.reshape(-1, 256) << 4)).to(torch.int16) - 32
    return q.to(torch.int8), _half(blocks[:, 208:210]).unsqueeze(1) * scales


# each kept type's (weights, bytes) a block and its block repacker: (q, scale, offset) for
# int4, (q, scale) for int8
REPACKERS: dict[str, tuple[int, int, Any]] = {
    "Q4_K": (256, 144, repack_q4_k), "Q4_0": (32, 18, repack_q4_0),
    "Q4_1": (32, 20, repack_q4_1), "Q8_0": (32, 34, repack_q8_0),
    "Q5_0": (32, 22, repack_q5_0), "Q6_K": (256, 210, repack_q6_k),
}  # fmt: skip


def _repacked_chunks(
    type_name: str, raw: np.ndarray, shape: tuple[int, int], device: torch.device
) -> Iterator[tuple[int, int, tuple[torch.Tensor, ...]]]:
    """(first row, end row, the repacker's (q, scale[, offset]) of those rows) over a GGUF
    tensor's raw bytes, REPACK_CHUNK_BYTES of rows at a time copied to `device`."""
    n, k = shape
    block_weights, block_bytes, repack_blocks = REPACKERS[type_name]
    per_row = k // block_weights
    blocks = np.asarray(raw).reshape(n, per_row * block_bytes)
    step = max(1, REPACK_CHUNK_BYTES // (per_row * block_bytes))
    for first in range(0, n, step):
        last = min(n, first + step)
        chunk = torch.from_numpy(np.array(blocks[first:last])).to(device)
        yield first, last, repack_blocks(chunk.reshape(-1, block_bytes))


def repack(
    type_name: str, raw: np.ndarray, shape: tuple[int, int], device: torch.device | None = None
) -> QuantizedWeight:
    """A GGUF tensor's raw bytes (uint8, any shape) of a type in ``KEPT_FORMATS`` -> the
    QuantizedWeight of an HF [N, K] weight, made on `device` (default: the CPU) from chunks of
    rows copied there."""
    n, k = shape
    fmt = KEPT_FORMATS[type_name]
    groups = k // fmt.group_size
    device = torch.device("cpu") if device is None else torch.device(device)
    int4 = fmt.kind == INT4
    qdata = torch.empty((n, k // 2 if int4 else k), dtype=torch.uint8 if int4 else torch.int8,
                        device=device)  # fmt: skip
    scales = torch.empty((n, groups), dtype=torch.float16, device=device)
    offsets = torch.empty((n, groups), dtype=torch.float16, device=device) if int4 else None
    for first, last, parts in _repacked_chunks(type_name, raw, shape, device):
        q = parts[0].reshape(last - first, k)
        qdata[first:last] = pack_nibbles(q) if int4 else q
        scales[first:last] = parts[1].reshape(last - first, groups)
        if offsets is not None:
            offsets[first:last] = parts[2].reshape(last - first, groups)
    return QuantizedWeight(fmt.kind, (n, k), fmt.group_size, qdata, scales, offsets)


def dequantize_blocks(
    type_name: str, raw: np.ndarray, shape: tuple[int, int], device: torch.device, dtype: Any
) -> torch.Tensor:
    """A GGUF tensor of a type in ``KEPT_FORMATS`` dequantized on `device` into `dtype` [N, K]:
    the repackers' fp32 scales and offsets (not their fp16 roundings), so each weight is
    ``q * scale (+ offset)`` in fp32 as the gguf package computes it. A float load of a GGUF on
    a GPU uses it (the gguf package's numpy ran at ~0.1-0.2 GB/s of blocks on the 2-core box)."""
    n, k = shape
    group = KEPT_FORMATS[type_name].group_size
    out = torch.empty((n, k), dtype=dtype, device=device)
    for first, last, parts in _repacked_chunks(type_name, raw, shape, device):
        value = parts[0].float().reshape(-1, group) * parts[1].reshape(-1, 1)
        if len(parts) == 3:
            value = value + parts[2].reshape(-1, 1)
        out[first:last] = value.reshape(last - first, k).to(dtype)
    return out


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its name, type, HF-order shape, and bytes in the file."""

    name: str
    type_name: str
    type_id: int
    shape: tuple[int, ...]  # outermost first (the HF order)
    offset: int  # from the start of the file
    nbytes: int


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip


def read_index(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(scalar metadata, tensors) from a GGUF header. Arrays are skipped (their lengths kept as
    ``range`` objects): the ``gguf`` reader parses all 262k vocabulary strings (~8 s) where this
    needs ~0.2 s. A load asks several times; the file is parsed once while it is unchanged.
    Callers must not modify what it returns."""
    stat = Path(path).stat()
    return _read_index(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_index(
    path_name: str, size: int, mtime_ns: int
) -> tuple[dict[str, Any], list[TensorInfo]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    del size, mtime_ns  # the cache key: a changed file is parsed again
    path = Path(path_name)

    data = np.memmap(path, dtype=np.uint8, mode="r")
    view = memoryview(data)  # type: ignore[arg-type]
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        value = struct.unpack_from(fmt, view, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        length = take("<Q")
        pos += length
        return bytes(view[pos - length : pos]).decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            item, count = take("<I"), take("<Q")
            if item == 8:
                for _ in range(count):
                    length = take("<Q")  # (pos += take(...) would add to the old pos)
                    pos += length
            elif item == 9:
                raise ModelLoadError(f"{path}: nested GGUF arrays are not supported")
            else:
                pos += count * struct.calcsize(_SCALARS[item])
            return range(count)
        return take(_SCALARS[kind])

    try:
        if bytes(view[:4]) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file")
        pos = 8
        n_tensors, n_kv = take("<Q"), take("<Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("<I"))
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(take("<Q") for _ in range(take("<I")))
            raw.append((name, tuple(reversed(dims)), take("<I"), take("<Q")))
    except (struct.error, KeyError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF header ({exc})") from exc
    alignment = int(meta.get("general.alignment", 32))
    start = (pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, type_id, offset in raw:
        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(
                f"{path}: GGUF tensor {name!r} has unknown type {type_id}, which this version "
                "of the gguf package cannot read"
            ) from None
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = math.prod(shape) // block * size
        tensors.append(TensorInfo(name, kind.name, type_id, shape, start + offset, nbytes))
        if start + offset + nbytes > len(data):
            raise ModelLoadError(f"{path}: truncated GGUF file: tensor {name!r} ends past the end")
    return meta, tensors


@dataclass(frozen=True)
class GgufTensorEntry:
    """Where one tensor lies in a GGUF file, shaped like a safetensors entry (HF-order shape,
    ``end - begin`` its stored bytes) for the loader's shape check and byte count."""

    file: Path
    shape: tuple[int, ...]
    begin: int
    end: int


def gguf_tensor_entries(path: Path) -> dict[str, GgufTensorEntry]:
    """HF name -> where its tensor lies in the GGUF (from the header only)."""
    meta, tensors = read_index(path)
    arch = str(meta.get("general.architecture", ""))
    layers = text_layers(meta, arch)
    entries = {}
    for info in tensors:
        name = hf_tensor_name(arch, info.name, layers)
        if name is not None:
            shape = info.shape
            if arch == "qwen35moe" and ".ssm_conv1d." in info.name:
                shape = (shape[0], 1, *shape[1:])  # llama.cpp squeezed [C, 1, K] to [C, K]
            entries[name] = GgufTensorEntry(path, shape, info.offset, info.offset + info.nbytes)
    return entries


def _raw(path: Path, info: TensorInfo) -> np.ndarray:
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    return np.asarray(data)


def gguf_formats(path: Path) -> dict[str, QuantFormat | None]:
    """HF name -> the format its GGUF tensor is kept in (None: float), from the header only.
    Raises ModelLoadError naming the tensor for a type the gguf package cannot read."""
    from gguf.quants import _type_traits

    meta, tensors = read_index(path)
    arch = str(meta.get("general.architecture", ""))
    layers = text_layers(meta, arch)
    formats: dict[str, QuantFormat | None] = {}
    for info in tensors:
        name = hf_tensor_name(arch, info.name, layers)
        if name is None:
            continue
        readable = info.type_name in FLOAT_TYPES or info.type_name in KEPT_FORMATS
        if not readable and not any(t.name == info.type_name for t in _type_traits):
            raise ModelLoadError(
                f"{path}: GGUF tensor {info.name!r} has type {info.type_name}, which this "
                "version of the gguf package cannot read"
            )
        fmt = KEPT_FORMATS.get(info.type_name)
        if fmt is None and info.shape[-1] % 32 == 0:
            fmt = REQUANTIZED_FORMATS.get(info.type_name)
        keep = len(info.shape) == 2 or is_experts(name)  # matrices and stacked experts
        formats[name] = fmt if keep else None
    return formats


def is_experts(name: str) -> bool:
    """Whether an HF name is a stacked-experts tensor ("model.layers.3.mlp.experts.down_proj")."""
    return name.rpartition(".")[0].endswith(".mlp.experts")


def _float_values(path: Path, info: TensorInfo) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = _raw(path, info)
    if info.type_name == "F32":
        values = raw.view(np.float32)
    else:
        values = dequantize(raw, GGMLQuantizationType(info.type_id))
    return np.array(values, dtype=np.float32).reshape(info.shape)


def iter_gguf_tensors(
    path: Path,
    dtype: torch.dtype,
    keep: dict[str, QuantFormat | None],
    warn: bool = True,
    device: torch.device | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, value) of every tensor: a QuantizedWeight where ``keep`` names a format (its
    blocks repacked on `device`, default the CPU), else a float tensor in ``dtype`` on the host
    (with ``warn``, types not kept are named in one warning each: a load that asked to keep the
    file quantized could not)."""
    meta, tensors = read_index(path)
    arch = str(meta.get("general.architecture", ""))
    layers = text_layers(meta, arch)
    config = gguf_layout(meta, arch)
    dequantized_types: dict[str, list[str]] = {}
    requantized: dict[str, list[str]] = {}
    on_device = device is not None and torch.device(device).type != "cpu"
    for info in tensors:
        name = hf_tensor_name(arch, info.name, layers)
        if name is None:
            continue
        try:
            repackable = keep.get(name) is not None and info.type_name in KEPT_FORMATS
            if repackable and len(info.shape) == 2:
                qw = repack(info.type_name, _raw(path, info), info.shape, device)  # type: ignore[arg-type]
                yield name, _hf_rows(arch, info.name, qw, config)
                continue
            if repackable and len(info.shape) == 3:  # stacked experts
                experts, rows, cols = info.shape
                qw = repack(info.type_name, _raw(path, info), (experts * rows, cols), device)

                def take(expert: int, first: int, end: int, qw: Any = qw, rows: int = rows) -> Any:
                    return qw.rows(torch.arange(expert * rows + first, expert * rows + end))

                yield from expert_pieces(name, torch.empty(info.shape, device="meta"), take)
                continue
            if on_device and info.type_name in REPACKERS and plain_rows(arch, info.name):
                # a float load onto a GPU: the blocks dequantized there, not in numpy
                rows = math.prod(info.shape[:-1])
                values_t = dequantize_blocks(
                    info.type_name, _raw(path, info), (rows, info.shape[-1]), device, dtype
                )  # type: ignore[arg-type]
                yield from expert_pieces(name, values_t.reshape(info.shape))
                continue
            if info.type_name not in FLOAT_TYPES and keep.get(name) is None:
                dequantized_types.setdefault(info.type_name, []).append(info.name)
            elif info.type_name not in FLOAT_TYPES and not repackable and not is_experts(name):
                requantized.setdefault(f"{info.type_name} -> {keep[name].describe()}", []).append(
                    info.name
                )
            values = hf_tensor_values(arch, info.name, _float_values(path, info), config)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(
                f"{path}: cannot read GGUF tensor {info.name!r} ({info.type_name}): {exc}"
            ) from exc
        yield from expert_pieces(name, torch.from_numpy(np.ascontiguousarray(values)).to(dtype))
    for type_name, names in dequantized_types.items() if warn else ():
        print(f"warning: {path.name}: GGUF type {type_name} is not kept quantized; dequantized "
              f"{_some(names)}", file=sys.stderr)  # fmt: skip
    for change, names in requantized.items() if warn else ():
        print(f"note: {path.name}: GGUF type {change.replace(' -> ', ' is quantized again as ')}"
              f": {_some(names)}", file=sys.stderr)  # fmt: skip


def _some(names: list[str]) -> str:
    more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def plain_rows(arch: str, gguf_name: str) -> bool:
    """Whether a quantized GGUF matrix's values are the HF weight's as they are (no row or
    column order of llama.cpp's to undo, no 1 + w)."""
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else gguf_name
    if arch == "llama":
        return kind not in ("attn_q", "attn_k")
    if arch == "qwen35moe":
        return kind not in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out")
    return not gguf_name.endswith("norm.weight")


def _hf_rows(arch: str, gguf_name: str, qw: QuantizedWeight, config: dict[str, Any]) -> Any:
    """llama.cpp's row (and qwen35moe's column) orders undone on a quantized weight: rows move
    whole, columns in whole value heads (a multiple of the group)."""
    if arch == "qwen35moe":
        if ".ssm_out." in gguf_name:
            return _value_head_columns(qw, config)
        order = qwen35_row_order(gguf_name, qw.shape[0], config)
        if order is None:
            return qw
        return qw.rows(torch.from_numpy(np.ascontiguousarray(order)))
    heads = None
    if arch == "llama" and ".attn_q." in gguf_name:
        heads = config["num_attention_heads"]
    elif arch == "llama" and ".attn_k." in gguf_name:
        heads = config["num_key_value_heads"]
    if heads is None:
        return qw
    order = unpermute_rows(np.arange(qw.shape[0]), heads)
    return qw.rows(torch.from_numpy(np.ascontiguousarray(order)))


def _value_head_columns(qw: QuantizedWeight, config: dict[str, Any]) -> QuantizedWeight:
    """ssm_out [H, value heads x head size] with its columns' value heads back in HF order:
    each head's columns move as a block, codes and their groups' scales and offsets alike."""
    head = config["linear_value_head_dim"]
    if config["linear_per_key"] == 1:
        return qw
    if head % qw.group_size or head % 2:
        raise ModelLoadError(
            f"ssm_out: value head size {head} is not a multiple of the group {qw.group_size}"
        )
    n, k = qw.shape
    order = torch.from_numpy(
        np.ascontiguousarray(untile_v_heads(np.arange(k // head), 0, config, 1))
    )

    def blocks(t: torch.Tensor) -> torch.Tensor:
        per = t.shape[1] // (k // head)
        return t.reshape(n, k // head, per)[:, order].reshape(t.shape)

    offsets = None if qw.offsets is None else blocks(qw.offsets)
    return QuantizedWeight(
        qw.kind, qw.shape, qw.group_size, blocks(qw.qdata), blocks(qw.scales), offsets
    )
