"""Triton matmuls over weight-only quantized weights (W4A16 / W8A16) on CUDA.

    packed = KMajorWeight.pack(qw)     # once, at start-up (worker/device/cuda_setup.py)
    y = quant_linear(x, packed)        # x [M, K] bf16/fp16/fp32 -> [M, N]

The canonical layout of ``worker.layers.quant`` (row-major codes) is repacked for the GPU
into a **K-major, output-interleaved** one: codes in int32 words [K, N / P], word (k, c)
holding the codes of outputs P*c .. P*c + P - 1 at input k (int4: P = 8 nibbles, output
P*c + i at bits 4i..4i+3; int8: P = 4 bytes), and the fp16 scales (and int4 offsets) as
[K / g, P, N / P] (position-major: the scales of one code position are contiguous). N is
padded to a multiple of P with zero codes (outputs never stored).

A word shares its input k, so one x value feeds all P codes of a loaded word, and a code
becomes an fp32 operand in **one instruction**: ``word & mask`` read as an fp32 is the code
times a power of two (a denormal, code * 2^(a - 149) for the code at bits a..; codes above
bit 23 come from ``word >> 8``). The multiply-add against x (scaled by 2^90, exact) is exact
and denormals are kept by fp32 FMA (Triton emits no flush-to-zero), so a weight costs an AND
and an FMA; each group's scale (times the power of two back) and offset apply once per
group to the sums ``sum code * x`` and ``sum x`` (``w = code * scale + offset``; int8 codes
are stored offset by 128 and the 128 * scale * sum x taken back). The previous layout (words
along K) needed a shift, a mask, an OR and a subtract per weight and a scalar x load per
code: ~8.4 instructions per weight against ~3 now (SASS counts in BENCHMARKS.md).

Three paths, by the number of rows M:

- **GEMV, M == 1** (batch-1 decode): CUDA cores, fp32 accumulation, K split over programs
  for matrices of few outputs (partial sums added in a fixed order: deterministic).
- **GEMM, 1 < M <= GEMM_MAX_ROWS** (decode batches): per code position p, the
  [K tile, N / P tile] weights dequantized in registers (an AND and an FMA with the scale,
  then x's dtype) and multiplied on the tensor cores (``tl.dot``) into the outputs P*c + p.
- **Longer inputs** (prefill chunks): the weight dequantized into a [K, N] scratch of x's
  dtype by one kernel, then cuBLAS; the dequantization costs ~2.5 bytes per weight per
  chunk, small against a chunk's matmul.

Every weight is ``code * scale (+ offset)`` in fp32 as in the reference
(``worker.layers.quant.dequantize``). This module imports Triton: import it only after
``worker.device.kernels.triton_available()``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker.layers.quant import INT4, QuantizedWeight, unpack_nibbles

GEMV_MAX_ROWS = 1
GEMM_MAX_ROWS = 64
# GEMV: (BLOCK_C words, programs wanted (K split to reach them), num_warps, rows unrolled);
# GEMM: (BLOCK_C words, BLOCK_K (a multiple of the group), num_warps, num_stages)
GEMV_CONFIG = (128, 264, 8, 8)
GEMM_CONFIG = (64, 32, 4, 3)
GEMM_PROGRAMS = 132  # about one per SM of an H200: small GEMMs split K up to this many programs
PACK_ROWS = 4096  # outputs repacked at a time: bounds the int32 temporaries


@dataclass
class KMajorWeight:
    """A quantized [N, K] weight in the GPU's layout (module docstring)."""

    kind: str
    shape: tuple[int, int]
    group_size: int
    words: torch.Tensor  # int32 [K, N / P] (N padded to a multiple of P)
    scales: torch.Tensor  # fp16 [K / g, P, N / P]
    offsets: torch.Tensor | None  # fp16 [K / g, P, N / P], int4 only
    # tile configs timed for this matrix on this GPU (choose_configs); None: the defaults
    gemv_config: tuple[int, int, int, int] | None = None
    gemm_config: tuple[int, int, int, int] | None = None

    @property
    def per_word(self) -> int:
        return 8 if self.kind == INT4 else 4

    @property
    def columns(self) -> int:
        """Word columns C = N / P (N padded up)."""
        return self.words.shape[1]

    @property
    def nbytes(self) -> int:
        parts = [self.words, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    @staticmethod
    def supports(qw: QuantizedWeight) -> bool:
        """Groups of a power of two from 8 up."""
        group = qw.group_size
        return group >= 8 and group & (group - 1) == 0

    @staticmethod
    def pack(qw: QuantizedWeight) -> KMajorWeight:
        n, k = qw.shape
        if not KMajorWeight.supports(qw):
            group = qw.group_size
            raise ValueError(f"K-major packing needs a power-of-two group >= 8, got {group}")
        per_word = 8 if qw.kind == INT4 else 4
        bits = 32 // per_word
        columns = triton.cdiv(n, per_word)
        device = qw.qdata.device
        words = torch.zeros((k, columns), dtype=torch.int32, device=device)
        for start in range(0, n, PACK_ROWS):
            stop = min(start + PACK_ROWS, n)
            if qw.kind == INT4:
                codes = unpack_nibbles(qw.qdata[start:stop]).to(torch.int32)
            else:  # signed bytes stored offset by 128 (the kernels take 128 * scale back)
                codes = (qw.qdata[start:stop].to(torch.int32) + 128) & 0xFF
            first, last = start // per_word, triton.cdiv(stop, per_word)
            block = torch.zeros(((last - first) * per_word, k), dtype=torch.int32, device=device)
            block[: stop - start] = codes
            block = block.view(last - first, per_word, k)
            word = torch.zeros((last - first, k), dtype=torch.int32, device=device)
            for position in range(per_word):
                word |= block[:, position] << (bits * position)
            words[:, first:last] = word.t()

        def by_position(meta: torch.Tensor) -> torch.Tensor:  # [N, K / g] -> [K / g, P, C]
            padded = meta.new_zeros((columns * per_word, meta.shape[1]))
            padded[:n] = meta
            return padded.t().reshape(-1, columns, per_word).transpose(1, 2).contiguous()

        offsets = None if qw.offsets is None else by_position(qw.offsets)
        return KMajorWeight(
            qw.kind, qw.shape, qw.group_size, words, by_position(qw.scales), offsets
        )

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] of the dequantized weight -> [T, K] (an embedding lookup from a
        table shared with the LM head; plain torch ops over the T outputs)."""
        per_word = self.per_word
        bits = 32 // per_word
        column, position = ids // per_word, ids % per_word
        words = self.words[:, column]  # [K, T]
        codes = (words >> (bits * position).to(torch.int32)) & ((1 << bits) - 1)
        if self.kind != INT4:
            codes = codes - 128
        group = self.group_size
        scales = self.scales[:, position, column].t().float()  # [T, K / g]
        out = codes.t().float() * scales.repeat_interleave(group, dim=1)
        if self.offsets is not None:
            offsets = self.offsets[:, position, column].t().float()
            out = out + offsets.repeat_interleave(group, dim=1)
        return out.to(dtype)


@triton.jit
def _extract(word, position, INT4_KIND: tl.constexpr):
    """Code ``position`` of words packed along K (the experts' layout of
    ``worker.layers.quant_experts``), as fp32. Without an integer-to-float conversion (a
    quarter-rate instruction on Hopper): the code goes into the mantissa of 2^23 and 2^23
    (+ 128, for int8's sign flip) is subtracted, exact."""
    if INT4_KIND:
        bits = ((word >> (4 * position)) & 15) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    bits = (((word >> (8 * position)) & 255) ^ 128) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _code(low, high, p: tl.constexpr, INT4_KIND: tl.constexpr):
    """Code p of each word as the fp32 code * 2^(a_p - 149), exactly (a denormal; a_p in
    `_unscale`). ``high`` is ``low >> 8``: the codes above bit 23 move down to bits 16..23."""
    if INT4_KIND:
        if p < 6:
            bits = low & (15 << (4 * p))
        else:
            bits = high & (15 << (4 * p - 8))
    else:
        if p < 3:
            bits = low & (255 << (8 * p))
        else:
            bits = high & (255 << 16)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _unscale(p: tl.constexpr, INT4_KIND: tl.constexpr):
    """2^(59 - a_p): a `_code` (code * 2^(a_p - 149)) times an x scaled by 2^90, times this,
    is code * x (a_p: the code's lowest bit, 4p / 8p, or 16 / 20 for the codes taken from
    ``high``)."""
    if INT4_KIND:
        if p == 0:
            u = 5.764607523034235e17  # 2^59
        elif p == 1:
            u = 3.602879701896397e16  # 2^55
        elif p == 2:
            u = 2251799813685248.0  # 2^51
        elif p == 3:
            u = 140737488355328.0  # 2^47
        elif p == 4:
            u = 8796093022208.0  # 2^43
        elif p == 5:
            u = 549755813888.0  # 2^39
        elif p == 6:
            u = 8796093022208.0  # 2^43
        else:
            u = 549755813888.0  # 2^39
    else:
        if p == 0:
            u = 5.764607523034235e17  # 2^59
        elif p == 1:
            u = 2251799813685248.0  # 2^51
        elif p == 2:
            u = 8796093022208.0  # 2^43
        else:
            u = 8796093022208.0  # 2^43
    return u


@triton.jit
def _gemv_group_end(acc, dot, s_ptr, o_ptr, meta, mask, xs, p: tl.constexpr, C,
                    INT4_KIND: tl.constexpr):  # fmt: skip
    """acc += this group's sum for code position p (scale, offset / int8's 128 applied)."""
    scale = tl.load(s_ptr + meta + p * C, mask=mask, other=0.0).to(tl.float32)
    if INT4_KIND:
        offset = tl.load(o_ptr + meta + p * C, mask=mask, other=0.0).to(tl.float32)
        acc += dot * (scale * _unscale(p, INT4_KIND)) + offset * xs
    else:
        acc += (dot * _unscale(p, INT4_KIND) - 128.0 * xs) * scale
    return acc


@triton.jit
def _gemv_store(y_ptr, acc, offs_c, mask_c, N, p: tl.constexpr, P: tl.constexpr):
    out = offs_c * P + p
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask_c & (out < N))


@triton.jit
def _qgemv_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, N, C, K,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
    WARPS: tl.constexpr,
):  # fmt: skip
    """y[split, :] = the partial x @ W^T over this split's groups (one row of x). Program
    (i, s): word columns [i * BLOCK_C, ...) over groups [s * span, (s + 1) * span), which its
    WARPS warps share out (warp w takes groups w, w + WARPS, ...: each warp streams its own
    rows, so many loads are in flight without splitting K over more programs), summed across
    the warps at the end."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    lanes = tl.arange(0, WARPS)
    groups = K // GROUP
    span = tl.cdiv(groups, tl.num_programs(1))
    first = split * span
    last = tl.minimum(first + span, groups)
    a0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    for g0 in range(first, last, WARPS):
        g = g0 + lanes  # [WARPS]: one group per warp
        mask_g = g < last
        mask = mask_g[:, None] & mask_c[None, :]
        d0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        xs = tl.zeros([WARPS], dtype=tl.float32)
        for r0 in range(0, GROUP, UNROLL):
            for r in tl.static_range(UNROLL):
                rows = g * GROUP + r0 + r
                word = tl.load(w_ptr + rows[:, None].to(tl.int64) * C + offs_c[None, :],
                               mask=mask, other=0)  # fmt: skip
                x = tl.load(x_ptr + rows, mask=mask_g, other=0.0).to(tl.float32)
                xs += x
                xb = (x * 1.2379400392853803e27)[:, None]  # 2^90: products stay normal floats
                high = word >> 8
                d0 += _code(word, high, 0, INT4_KIND) * xb
                d1 += _code(word, high, 1, INT4_KIND) * xb
                d2 += _code(word, high, 2, INT4_KIND) * xb
                d3 += _code(word, high, 3, INT4_KIND) * xb
                if INT4_KIND:
                    d4 += _code(word, high, 4, INT4_KIND) * xb
                    d5 += _code(word, high, 5, INT4_KIND) * xb
                    d6 += _code(word, high, 6, INT4_KIND) * xb
                    d7 += _code(word, high, 7, INT4_KIND) * xb
        meta = g[:, None] * (P * C) + offs_c[None, :]
        xsum = xs[:, None]
        a0 = _gemv_group_end(a0, d0, s_ptr, o_ptr, meta, mask, xsum, 0, C, INT4_KIND)
        a1 = _gemv_group_end(a1, d1, s_ptr, o_ptr, meta, mask, xsum, 1, C, INT4_KIND)
        a2 = _gemv_group_end(a2, d2, s_ptr, o_ptr, meta, mask, xsum, 2, C, INT4_KIND)
        a3 = _gemv_group_end(a3, d3, s_ptr, o_ptr, meta, mask, xsum, 3, C, INT4_KIND)
        if INT4_KIND:
            a4 = _gemv_group_end(a4, d4, s_ptr, o_ptr, meta, mask, xsum, 4, C, INT4_KIND)
            a5 = _gemv_group_end(a5, d5, s_ptr, o_ptr, meta, mask, xsum, 5, C, INT4_KIND)
            a6 = _gemv_group_end(a6, d6, s_ptr, o_ptr, meta, mask, xsum, 6, C, INT4_KIND)
            a7 = _gemv_group_end(a7, d7, s_ptr, o_ptr, meta, mask, xsum, 7, C, INT4_KIND)
    y_ptr += split * N
    _gemv_store(y_ptr, tl.sum(a0, axis=0), offs_c, mask_c, N, 0, P)
    _gemv_store(y_ptr, tl.sum(a1, axis=0), offs_c, mask_c, N, 1, P)
    _gemv_store(y_ptr, tl.sum(a2, axis=0), offs_c, mask_c, N, 2, P)
    _gemv_store(y_ptr, tl.sum(a3, axis=0), offs_c, mask_c, N, 3, P)
    if INT4_KIND:
        _gemv_store(y_ptr, tl.sum(a4, axis=0), offs_c, mask_c, N, 4, P)
        _gemv_store(y_ptr, tl.sum(a5, axis=0), offs_c, mask_c, N, 5, P)
        _gemv_store(y_ptr, tl.sum(a6, axis=0), offs_c, mask_c, N, 6, P)
        _gemv_store(y_ptr, tl.sum(a7, axis=0), offs_c, mask_c, N, 7, P)


@triton.jit
def _reduce_kernel(part_ptr, y_ptr, count, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = the sum over s of part[s, i] in fp32, in a fixed order (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(part_ptr + s * count + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weights(word, scale_ptr, offset_ptr, meta, mask, p: tl.constexpr, C, INT4_KIND: tl.constexpr):
    """The fp32 weights of code position p for a [rows, BLOCK_C] tile of words: the code
    into the mantissa of 2^23 (codes above bit 19 / 15 shifted down first), 2^23 taken off,
    times the group's scale divided by the code's power of two, plus the offset (int8:
    minus 128 * scale). ``meta`` indexes the [rows or 1, BLOCK_C] scales of position 0."""
    if INT4_KIND:
        if p < 5:
            bits = (word & (15 << (4 * p))) | 0x4B000000
            a: tl.constexpr = 4 * p
        else:
            bits = ((word >> 12) & (15 << (4 * p - 12))) | 0x4B000000
            a: tl.constexpr = 4 * p - 12
    else:
        if p < 2:
            bits = (word & (255 << (8 * p))) | 0x4B000000
            a: tl.constexpr = 8 * p
        else:
            bits = ((word >> 16) & (255 << (8 * p - 16))) | 0x4B000000
            a: tl.constexpr = 8 * p - 16
    value = bits.to(tl.float32, bitcast=True) - 8388608.0  # code * 2^a, exact
    scale = tl.load(scale_ptr + meta + p * C, mask=mask, other=0.0).to(tl.float32)
    if INT4_KIND:
        offset = tl.load(offset_ptr + meta + p * C, mask=mask, other=0.0).to(tl.float32)
    else:
        offset = -128.0 * scale
    return value * (scale * (1.0 / (1 << a))) + offset


@triton.jit
def _qgemm_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, M, N, C, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """y [M, N] = x @ W^T, computed transposed: per code position p, tl.dot of the
    [BLOCK_C, BLOCK_K] weights of outputs P*c + p (dequantized in registers, the large side
    of the tensor-core tile, split across warps) and x's [BLOCK_K, BLOCK_M] tile. BLOCK_K is a
    multiple of the group, or (groups of 8) holds two: then each weight reads its own
    group's scales."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    PER_ROW: tl.constexpr = BLOCK_K > GROUP
    pid_c = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)  # K split: partial sums into y[split] (fp32), added by _reduce_kernel
    tiles = tl.cdiv(K, BLOCK_K)
    span = tl.cdiv(tiles, tl.num_programs(2))
    k_first = split * span * BLOCK_K
    k_last = tl.minimum((split + 1) * span, tiles) * BLOCK_K
    y_ptr += split * M * N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_m = offs_m < M
    mask_c = offs_c < C
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    acc0 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_first, k_last, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = (offs_k < K) | EVEN_K  # EVEN_K: K a multiple of BLOCK_K, no mask to compute
        mask = mask_c[:, None] & mask_k[None, :]
        word = tl.load(w_ptr + offs_k[None, :].to(tl.int64) * C + offs_c[:, None], mask=mask,
                       other=0)  # fmt: skip
        if PER_ROW:
            meta = (offs_k // GROUP)[None, :] * (P * C) + offs_c[:, None]
            meta_mask = mask
        else:
            meta = (k0 // GROUP) * (P * C) + offs_c[:, None]
            meta_mask = mask_c[:, None]
        x = tl.load(x_cols + offs_k[:, None], mask=mask_k[:, None] & mask_m[None, :],
                    other=0.0)  # fmt: skip
        ty = x.dtype
        w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 0, C, INT4_KIND)
        acc0 += tl.dot(w.to(ty), x, input_precision=PRECISION)
        w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 1, C, INT4_KIND)
        acc1 += tl.dot(w.to(ty), x, input_precision=PRECISION)
        w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 2, C, INT4_KIND)
        acc2 += tl.dot(w.to(ty), x, input_precision=PRECISION)
        w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 3, C, INT4_KIND)
        acc3 += tl.dot(w.to(ty), x, input_precision=PRECISION)
        if INT4_KIND:
            w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 4, C, INT4_KIND)
            acc4 += tl.dot(w.to(ty), x, input_precision=PRECISION)
            w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 5, C, INT4_KIND)
            acc5 += tl.dot(w.to(ty), x, input_precision=PRECISION)
            w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 6, C, INT4_KIND)
            acc6 += tl.dot(w.to(ty), x, input_precision=PRECISION)
            w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 7, C, INT4_KIND)
            acc7 += tl.dot(w.to(ty), x, input_precision=PRECISION)
    y_cols = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym
    _gemm_store(y_cols, acc0, offs_c, mask_m, mask_c, N, 0, P)
    _gemm_store(y_cols, acc1, offs_c, mask_m, mask_c, N, 1, P)
    _gemm_store(y_cols, acc2, offs_c, mask_m, mask_c, N, 2, P)
    _gemm_store(y_cols, acc3, offs_c, mask_m, mask_c, N, 3, P)
    if INT4_KIND:
        _gemm_store(y_cols, acc4, offs_c, mask_m, mask_c, N, 4, P)
        _gemm_store(y_cols, acc5, offs_c, mask_m, mask_c, N, 5, P)
        _gemm_store(y_cols, acc6, offs_c, mask_m, mask_c, N, 6, P)
        _gemm_store(y_cols, acc7, offs_c, mask_m, mask_c, N, 7, P)


@triton.jit
def _gemm_store(y_cols, acc, offs_c, mask_m, mask_c, N, p: tl.constexpr, P: tl.constexpr):
    out = offs_c * P + p  # acc [BLOCK_C, BLOCK_M]: outputs by rows of x
    mask = (mask_c & (out < N))[:, None] & mask_m[None, :]
    tl.store(y_cols + out[:, None], acc.to(y_cols.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, o_ptr, out_ptr, N, C, K,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out [K, N] (x's dtype) = the dequantized weight, transposed."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_k < K)[:, None] & (offs_c < C)[None, :]
    word = tl.load(w_ptr + offs_k[:, None].to(tl.int64) * C + offs_c[None, :], mask=mask, other=0)
    meta = (offs_k // GROUP)[:, None] * (P * C) + offs_c[None, :]
    ty = out_ptr.dtype.element_ty
    w0 = _weights(word, s_ptr, o_ptr, meta, mask, 0, C, INT4_KIND).to(ty)
    w1 = _weights(word, s_ptr, o_ptr, meta, mask, 1, C, INT4_KIND).to(ty)
    w2 = _weights(word, s_ptr, o_ptr, meta, mask, 2, C, INT4_KIND).to(ty)
    w3 = _weights(word, s_ptr, o_ptr, meta, mask, 3, C, INT4_KIND).to(ty)
    # the P positions of a word side by side (join's new last axis, in registers): each
    # thread stores its words' P outputs as one contiguous vector
    if INT4_KIND:
        w4 = _weights(word, s_ptr, o_ptr, meta, mask, 4, C, INT4_KIND).to(ty)
        w5 = _weights(word, s_ptr, o_ptr, meta, mask, 5, C, INT4_KIND).to(ty)
        w6 = _weights(word, s_ptr, o_ptr, meta, mask, 6, C, INT4_KIND).to(ty)
        w7 = _weights(word, s_ptr, o_ptr, meta, mask, 7, C, INT4_KIND).to(ty)
        evens = tl.join(tl.join(w0, w4), tl.join(w2, w6))  # [.., a, b] = w(4a + 2b)
        odds = tl.join(tl.join(w1, w5), tl.join(w3, w7))
        tile = tl.reshape(tl.join(evens, odds), [BLOCK_K, BLOCK_C * P])
    else:
        tile = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_K, BLOCK_C * P])
    cols = tl.program_id(0) * BLOCK_C * P + tl.arange(0, BLOCK_C * P)
    out = out_ptr + offs_k[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, tile, mask=(offs_k < K)[:, None] & (cols < N)[None, :])


def _check(x: torch.Tensor, packed: KMajorWeight) -> None:
    if x.dim() != 2 or x.shape[1] != packed.shape[1] or x.stride(1) != 1:
        raise ValueError(f"quantized matmul: x {tuple(x.shape)} against {list(packed.shape)}")


def _offsets(packed: KMajorWeight) -> torch.Tensor:
    return packed.offsets if packed.offsets is not None else packed.scales  # int8: never read


def split_for(columns: int, groups: int, block_c: int, programs: int, warps: int = 1) -> int:
    """K splits (whole groups each) that bring the GEMV to about ``programs`` programs: a
    matrix of few outputs (5,376 of them, K 21,504) otherwise leaves most SMs idle. Each
    split keeps at least one group per warp."""
    return max(1, min(groups // warps, programs // triton.cdiv(columns, block_c)))


def qgemv(
    x: torch.Tensor, packed: KMajorWeight, config: tuple[int, int, int, int] | None = None,
    split: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [1, K] @ W^T -> [1, N] in x's dtype; ``split`` K-splits (None: ``split_for`` the
    config's program count), summed in fp32 by a second small kernel."""
    _check(x, packed)
    if x.shape[0] != 1:
        raise ValueError(f"qgemv serves one row, got {x.shape[0]}")
    n, k = packed.shape
    block_c, programs, num_warps, unroll = config or packed.gemv_config or GEMV_CONFIG
    groups = k // packed.group_size
    unroll = min(unroll, packed.group_size)
    if split is None:
        split = split_for(packed.columns, groups, block_c, programs, num_warps)
    y = torch.empty((1, n), device=x.device, dtype=x.dtype)
    out = y if split == 1 else torch.empty((split, n), device=x.device, dtype=torch.float32)
    _qgemv_kernel[(triton.cdiv(packed.columns, block_c), split)](
        x, packed.words, packed.scales, _offsets(packed), out, n, packed.columns, k,
        GROUP=packed.group_size, INT4_KIND=packed.kind == INT4, BLOCK_C=block_c,
        UNROLL=unroll, WARPS=num_warps, num_warps=num_warps,
    )  # fmt: skip
    if split > 1:
        block = 256  # many programs: a split of 88 (5,376 outputs) reads 1.9 MB of partials
        _reduce_kernel[(triton.cdiv(n, block),)](out, y, n, SPLIT=split, BLOCK=block, num_warps=2)
    return y


def qgemm(
    x: torch.Tensor, packed: KMajorWeight, config: tuple[int, int, int, int] | None = None,
    split: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ W^T -> [M, N], weights dequantized in registers for ``tl.dot``; K split
    over ``split`` programs (None: enough for about GEMM_PROGRAMS programs), summed in fp32."""
    _check(x, packed)
    m = x.shape[0]
    n, k = packed.shape
    block_c, block_k, num_warps, num_stages = config or packed.gemm_config or GEMM_CONFIG
    group = packed.group_size
    block_k = max(16, group, block_k - block_k % group)  # a multiple of the group, >= 16
    if block_k > group and group < 16:
        block_k = 16  # groups of 8: two per tile, scales read per row
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = (triton.cdiv(packed.columns, block_c), triton.cdiv(m, block_m))
    if split is None:  # few word columns (5,376 outputs: 11 tiles of 64): split K
        split = max(1, min(triton.cdiv(k, block_k), GEMM_PROGRAMS // (tiles[0] * tiles[1])))
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    out = y if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    _qgemm_kernel[(*tiles, split)](
        x, packed.words, packed.scales, _offsets(packed), out, m, n, packed.columns, k,
        x.stride(0), n if split > 1 else y.stride(0),
        GROUP=group, INT4_KIND=packed.kind == INT4,
        BLOCK_M=block_m, BLOCK_C=block_c, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EVEN_K=k % block_k == 0,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split > 1:
        block = 256
        count = m * n
        _reduce_kernel[(triton.cdiv(count, block),)](
            out, y, count, SPLIT=split, BLOCK=block, num_warps=2
        )
    return y


def dequantize_triton(packed: KMajorWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight, transposed: [K, N] in ``dtype`` (the prefill path's scratch)."""
    n, k = packed.shape
    out = torch.empty((k, n), device=packed.words.device, dtype=dtype)
    block_c, block_k = 32, 32
    grid = (triton.cdiv(packed.columns, block_c), triton.cdiv(k, block_k))
    _dequant_kernel[grid](
        packed.words, packed.scales, _offsets(packed), out, n, packed.columns, k,
        GROUP=packed.group_size, INT4_KIND=packed.kind == INT4, BLOCK_C=block_c,
        BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def quant_linear(
    x: torch.Tensor, packed: KMajorWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for x [..., K], by the path that suits M."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if m == 0:
        y = flat.new_empty((0, packed.shape[0]))
    elif m <= GEMV_MAX_ROWS:
        y = qgemv(flat, packed)
    elif m <= GEMM_MAX_ROWS:
        y = qgemm(flat, packed)
    else:
        y = F.linear(flat, dequantize_triton(packed, flat.dtype).t())
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, packed.shape[0])


# -- choosing tiles per matrix ------------------------------------------------------------------

# candidates timed per matrix shape at start-up (tools/bench_quant_kernels.py --sweep: the
# fastest configs of the 31B shapes on an H200 were among these)
GEMV_CANDIDATES = [(128, 264, 8, 8), (128, 528, 4, 8), (64, 264, 8, 8), (128, 264, 8, 16),
                   (256, 264, 8, 8), (32, 64, 8, 16), (64, 132, 8, 16)]  # fmt: skip
GEMM_CANDIDATES = [(64, 32, 4, 3), (32, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 2)]


def choose_configs(
    weights: list[KMajorWeight],
    dtype: torch.dtype,
    timer: Callable[..., float] | None = None,
    cache: Path | None = None,
    device_name: str = "",
    remember: bool = True,
) -> int:
    """Time the candidate tiles of each distinct matrix (one row for the GEMV, 32 for the
    GEMM) inside CUDA graphs, the way decode runs them, and keep the fastest on each weight.
    A candidate this GPU cannot run (shared memory) is skipped. Choices are remembered in
    ``cache`` (a JSON file keyed by the GPU's name, the matrix and the candidates) so a later
    start skips the timing; ``remember=False`` leaves the file as it was (a run whose timer
    only launches, worker/device/cuda_setup.py). Returns the shapes timed now."""
    if timer is None:
        from worker.device.kernels.gemv import graph_seconds as timer
    known = _read_choices(cache)
    chosen: dict[tuple[object, ...], tuple[object, object]] = {}
    timed = 0
    for packed in weights:
        key = (packed.kind, packed.shape, packed.group_size)
        if key not in chosen:
            name = _choice_key(device_name, packed, dtype)
            if name in known:
                gemv, gemm = (tuple(c) if c else None for c in known[name])
            else:
                n, k = packed.shape
                device = packed.words.device
                one = torch.randn(1, k, device=device, dtype=dtype)
                many = torch.randn(32, k, device=device, dtype=dtype)
                gemv = _fastest(lambda c, x=one, w=packed: qgemv(x, w, c), GEMV_CANDIDATES, timer)
                gemm = _fastest(lambda c, x=many, w=packed: qgemm(x, w, c), GEMM_CANDIDATES, timer)
                known[name] = [gemv, gemm]
                timed += 1
            chosen[key] = (gemv, gemm)
        packed.gemv_config, packed.gemm_config = chosen[key]  # type: ignore[assignment]
    if timed and remember:
        _write_choices(cache, known)
    return timed


def _choice_key(device_name: str, packed: KMajorWeight, dtype: torch.dtype) -> str:
    n, k = packed.shape
    candidates = repr((GEMV_CANDIDATES, GEMM_CANDIDATES))
    digest = hashlib.sha256(candidates.encode()).hexdigest()[:8]
    return f"{device_name}|{packed.kind}|{n}x{k}|g{packed.group_size}|{dtype}|{digest}"


def _read_choices(cache: Path | None) -> dict[str, list[object]]:
    if cache is None or not cache.exists():
        return {}
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}  # a damaged file: time again, write it anew
    return data if isinstance(data, dict) else {}


def _write_choices(cache: Path | None, known: dict[str, list[object]]) -> None:
    if cache is None:
        return
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(known, indent=0, sort_keys=True))
        os.replace(partial, cache)  # atomic: concurrent workers never read half a file
    except OSError:
        pass  # a read-only home: time again next start


def tiles_cache() -> Path:
    """``quant_tiles.json`` beside the CPU kernel library (``$TOKENPIPE_CACHE/kernels``)."""
    from worker.device.cpu_gemv import _cache_dir

    return _cache_dir() / "quant_tiles.json"


def _fastest(run, candidates, timer):  # type: ignore[no-untyped-def]
    best = None
    for config in candidates:
        try:
            seconds = timer(lambda c=config: run(c))
        except Exception:  # noqa: BLE001 - e.g. out of shared memory on this GPU
            continue
        if best is None or seconds < best[0]:
            best = (seconds, config)
    return None if best is None else best[1]
