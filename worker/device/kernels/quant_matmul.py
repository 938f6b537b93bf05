"""Triton matmuls over weight-only quantized weights (W4A16 / W8A16) on CUDA.

    packed = KMajorWeight.pack(qw)     # once, at start-up (worker/device/cuda_setup.py)
    y = quant_linear(x, packed)        # x [M, K] bf16/fp16/fp32 -> [M, N]

The canonical layout of ``worker.layers.quant`` (row-major codes) is repacked for the GPU
into a **K-major** one: codes in int32 words [K / P, N], word (w, n) holding the P codes of
k = P*w .. P*w + P - 1 of output n (int4: P = 8 nibbles, code i at bits 4i..4i+3; int8:
P = 4 signed bytes), and the fp16 scales (and int4 offsets) transposed to [K / g, N].
Consecutive threads read consecutive outputs (coalesced along N); each loaded word feeds P
multiply-adds against one shared x value each, so a weight costs an extract, a convert and
an FMA; a group's scale and offset apply once per word row, to the sums
``sum code * x`` and ``sum x`` (``w = code * scale + offset``). A first version walked the
row-major codes and reached only 0.9-1.5 TB/s on an H200 (instruction-bound on unpacking
and strided x loads: BENCHMARKS.md).

Three paths, by the number of rows M:

- **GEMV, M <= 4** (batch-1..4 decode): CUDA cores, fp32 accumulation, every row of x
  against each loaded word.
- **GEMM, 4 < M <= GEMM_MAX_ROWS** (decode batches): per code position p of the word, the
  [BLOCK_K / P, BLOCK_N] weights dequantized in registers to x's dtype and multiplied on the
  tensor cores against x's columns P*w + p (``tl.dot``), so no interleave is ever built.
- **Longer inputs** (prefill chunks): the weight dequantized into a [K, N] scratch of x's
  dtype by one kernel, then cuBLAS; the dequantization costs ~2.5 bytes per weight per
  chunk, small against a chunk's matmul.

Each weight is ``code * scale (+ offset)`` in fp32 as in the reference
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

GEMV_MAX_ROWS = 4
GEMM_MAX_ROWS = 64
# (BLOCK_N, BLOCK_K, num_warps, num_stages); tools/bench_quant_kernels.py --sweep
GEMV_CONFIG = (32, 256, 8, 3)
GEMM_CONFIG = (64, 128, 4, 3)  # BLOCK_M from M
PACK_ROWS = 4096  # rows repacked at a time: bounds the int32 temporaries


@dataclass
class KMajorWeight:
    """A quantized [N, K] weight in the GPU's K-major layout (module docstring)."""

    kind: str
    shape: tuple[int, int]
    group_size: int
    words: torch.Tensor  # int32 [K / P, N]
    scales: torch.Tensor  # fp16 [K / g, N]
    offsets: torch.Tensor | None  # fp16 [K / g, N], int4 only
    # tile configs timed for this matrix on this GPU (choose_configs); None: the defaults
    gemv_config: tuple[int, int, int, int] | None = None
    gemm_config: tuple[int, int, int, int] | None = None

    @property
    def per_word(self) -> int:
        return 8 if self.kind == INT4 else 4

    @property
    def nbytes(self) -> int:
        parts = [self.words, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    @staticmethod
    def supports(qw: QuantizedWeight) -> bool:
        """Groups of a power of two from 8 up (a word never straddles two groups)."""
        group = qw.group_size
        return group >= 8 and group & (group - 1) == 0

    @staticmethod
    def pack(qw: QuantizedWeight) -> KMajorWeight:
        n, k = qw.shape
        if not KMajorWeight.supports(qw):
            group = qw.group_size
            raise ValueError(f"K-major packing needs a power-of-two group >= 8, got {group}")
        per_word = 8 if qw.kind == INT4 else 4
        columns = []
        for start in range(0, n, PACK_ROWS):
            if qw.kind == INT4:
                codes = unpack_nibbles(qw.qdata[start : start + PACK_ROWS]).to(torch.int32)
                bits = 4
            else:
                codes = qw.qdata[start : start + PACK_ROWS].to(torch.int32) & 0xFF
                bits = 8
            codes = codes.view(codes.shape[0], k // per_word, per_word)
            word = torch.zeros(codes.shape[:2], dtype=torch.int32, device=codes.device)
            for position in range(per_word):
                word |= codes[:, :, position] << (bits * position)
            columns.append(word.t())
        words = torch.cat(columns, dim=1).contiguous()  # [K / P, N]
        offsets = None if qw.offsets is None else qw.offsets.t().contiguous()
        return KMajorWeight(
            qw.kind, qw.shape, qw.group_size, words, qw.scales.t().contiguous(), offsets
        )

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] of the dequantized weight -> [T, K] (an embedding lookup from a
        table shared with the LM head; plain torch ops over the T columns)."""
        n, k = self.shape
        words = self.words[:, ids]  # [K / P, T]
        bits = 32 // self.per_word
        shifts = torch.arange(self.per_word, device=words.device, dtype=torch.int32) * bits
        if self.kind == INT4:
            codes = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & 0xF
        else:  # signed bytes: shift each to the top, then arithmetic shift down
            codes = (words.unsqueeze(1) << (24 - shifts).view(1, -1, 1)) >> 24
        codes = codes.reshape(k, -1).t().float()  # [T, K]
        group = self.group_size
        scales = self.scales[:, ids].t().float().repeat_interleave(group, dim=1)
        out = codes * scales
        if self.offsets is not None:
            out = out + self.offsets[:, ids].t().float().repeat_interleave(group, dim=1)
        return out.to(dtype)


@triton.jit
def _extract(word, position, INT4_KIND: tl.constexpr):
    """Code ``position`` of each int32 word, as fp32. Without an integer-to-float conversion
    (a quarter-rate instruction on Hopper that capped the kernels at ~2 TB/s): the code goes
    into the mantissa of 2^23 and 2^23 (+ 128, for int8's sign flip) is subtracted, exact."""
    if INT4_KIND:
        bits = ((word >> (4 * position)) & 15) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    bits = (((word >> (8 * position)) & 255) ^ 128) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _qgemv_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, N, K, stride_xm, stride_ym, stride_ys,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    P: tl.constexpr = 8 if INT4_KIND else 4
    BW: tl.constexpr = BLOCK_K // P  # word rows per step
    WPG: tl.constexpr = GROUP // P  # word rows per group
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    words_k = K // P
    # split s walks the word rows [s * span, (s + 1) * span), span a multiple of BW
    span = tl.cdiv(tl.cdiv(words_k, SPLIT), BW) * BW
    first = split * span
    last = tl.minimum(first + span, words_k)
    acc0 = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
    for w0 in range(first, last, BW):
        rows = w0 + tl.arange(0, BW)
        mask_w = rows < last
        mask = mask_w[:, None] & mask_n[None, :]
        word = tl.load(w_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask,
                       other=0)  # fmt: skip
        meta = (rows // WPG)[:, None] * N + offs_n[None, :]
        scale = tl.load(s_ptr + meta, mask=mask, other=0.0).to(tl.float32)
        offset = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
        if INT4_KIND:
            offset = tl.load(o_ptr + meta, mask=mask, other=0.0).to(tl.float32)
        dot0 = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
        dot1 = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
        dot2 = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
        dot3 = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
        xs0 = tl.zeros([BW], dtype=tl.float32)
        xs1 = tl.zeros([BW], dtype=tl.float32)
        xs2 = tl.zeros([BW], dtype=tl.float32)
        xs3 = tl.zeros([BW], dtype=tl.float32)
        ks = rows * P
        for p in tl.static_range(P):
            code = _extract(word, p, INT4_KIND)
            x0 = tl.load(x_ptr + ks + p, mask=mask_w, other=0.0).to(tl.float32)
            dot0 += code * x0[:, None]
            xs0 += x0
            if ROWS > 1:
                x1 = tl.load(x_ptr + stride_xm + ks + p, mask=mask_w, other=0.0).to(tl.float32)
                dot1 += code * x1[:, None]
                xs1 += x1
            if ROWS > 2:
                x2 = tl.load(x_ptr + 2 * stride_xm + ks + p, mask=mask_w, other=0.0)
                x2 = x2.to(tl.float32)
                dot2 += code * x2[:, None]
                xs2 += x2
            if ROWS > 3:
                x3 = tl.load(x_ptr + 3 * stride_xm + ks + p, mask=mask_w, other=0.0)
                x3 = x3.to(tl.float32)
                dot3 += code * x3[:, None]
                xs3 += x3
        acc0 += dot0 * scale + offset * xs0[:, None]
        if ROWS > 1:
            acc1 += dot1 * scale + offset * xs1[:, None]
        if ROWS > 2:
            acc2 += dot2 * scale + offset * xs2[:, None]
        if ROWS > 3:
            acc3 += dot3 * scale + offset * xs3[:, None]
    # SPLIT 1: y in x's dtype; else fp32 partials y[split] that _reduce_kernel sums
    y_ptr += split * stride_ys
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, tl.sum(acc0, axis=0).to(out_ty), mask=mask_n)
    if ROWS > 1:
        tl.store(y_ptr + stride_ym + offs_n, tl.sum(acc1, axis=0).to(out_ty), mask=mask_n)
    if ROWS > 2:
        tl.store(y_ptr + 2 * stride_ym + offs_n, tl.sum(acc2, axis=0).to(out_ty), mask=mask_n)
    if ROWS > 3:
        tl.store(y_ptr + 3 * stride_ym + offs_n, tl.sum(acc3, axis=0).to(out_ty), mask=mask_n)


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
def _qgemm_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    P: tl.constexpr = 8 if INT4_KIND else 4
    GPB: tl.constexpr = BLOCK_K // GROUP  # groups per K tile (BLOCK_K a multiple of GROUP)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        # each word read by its P rows of the tile (one global read, the others from L1)
        word = tl.load(
            w_ptr + (offs_k // P)[:, None].to(tl.int64) * N + offs_n[None, :],
            mask=mask_k[:, None] & mask_n[None, :], other=0,
        )  # fmt: skip
        code = _extract(word, (offs_k % P)[:, None], INT4_KIND)  # [BK, BN]
        groups = k0 // GROUP + tl.arange(0, GPB)
        gmask = (groups < K // GROUP)[:, None] & mask_n[None, :]
        meta = groups[:, None] * N + offs_n[None, :]
        scale = tl.load(s_ptr + meta, mask=gmask, other=0.0).to(tl.float32)  # [GPB, BN]
        code3 = tl.reshape(code, [GPB, GROUP, BLOCK_N])
        if INT4_KIND:
            offset = tl.load(o_ptr + meta, mask=gmask, other=0.0).to(tl.float32)
            weight = code3 * scale[:, None, :] + offset[:, None, :]
        else:
            weight = code3 * scale[:, None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_tile = tl.reshape(weight, [BLOCK_K, BLOCK_N]).to(x.dtype)
        acc += tl.dot(x, w_tile, input_precision=PRECISION)
    out_ty = y_ptr.dtype.element_ty
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(out_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, o_ptr, out_ptr, N, K,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, BLOCK_N: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    """out [K, N] (x's dtype) = the dequantized weight, transposed."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    WPG: tl.constexpr = GROUP // P
    pid_n = tl.program_id(0)
    pid_w = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_w * BW + tl.arange(0, BW)
    mask = (rows < K // P)[:, None] & (offs_n < N)[None, :]
    word = tl.load(w_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0)
    meta = (rows // WPG)[:, None] * N + offs_n[None, :]
    scale = tl.load(s_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    offset = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
    if INT4_KIND:
        offset = tl.load(o_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    for p in tl.static_range(P):
        weight = _extract(word, p, INT4_KIND) * scale + offset
        ptrs = out_ptr + (rows * P + p)[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(ptrs, weight.to(out_ty), mask=mask)


def _check(x: torch.Tensor, packed: KMajorWeight) -> None:
    if x.dim() != 2 or x.shape[1] != packed.shape[1] or x.stride(1) != 1:
        raise ValueError(f"quantized matmul: x {tuple(x.shape)} against {list(packed.shape)}")


def _offsets(packed: KMajorWeight) -> torch.Tensor:
    return packed.offsets if packed.offsets is not None else packed.scales  # int8: never read


def _block_k(packed: KMajorWeight, wanted: int) -> int:
    """A GEMM K tile: a multiple of the group, at least 16 (tl.dot)."""
    group = packed.group_size
    return max(group, 16, wanted - wanted % group)


SPLIT_TARGET_PROGRAMS = 512  # ~4 per SM of an H200
MAX_SPLIT = 8


def split_for(n: int, k: int, block_n: int, block_k: int, per_word: int) -> int:
    """Split K until ~SPLIT_TARGET_PROGRAMS programs run: a matrix of few outputs (5,376,
    K 21,504) otherwise leaves most SMs idle (0.8 TB/s on an H200)."""
    programs = triton.cdiv(n, block_n)
    steps = triton.cdiv(k // per_word, block_k // per_word)
    split = 1
    while programs * split < SPLIT_TARGET_PROGRAMS and split * 2 <= min(steps, MAX_SPLIT):
        split *= 2
    return split


def qgemv(
    x: torch.Tensor, packed: KMajorWeight, config: tuple[int, int, int, int] | None = None,
    split: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (M <= GEMV_MAX_ROWS) @ W^T -> [M, N] in x's dtype; ``split`` K-splits (None:
    ``split_for``), summed in fp32 by a second small kernel."""
    _check(x, packed)
    rows = x.shape[0]
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"qgemv serves at most {GEMV_MAX_ROWS} rows, got {rows}")
    n, k = packed.shape
    block_n, block_k, num_warps, num_stages = config or packed.gemv_config or GEMV_CONFIG
    block_k = max(block_k, packed.per_word)
    if split is None:
        split = split_for(n, k, block_n, block_k, packed.per_word)
    y = torch.empty((rows, n), device=x.device, dtype=x.dtype)
    out = y if split == 1 else torch.empty((split, rows, n), device=x.device, dtype=torch.float32)
    _qgemv_kernel[(triton.cdiv(n, block_n), split)](
        x, packed.words, packed.scales, _offsets(packed), out, n, k, x.stride(0), n, rows * n,
        GROUP=packed.group_size, INT4_KIND=packed.kind == INT4, ROWS=rows,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split > 1:
        block = 1024
        _reduce_kernel[(triton.cdiv(rows * n, block),)](
            out, y, rows * n, SPLIT=split, BLOCK=block, num_warps=4
        )
    return y


def qgemm(
    x: torch.Tensor, packed: KMajorWeight, config: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N], weights dequantized in registers for ``tl.dot``."""
    _check(x, packed)
    m = x.shape[0]
    n, k = packed.shape
    block_n, block_k, num_warps, num_stages = config or packed.gemm_config or GEMM_CONFIG
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _qgemm_kernel[grid](
        x, packed.words, packed.scales, _offsets(packed), y, m, n, k, x.stride(0), y.stride(0),
        GROUP=packed.group_size, INT4_KIND=packed.kind == INT4,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(packed, block_k),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


def dequantize_triton(packed: KMajorWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight, transposed: [K, N] in ``dtype`` (the prefill path's scratch)."""
    n, k = packed.shape
    out = torch.empty((k, n), device=packed.words.device, dtype=dtype)
    block_n, bw = 128, 16
    grid = (triton.cdiv(n, block_n), triton.cdiv(k // packed.per_word, bw))
    _dequant_kernel[grid](
        packed.words, packed.scales, _offsets(packed), out, n, k,
        GROUP=packed.group_size, INT4_KIND=packed.kind == INT4, BLOCK_N=block_n, BW=bw,
        num_warps=4,
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
GEMV_CANDIDATES = [(32, 256, 4, 1), (32, 512, 8, 3), (32, 1024, 8, 3), (64, 512, 8, 3),
                   (128, 256, 8, 1)]  # fmt: skip
GEMM_CANDIDATES = [(64, 128, 4, 3), (128, 128, 4, 3), (64, 256, 8, 3), (128, 64, 4, 3)]


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
