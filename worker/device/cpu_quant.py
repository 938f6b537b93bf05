"""Quantized matmuls on the CPU: int8 / int4 weights (``worker.layers.quant``).

A decode step streams every weight once, so bytes per weight set its speed: int8 reads a
quarter of fp32, int4 an eighth (plus fp16 scales). ``pack`` stores a ``QuantizedWeight`` for
the kernel with sixteen rows interleaved, as ``cpu_gemv`` does for fp32 with eight:

    int8  data    [N / 16, K, 16]       data[n // 16, k, n % 16] == q[n, k]
    int4  data    [N / 16, K / 2, 16]   low nibble k = 2j, high nibble k = 2j + 1
    scales (and int4 offsets)  [N / 16, K / g, 16] fp16

so one 16-byte load holds column k of sixteen rows (one AVX-512 vector after widening; two
AVX2 vectors). Each sixteen-row tile's bytes above form one stream (``K * 16`` bytes of int8
data, ``K * 8`` of int4, ``K / g * 32`` of scales); the streams of eight neighbouring tiles are
stored interleaved in 32-byte units (unit u of tile t of a block at ``(u * W + t) * 32``, W = 8
tiles, fewer in the last block), so a one-row matmul, which walks eight tiles side by side,
reads memory as one sequential stream: the 168 MB int8 head of the default model ran at 19.6
GB/s as eight streams and 25.4 as one on the Zen 4 box (BENCHMARKS.md). The kernel (C in
``cpu_quant_source.py``, compiled into the ``cpu_gemv``
library) widens and converts the integers in registers, applies the group's scale (and
offset) with one multiply (FMA), and accumulates ``x[m, k] * w`` in fp32: the weight is the
torch reference's ``dequantize`` value up to one rounding (an FMA for int4), each output one
fp32 chain over k in order. Inputs of any row count use it (prefill too: the weights of a tile
stay in cache while all input rows pass over them, four at a time). Threads as in ``cpu_gemv``:
each output computed by one thread, the same bits at any thread count.

Where the CPU has AVX512-VNNI and VBMI (``ACTIVATION_BITS`` below, 16 by default) the kernel
``tp_quant_gemm_a16`` quantizes each input row to int16 per weight group instead and sums
``q * x`` exactly in int32 per group (vpdpwssd, 32 products an instruction; int4 with a group
size divisible by 4: vpdpbusd, 64, on the row split into high and low bytes, the same sums),
then ``scale * x_scale * sum`` (int4: plus ``offset * x_scale * sum(x)``) into the fp32 chain:
no float work per weight; a row's result still depends on nothing but the row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from worker.device import cpu_gemv
from worker.layers.quant import INT4, INT6, INT8, QuantizedWeight

ROW_BLOCK = 16  # weight rows interleaved together (a tile)
BLOCK_TILES = 8  # tiles whose streams are interleaved (module docstring)
UNIT = 32  # bytes of one tile's stream before the next tile's
# The input rows' precision in the kernel (TOKENPIPE_CPU_ACTIVATION_BITS):
#   16 (the default): every quantized matmul, int8 and int4 weights, any row count, quantizes
#      each input row to int16 per weight group and multiplies with AVX512-VNNI (vpdpwssd);
#      where the kernel was built without VNNI/VBMI it falls back to 32.
#   32: fp32 activations (the weights dequantized in registers).
#   8: one-row matmuls on int8 weights quantize the row to int8 (llama.cpp's q8 activations,
#      vpdpbusd); the rest as 16. On the default model 8 broke the greedy equality with the
#      float path on 1 of the 4 reference prompts at 24 tokens; 16 keeps it (BENCHMARKS.md).
ACTIVATION_BITS = int(os.environ.get("TOKENPIPE_CPU_ACTIVATION_BITS", "16"))


@dataclass
class PackedQuant:
    """A quantized weight in the kernel's layout (module docstring)."""

    kind: str
    shape: tuple[int, int]  # [N, K]
    group_size: int
    data: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        parts = [self.data, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


def available() -> bool:
    return cpu_gemv.kernel() is not None


def can_pack(qw: QuantizedWeight) -> bool:
    """A weight the kernel takes: on the CPU, N % 16 == 0, an even group size (int4: K % 4 == 0,
    whole 32-byte units); int6 runs as int8."""
    return (
        qw.qdata.device.type == "cpu"
        and qw.shape[0] % ROW_BLOCK == 0
        and qw.group_size % 2 == 0
        and qw.kind in (INT8, INT4, INT6)
        and (qw.kind != INT4 or qw.shape[1] % 4 == 0)
    )


def _interleave(rows: torch.Tensor) -> torch.Tensor:
    """[N, C] -> the tiles' streams, eight tiles interleaved in 32-byte units: 1-D (a copy)."""
    n, c = rows.shape
    tiles = rows.reshape(n // ROW_BLOCK, ROW_BLOCK, c).transpose(1, 2).contiguous()
    count = tiles.shape[0]
    raw = tiles.view(count, -1).view(torch.uint8)  # [tiles, stream bytes]
    units = raw.shape[1] // UNIT
    full = count // BLOCK_TILES * BLOCK_TILES
    blocks = raw[:full].reshape(-1, BLOCK_TILES, units, UNIT).transpose(1, 2).reshape(-1)
    tail = raw[full:].reshape(count - full, units, UNIT).transpose(0, 1).reshape(-1)
    return torch.cat([blocks, tail]).view(rows.dtype)


def _deinterleave(flat: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """The inverse of ``_interleave``: -> [N, C]."""
    count = n // ROW_BLOCK
    raw = flat.view(torch.uint8)
    units = raw.numel() // count // UNIT
    full = count // BLOCK_TILES * BLOCK_TILES
    cut = full * units * UNIT
    stream = units * UNIT
    blocks = raw[:cut].reshape(-1, units, BLOCK_TILES, UNIT).transpose(1, 2).reshape(full, stream)
    tail = raw[cut:].reshape(units, count - full, UNIT).transpose(0, 1).reshape(-1, stream)
    tiles = torch.cat([blocks, tail]).view(flat.dtype).view(count, c, ROW_BLOCK)
    return tiles.transpose(1, 2).reshape(n, c)


def pack(qw: QuantizedWeight) -> PackedQuant:
    offsets = None if qw.offsets is None else _interleave(qw.offsets)
    kind = INT8 if qw.kind == INT6 else qw.kind  # int6 codes are int8 bytes: the int8 kernel
    return PackedQuant(kind, qw.shape, qw.group_size, _interleave(qw.qdata),
                       _interleave(qw.scales), offsets)  # fmt: skip


def unpack(packed: PackedQuant) -> QuantizedWeight:
    n, k = packed.shape
    groups = k // packed.group_size
    columns = k if packed.kind == INT8 else k // 2
    offsets = None if packed.offsets is None else _deinterleave(packed.offsets, n, groups)
    data, scales = _deinterleave(packed.data, n, columns), _deinterleave(packed.scales, n, groups)
    return QuantizedWeight(packed.kind, packed.shape, packed.group_size, data, scales, offsets)


def packed_rows(packed: PackedQuant, ids: torch.Tensor) -> torch.Tensor:
    """float32 rows ``ids`` [T] of the dequantized weight -> [T, K] (an embedding lookup:
    only these rows are dequantized, in C: a few torch ops per row cost more than the rows)."""
    lib = cpu_gemv.kernel()
    assert lib is not None, "packed quantized weights need the CPU kernel"
    n, k = packed.shape
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(len(ids), k, dtype=torch.float32)
    offsets = None if packed.offsets is None else packed.offsets.data_ptr()
    status = lib.tp_quant_rows(
        ids.data_ptr(), len(ids), packed.data.data_ptr(), packed.scales.data_ptr(), offsets,
        out.data_ptr(), k, n, packed.group_size,
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"embedding ids out of range [0, {n}): {ids.tolist()[:8]}")
    return out


def matmul(x: torch.Tensor, packed: PackedQuant) -> torch.Tensor:
    """x [M, K] fp32 @ dequantized(weight).T -> [M, N] fp32. Needs ``available()``."""
    lib = cpu_gemv.kernel()
    assert lib is not None, "packed quantized weights need the CPU kernel"
    n, k = packed.shape
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    offsets = None if packed.offsets is None else packed.offsets.data_ptr()
    if x.shape[0] == 1 and packed.kind == INT8 and ACTIVATION_BITS == 8:
        status = lib.tp_quant_gemv_q8act(
            x.data_ptr(), packed.data.data_ptr(), packed.scales.data_ptr(), out.data_ptr(),
            k, n, packed.group_size, cpu_gemv.kernel_threads(),
        )  # fmt: skip
        if status == 0:
            return out  # else (2: no VNNI; 1: group size) as below
    if ACTIVATION_BITS in (8, 16):
        status = lib.tp_quant_gemm_a16(
            x.shape[0], x.data_ptr(), packed.data.data_ptr(), packed.scales.data_ptr(), offsets,
            out.data_ptr(), k, n, packed.group_size, cpu_gemv.kernel_threads(),
        )  # fmt: skip
        if status == 0:
            return out  # else (2: no VNNI/VBMI; 1: group size) the fp32-activation kernel
    status = lib.tp_quant_gemm(
        x.shape[0], x.data_ptr(), packed.data.data_ptr(), packed.scales.data_ptr(), offsets,
        out.data_ptr(), k, n, packed.group_size, cpu_gemv.kernel_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(
            f"tp_quant_gemm failed ({status}) for x {tuple(x.shape)}, {packed.kind} [{n}, {k}] "
            f"g{packed.group_size}"
        )
    return out


def vector_rows() -> int:
    """Weight rows per vector register in the compiled kernel: 16 (AVX-512) or 8 (AVX2)."""
    lib = cpu_gemv.kernel()
    return 0 if lib is None else int(lib.tp_vector_rows())
