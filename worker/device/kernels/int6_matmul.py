"""Triton matmuls over 6-bit weights (W6A16) on CUDA: a GGUF's Q6_K tensors at 7 bits a weight.

    packed = SixBitWeight.pack(qw)     # qw: an int6 QuantizedWeight (codes in [-32, 31])
    y = int6_linear(x, packed)         # x [M, K] -> [M, N]

int6 is symmetric (``w = q * scale``, one fp16 scale per group of 16 or a multiple of 16);
its canonical codes are int8 bytes (``worker.layers.quant``), which the CPU kernels take as
int8. On the GPU, u = q + 32 (0-63) is packed **K-major in two planes**, output-interleaved as
the int4 layout of ``quant_matmul`` (plain rows, C = N / 8 word columns):

    low    int32 [K, C]:      word (k, c) holds the low 4 bits of u[8c + p, k] in its nibble p
    high   int32 [K / 2, C]:  word (j, c) holds the top 2 bits of u[8c + p, 2j] at bits 2p and
                              those of u[8c + p, 2j + 1] at bits 16 + 2p
    scales fp16 [K / g, 8, C]: position-major, as the int4 layout's

So the batch-1 GEMV takes each word's codes with the int4 kernel's trick (``quant_matmul._code``:
``word & mask`` read as an fp32 is the code times a power of two, exact, so a weight costs an AND
and an FMA against x scaled by 2^90) for both planes, in separate sums per code position, and
applies ``(low + 16 high - 32) * scale`` once a group: about 4 instructions a weight, against
10+ for unpacking a row-major 6-bit layout (1.7 TB/s at best on an H200, BENCHMARKS.md session
37). 6 bits + 16 / 16 = 7 bits a weight at group 16 (Q6_K itself: 6.56), against 9 as int8 g16:
the 56 Q6_K tensors of a Gemma 4 31B Q4_K_M file go from 6.11 to 4.75 GB.

Three paths by the rows M of x: the GEMV (K split over programs for matrices of few outputs,
fp32 partials added in split order by the last program of a column block) at M == 1, a GEMM
on the tensor cores (a 16-row step's weights of all 8 code positions dequantized in registers
as one [16, 8 BLOCK_C] operand, then ``tl.dot``; 1.2-1.6x the int8 GEMM's time at 8-32 rows,
ALU-bound on the unpacking) up to GEMM_MAX_ROWS, and a dequantized scratch of at most
``quant_matmul.SCRATCH_BYTES`` with cuBLAS for prefill chunks. A worker packs int6 this way
where memory is tight (``cuda_setup.six_bit_planes``), else for the int8 kernels. Import after
``worker.device.kernels.triton_available()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.device.kernels.quant_matmul import _code, _unscale
from worker.layers.quant import INT6, QuantizedWeight

P = 8  # outputs a word column
GEMM_MAX_ROWS = 64
PACK_ELEMENTS = 1 << 24  # codes packed a chunk (bounds the int32 temporaries to ~64 MB)
# GEMV (word columns a program, warps = groups in flight; matrices of many outputs, which need
# no K split: GEMV_WIDE_C columns) and the programs the K split aims at: the fastest of
# tools/bench_int6.py's sweep on an H100 (BENCHMARKS.md session 37)
GEMV_BLOCK_C, GEMV_WIDE_C, GEMV_WARPS, GEMV_PROGRAMS = 32, 64, 8, 264
# GEMM: word columns a program of the one-dot kernel (`_int6_gemm_wide_kernel`; 0: one dot a
# code position, `_int6_gemm_kernel`), its warps, and the programs the K split aims at
GEMM_WIDE, GEMM_WARPS, GEMM_PROGRAMS = 64, 4, 264


@dataclass
class SixBitWeight:
    """A 6-bit [N, K] weight in the GPU's two-plane layout (module docstring)."""

    shape: tuple[int, int]
    group_size: int
    low: torch.Tensor  # int32 [K, C]
    high: torch.Tensor  # int32 [K / 2, C]
    scales: torch.Tensor  # fp16 [K / g, 8, C]
    kind: str = INT6
    # the K-split GEMV's arrival counters, one per column block (zero between calls)
    arrivals: torch.Tensor | None = None

    def counters(self, blocks: int) -> torch.Tensor:
        """At least ``blocks`` zeroed counters of this weight's own (made by ``pack``, before
        any CUDA graph capture: one per column block of the narrowest GEMV tile)."""
        if self.arrivals is None or self.arrivals.numel() < blocks:
            self.arrivals = torch.zeros(max(blocks, triton.cdiv(self.columns, 16)),
                                        dtype=torch.int32, device=self.low.device)  # fmt: skip
        return self.arrivals

    @property
    def columns(self) -> int:
        return self.low.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.low, self.high, self.scales))

    @staticmethod
    def supports(qw: QuantizedWeight) -> bool:
        return qw.kind == INT6 and qw.group_size % 16 == 0

    @staticmethod
    def pack(qw: QuantizedWeight) -> SixBitWeight:
        if not SixBitWeight.supports(qw):
            raise ValueError(f"6-bit packing needs int6 groups of a multiple of 16, got "
                             f"{qw.format.describe()}")  # fmt: skip
        n, k = qw.shape
        columns = triton.cdiv(n, P)
        device = qw.qdata.device
        low = torch.empty((k, columns), dtype=torch.int32, device=device)
        high = torch.empty((k // 2, columns), dtype=torch.int32, device=device)
        step = max(1, PACK_ELEMENTS // (k * P))  # word columns a chunk
        for first in range(0, columns, step):
            last = min(columns, first + step)
            u = torch.full(((last - first) * P, k), 32, dtype=torch.int32, device=device)
            rows = qw.qdata[first * P : last * P]
            u[: rows.shape[0]] = rows.to(torch.int32) + 32
            u = u.view(last - first, P, k)  # [c, p, k]
            word = torch.zeros((last - first, k), dtype=torch.int32, device=device)
            for p in range(P):
                word |= (u[:, p] & 15) << (4 * p)
            low[:, first:last] = word.t()
            top = (u >> 4).view(last - first, P, k // 2, 2)  # [c, p, j, k % 2]
            word = torch.zeros((last - first, k // 2), dtype=torch.int32, device=device)
            for p in range(P):
                word |= (top[:, p, :, 0] << (2 * p)) | (top[:, p, :, 1] << (16 + 2 * p))
            high[:, first:last] = word.t()
        padded = torch.zeros((columns * P, k // qw.group_size), dtype=torch.float16,
                             device=device)  # fmt: skip
        padded[:n] = qw.scales
        scales = padded.t().reshape(-1, columns, P).transpose(1, 2).contiguous()  # [K/g, P, C]
        packed = SixBitWeight(qw.shape, qw.group_size, low, high, scales)
        packed.counters(1)  # now, not inside a graph capture
        return packed

    def _where(self, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if ids is None:
            ids = torch.arange(self.shape[0], device=self.low.device)
        return ids // P, (ids % P).to(torch.int32)

    def codes(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The codes q in [-32, 31] of outputs ``ids`` (default all) -> int32 [T, K] (torch
        ops: the layout's reference, and an embedding lookup's few rows)."""
        column, position = self._where(ids)
        k = self.shape[1]
        lo = (self.low[:, column] >> (4 * position)[None, :]) & 15  # [K, T]
        parity = (torch.arange(k, device=lo.device, dtype=torch.int32) % 2 * 16)[:, None]
        top = self.high[:, column].repeat_interleave(2, dim=0)  # [K, T]
        hi = (top >> (parity + 2 * position[None, :])) & 3
        return ((lo | (hi << 4)) - 32).t()

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [T, K] of outputs ``ids`` (default all): ``q * scale`` as the reference."""
        column, position = self._where(ids)
        scales = self.scales[:, position, column].float()  # [K / g, T]
        return self.codes(ids).float() * scales.t().repeat_interleave(self.group_size, dim=1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] of the dequantized weight -> [T, K] (an embedding lookup from a
        table shared with the LM head)."""
        return self.dequantize(ids).to(dtype)


@triton.jit
def _high_code(word, p: tl.constexpr):
    """The 2-bit code at bits 2p of ``word`` as the fp32 code * 2^(2p - 149) (a denormal)."""
    return (word & (3 << (2 * p))).to(tl.float32, bitcast=True)


@triton.jit
def _high_unscale(p: tl.constexpr):
    """16 * 2^(59 - 2p): a `_high_code` times x * 2^90, times this, is 16 * code * x."""
    if p == 0:
        u = 9.223372036854775808e18  # 2^63
    elif p == 1:
        u = 2.305843009213693952e18  # 2^61
    elif p == 2:
        u = 5.764607523034234880e17  # 2^59
    elif p == 3:
        u = 1.441151880758558720e17  # 2^57
    elif p == 4:
        u = 3.602879701896396800e16  # 2^55
    elif p == 5:
        u = 9.007199254740992e15  # 2^53
    elif p == 6:
        u = 2.251799813685248e15  # 2^51
    else:
        u = 5.62949953421312e14  # 2^49
    return u


@triton.jit
def _pair(d, e, low0, high0, low1, high1, top0, top1, xb0, xb1, p: tl.constexpr):
    """Position p's sums over two input rows: d (low nibbles), e (top bits)."""
    d += _code(low0, high0, p, True) * xb0 + _code(low1, high1, p, True) * xb1
    e += _high_code(top0, p) * xb0 + _high_code(top1, p) * xb1
    return d, e


@triton.jit
def _group_end(a, d, e, s_ptr, meta, mask, xs, p: tl.constexpr, C):
    scale = tl.load(s_ptr + meta + p * C, mask=mask, other=0.0).to(tl.float32)
    return a + (d * _unscale(p, True) + e * _high_unscale(p) - 32.0 * xs) * scale


@triton.jit
def _store(out_ptr, a, offs_c, mask_c, N, p: tl.constexpr):
    out = offs_c * 8 + p
    tl.store(out_ptr + out, tl.sum(a, axis=0).to(out_ptr.dtype.element_ty),
             mask=mask_c & (out < N))  # fmt: skip


@triton.jit
def _int6_gemv_kernel(
    x_ptr, low_ptr, high_ptr, s_ptr, part_ptr, y_ptr, count_ptr, N, C, K, PER_SPLIT,
    GROUP: tl.constexpr, BLOCK_C: tl.constexpr, WARPS: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """y = x @ W^T for one row of x. Program (i, s): word columns [i * BLOCK_C, ...), the
    tile's WARPS rows taking groups w, w + WARPS, ... of split s; a group's rows are taken two
    at a time (one high word holds both). K split (SPLIT): each program stores fp32 partials
    [splits, N], and the last program of a column block to arrive (a counter per block, reset
    by that program) adds them in split order into y: deterministic, one kernel."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    cols = offs_c[None, :].to(tl.int64)
    lanes = tl.arange(0, WARPS)
    first = split * PER_SPLIT
    last = tl.minimum(first + PER_SPLIT, K // GROUP)
    a0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    for g0 in range(first, last, WARPS):
        g = g0 + lanes
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
        e0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        e1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        e2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        e3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        e4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        e5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        e6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        e7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        xs = tl.zeros([WARPS], dtype=tl.float32)
        for j in tl.static_range(GROUP // 2):
            k0 = g * GROUP + 2 * j
            row0 = k0[:, None].to(tl.int64) * C + cols
            low0 = tl.load(low_ptr + row0, mask=mask, other=0)
            low1 = tl.load(low_ptr + row0 + C, mask=mask, other=0)
            top = tl.load(high_ptr + (k0 // 2)[:, None].to(tl.int64) * C + cols, mask=mask,
                          other=0)  # fmt: skip
            x0 = tl.load(x_ptr + k0, mask=mask_g, other=0.0).to(tl.float32)
            x1 = tl.load(x_ptr + k0 + 1, mask=mask_g, other=0.0).to(tl.float32)
            xs += x0 + x1
            xb0 = (x0 * 1.2379400392853803e27)[:, None]  # 2^90: products stay normal floats
            xb1 = (x1 * 1.2379400392853803e27)[:, None]
            high0 = low0 >> 8
            high1 = low1 >> 8
            top1 = top >> 16
            d0, e0 = _pair(d0, e0, low0, high0, low1, high1, top, top1, xb0, xb1, 0)
            d1, e1 = _pair(d1, e1, low0, high0, low1, high1, top, top1, xb0, xb1, 1)
            d2, e2 = _pair(d2, e2, low0, high0, low1, high1, top, top1, xb0, xb1, 2)
            d3, e3 = _pair(d3, e3, low0, high0, low1, high1, top, top1, xb0, xb1, 3)
            d4, e4 = _pair(d4, e4, low0, high0, low1, high1, top, top1, xb0, xb1, 4)
            d5, e5 = _pair(d5, e5, low0, high0, low1, high1, top, top1, xb0, xb1, 5)
            d6, e6 = _pair(d6, e6, low0, high0, low1, high1, top, top1, xb0, xb1, 6)
            d7, e7 = _pair(d7, e7, low0, high0, low1, high1, top, top1, xb0, xb1, 7)
        meta = g[:, None] * (8 * C) + offs_c[None, :]
        xsum = xs[:, None]
        a0 = _group_end(a0, d0, e0, s_ptr, meta, mask, xsum, 0, C)
        a1 = _group_end(a1, d1, e1, s_ptr, meta, mask, xsum, 1, C)
        a2 = _group_end(a2, d2, e2, s_ptr, meta, mask, xsum, 2, C)
        a3 = _group_end(a3, d3, e3, s_ptr, meta, mask, xsum, 3, C)
        a4 = _group_end(a4, d4, e4, s_ptr, meta, mask, xsum, 4, C)
        a5 = _group_end(a5, d5, e5, s_ptr, meta, mask, xsum, 5, C)
        a6 = _group_end(a6, d6, e6, s_ptr, meta, mask, xsum, 6, C)
        a7 = _group_end(a7, d7, e7, s_ptr, meta, mask, xsum, 7, C)
    out = y_ptr
    if SPLIT:
        out = part_ptr + split * N
    _store(out, a0, offs_c, mask_c, N, 0)
    _store(out, a1, offs_c, mask_c, N, 1)
    _store(out, a2, offs_c, mask_c, N, 2)
    _store(out, a3, offs_c, mask_c, N, 3)
    _store(out, a4, offs_c, mask_c, N, 4)
    _store(out, a5, offs_c, mask_c, N, 5)
    _store(out, a6, offs_c, mask_c, N, 6)
    _store(out, a7, offs_c, mask_c, N, 7)
    if SPLIT:
        # every thread's partials are stored (barrier) before one thread's acq_rel add
        # publishes them; the last to arrive reads all (bypassing L1) and resets the counter
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            outs = pid * BLOCK_C * 8 + tl.arange(0, BLOCK_C * 8)
            mask_o = outs < N
            total = tl.zeros([BLOCK_C * 8], dtype=tl.float32)
            for other in range(tl.num_programs(1)):
                total += tl.load(part_ptr + other * N + outs, mask=mask_o, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            tl.store(y_ptr + outs, total.to(y_ptr.dtype.element_ty), mask=mask_o)
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def _weights16(low, top, s_ptr, gi, offs_c, mask_c, C, p: tl.constexpr):
    """Position p's [16, BLOCK_C] weights (fp32) of a 16-row step: ``top`` holds each row's
    high word already shifted to its half."""
    scale = tl.load(s_ptr + gi * (8 * C) + p * C + offs_c, mask=mask_c, other=0.0)
    code = (((low >> (4 * p)) & 15) | (((top >> (2 * p)) & 3) << 4)) - 32
    return code.to(tl.float32) * scale.to(tl.float32)[None, :]


@triton.jit
def _dot(acc, x, w, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
    return tl.dot(x, w.to(x.dtype), acc)


@triton.jit
def _gemm_store(out, acc, rows_m, mask_m, offs_c, N, p: tl.constexpr):
    cols = offs_c * 8 + p
    tl.store(out + rows_m[:, None].to(tl.int64) * N + cols[None, :], acc,
             mask=mask_m[:, None] & (cols < N)[None, :])  # fmt: skip


@triton.jit
def _step_planes(low_ptr, high_ptr, s, offs_c, mask_c, C):
    """A 16-row step's low words and each row's high word shifted to its half: [16, BLOCK_C]."""
    k = s * 16 + tl.arange(0, 16)
    cols = offs_c[None, :].to(tl.int64)
    low = tl.load(low_ptr + k[:, None].to(tl.int64) * C + cols, mask=mask_c[None, :], other=0)
    top = tl.load(high_ptr + (k // 2)[:, None].to(tl.int64) * C + cols, mask=mask_c[None, :],
                  other=0)  # fmt: skip
    return k, low, top >> ((k % 2) * 16)[:, None]


@triton.jit
def _int6_gemm_kernel(
    x_ptr, low_ptr, high_ptr, s_ptr, part_ptr, M, N, C, K, stride_x, PER_SPLIT,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """part[split, m, n] = x[m] . W[n] over split's 16-row steps: per code position p the
    step's weights of outputs 8c + p dequantized in registers, then ``tl.dot`` into p's
    accumulator."""
    pid_c = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows_m < M
    a0 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    a4 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    a5 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    a6 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    a7 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    first = split * PER_SPLIT
    last = tl.minimum(first + PER_SPLIT, K // 16)
    for s in range(first, last):
        k, low, top = _step_planes(low_ptr, high_ptr, s, offs_c, mask_c, C)
        x = tl.load(x_ptr + rows_m[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=mask_m[:, None], other=0.0)  # fmt: skip
        gi = (s * 16) // GROUP
        a0 = _dot(a0, x, _weights16(low, top, s_ptr, gi, offs_c, mask_c, C, 0), IEEE)
        a1 = _dot(a1, x, _weights16(low, top, s_ptr, gi, offs_c, mask_c, C, 1), IEEE)
        a2 = _dot(a2, x, _weights16(low, top, s_ptr, gi, offs_c, mask_c, C, 2), IEEE)
        a3 = _dot(a3, x, _weights16(low, top, s_ptr, gi, offs_c, mask_c, C, 3), IEEE)
        a4 = _dot(a4, x, _weights16(low, top, s_ptr, gi, offs_c, mask_c, C, 4), IEEE)
        a5 = _dot(a5, x, _weights16(low, top, s_ptr, gi, offs_c, mask_c, C, 5), IEEE)
        a6 = _dot(a6, x, _weights16(low, top, s_ptr, gi, offs_c, mask_c, C, 6), IEEE)
        a7 = _dot(a7, x, _weights16(low, top, s_ptr, gi, offs_c, mask_c, C, 7), IEEE)
    out = part_ptr + split * M * N
    _gemm_store(out, a0, rows_m, mask_m, offs_c, N, 0)
    _gemm_store(out, a1, rows_m, mask_m, offs_c, N, 1)
    _gemm_store(out, a2, rows_m, mask_m, offs_c, N, 2)
    _gemm_store(out, a3, rows_m, mask_m, offs_c, N, 3)
    _gemm_store(out, a4, rows_m, mask_m, offs_c, N, 4)
    _gemm_store(out, a5, rows_m, mask_m, offs_c, N, 5)
    _gemm_store(out, a6, rows_m, mask_m, offs_c, N, 6)
    _gemm_store(out, a7, rows_m, mask_m, offs_c, N, 7)


@triton.jit
def _step_weights(low, top, s_ptr, gi, offs_c, mask_c, C, BLOCK_C: tl.constexpr):
    """A 16-row step's weights of all 8 code positions: [16, 8 BLOCK_C] fp32, outputs 8c + p
    in order (shifts by position over a [16, BLOCK_C, 8] tensor)."""
    positions = tl.arange(0, 8)
    meta = offs_c[:, None] + positions[None, :] * C  # [BLOCK_C, 8]
    scale = tl.load(s_ptr + gi * (8 * C) + meta, mask=mask_c[:, None], other=0.0)
    lo = (low[:, :, None] >> (4 * positions)[None, None, :]) & 15
    hi = (top[:, :, None] >> (2 * positions)[None, None, :]) & 3
    w = ((lo | (hi << 4)) - 32).to(tl.float32) * scale.to(tl.float32)[None, :, :]
    return tl.reshape(w, [16, BLOCK_C * 8])


@triton.jit
def _int6_gemm_wide_kernel(
    x_ptr, low_ptr, high_ptr, s_ptr, part_ptr, M, N, C, K, stride_x, PER_SPLIT,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """As `_int6_gemm_kernel`, with a 16-row step's weights of all 8 code positions made as
    one [16, BLOCK_C, 8] tensor (shifts by position) and multiplied in one ``tl.dot`` against
    [16, 8 BLOCK_C] (outputs 8c + p in order: one coalesced store)."""
    pid_c = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_C * 8], dtype=tl.float32)
    first = split * PER_SPLIT
    last = tl.minimum(first + PER_SPLIT, K // 16)
    for s in range(first, last):
        k, low, top = _step_planes(low_ptr, high_ptr, s, offs_c, mask_c, C)
        x = tl.load(x_ptr + rows_m[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=mask_m[:, None], other=0.0)  # fmt: skip
        w = _step_weights(low, top, s_ptr, (s * 16) // GROUP, offs_c, mask_c, C, BLOCK_C)
        acc = _dot(acc, x, w, IEEE)
    cols = pid_c * BLOCK_C * 8 + tl.arange(0, BLOCK_C * 8)
    out = part_ptr + split * M * N + rows_m[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & (cols < N)[None, :])


@triton.jit
def _int6_dequant_kernel(
    low_ptr, high_ptr, s_ptr, out_ptr, N, C, first_c, width, GROUP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out[k, n - 8 first_c] = W[n, k] (the transposed weight, outputs from word column
    first_c on, ``width`` outputs a row of out) for one 16-row step and BLOCK_C columns, one
    contiguous store of [16, 8 BLOCK_C]."""
    s = tl.program_id(1)
    offs_c = first_c + tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    k, low, top = _step_planes(low_ptr, high_ptr, s, offs_c, mask_c, C)
    w = _step_weights(low, top, s_ptr, (s * 16) // GROUP, offs_c, mask_c, C, BLOCK_C)
    n = (first_c + tl.program_id(0) * BLOCK_C) * 8 + tl.arange(0, BLOCK_C * 8)
    cols = n - first_c * 8
    tl.store(out_ptr + k[:, None].to(tl.int64) * width + cols[None, :],
             w.to(out_ptr.dtype.element_ty), mask=((n < N) & (cols < width))[None, :])  # fmt: skip


def _splits(blocks: int, steps: int, programs: int) -> int:
    """K splits bringing ``blocks`` programs to about ``programs``, each keeping a step."""
    return max(1, min(steps, programs // blocks))


def _check(x: torch.Tensor, packed: SixBitWeight) -> None:
    if x.dim() != 2 or x.shape[1] != packed.shape[1] or x.stride(1) != 1:
        raise ValueError(f"6-bit matmul: x {tuple(x.shape)} against {list(packed.shape)}")


def _summed(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[split, M, N] fp32 partials -> [M, N] in ``dtype``, added in split order."""
    return (part[0] if part.shape[0] == 1 else part.sum(0)).to(dtype)


def int6_gemv(x: torch.Tensor, packed: SixBitWeight, split: int | None = None) -> torch.Tensor:
    """x [1, K] @ W^T -> [1, N] in x's dtype."""
    _check(x, packed)
    n, k = packed.shape
    groups = k // packed.group_size
    block_c = GEMV_BLOCK_C
    if triton.cdiv(packed.columns, GEMV_WIDE_C) >= GEMV_PROGRAMS:  # the LM head
        block_c = GEMV_WIDE_C
    blocks = triton.cdiv(packed.columns, block_c)
    split = split or _splits(blocks, triton.cdiv(groups, GEMV_WARPS), GEMV_PROGRAMS)
    per_split = triton.cdiv(triton.cdiv(groups, split), GEMV_WARPS) * GEMV_WARPS  # whole steps
    split = triton.cdiv(groups, per_split)
    y = torch.empty((1, n), device=x.device, dtype=x.dtype)
    part = torch.empty((split, n), device=x.device, dtype=torch.float32) if split > 1 else y
    _int6_gemv_kernel[(blocks, split)](
        x, packed.low, packed.high, packed.scales, part, y, packed.counters(blocks), n,
        packed.columns, k, per_split, GROUP=packed.group_size, BLOCK_C=block_c,
        WARPS=GEMV_WARPS, SPLIT=split > 1, num_warps=GEMV_WARPS,
    )  # fmt: skip
    return y


def int6_gemm(x: torch.Tensor, packed: SixBitWeight, split: int | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, M of any size (``int6_linear`` sends it 2 to
    GEMM_MAX_ROWS rows)."""
    _check(x, packed)
    m = x.shape[0]
    n, k = packed.shape
    block_m = 16 if m <= 16 else 32  # 33-64 rows: two row tiles (64 would spill)
    wide = GEMM_WIDE
    block_c = GEMM_WIDE if wide else 32 if m <= 16 else 16
    steps = k // 16
    blocks = triton.cdiv(packed.columns, block_c) * triton.cdiv(m, block_m)
    split = split or _splits(blocks, steps, GEMM_PROGRAMS)
    per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, per_split)
    part = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(packed.columns, block_c), triton.cdiv(m, block_m), split)
    kernel = _int6_gemm_wide_kernel if wide else _int6_gemm_kernel
    kernel[grid](
        x, packed.low, packed.high, packed.scales, part, m, n, packed.columns, k, x.stride(0),
        per_split, GROUP=packed.group_size, BLOCK_M=block_m, BLOCK_C=block_c,
        IEEE=x.dtype == torch.float32, num_warps=GEMM_WARPS,
    )  # fmt: skip
    return _summed(part, x.dtype)


def dequantize_t(
    packed: SixBitWeight,
    dtype: torch.dtype,
    start: int = 0,
    end: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight's outputs start..end (start a multiple of 8), transposed and dequantized:
    [K, end - start] in ``dtype``, into ``out`` where given."""
    n, k = packed.shape
    end = n if end is None else end
    assert start % P == 0 and 0 <= start < end <= n, (start, end, n)
    if out is None:
        out = torch.empty((k, end - start), device=packed.low.device, dtype=dtype)
    block_c = 32
    grid = (triton.cdiv(triton.cdiv(end - start, P), block_c), k // 16)
    _int6_dequant_kernel[grid](
        packed.low, packed.high, packed.scales, out, end, packed.columns, start // P,
        end - start, GROUP=packed.group_size, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out


def _dequantized_linear(flat: torch.Tensor, packed: SixBitWeight) -> torch.Tensor:
    """x [M, K] @ W^T through a scratch of at most ``quant_matmul.SCRATCH_BYTES`` (the
    reserved one where ``quant_matmul.reserve_scratch`` ran)."""
    from worker.device.kernels.quant_matmul import SCRATCH_BYTES, scratch

    n, k = packed.shape
    width = max(256, SCRATCH_BYTES // (k * flat.element_size()) // 256 * 256)
    if width >= n:
        return flat @ dequantize_t(packed, flat.dtype, out=scratch((k, n), flat.dtype, flat.device))
    y = flat.new_empty((flat.shape[0], n))
    for start in range(0, n, width):
        end = min(n, start + width)
        into = scratch((k, end - start), flat.dtype, flat.device)
        torch.mm(flat, dequantize_t(packed, flat.dtype, start, end, into), out=y[:, start:end])
    return y


def int6_linear(
    x: torch.Tensor, packed: SixBitWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for x [..., K], by the path that suits M."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if m == 0:
        y = flat.new_empty((0, packed.shape[0]))
    elif m == 1:
        y = int6_gemv(flat, packed)
    elif m <= GEMM_MAX_ROWS:
        y = int6_gemm(flat, packed)
    else:
        y = _dequantized_linear(flat, packed)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, packed.shape[0])
