"""Decode-sized steps of the MoE (a few tokens): one GEMV per (token, expert) pair on the CUDA
cores, no pair alignment and no ``tl.dot``; quantized experts (``moe_quant_gemv``) and float
ones (``moe_float_gemv``).

    gate_up: part[s, pair, :2I] = x[pair // k] @ W_gate_up[e]^T over split s of K
    act[pair] = silu(sum_s gate) * sum_s up             (one small kernel)
    down:    part[s, pair, :H]  = act[pair] @ W_down[e]^T over split s of K
    out[t] = sum_j route[t, j] * sum_s part[s, t*k + j]  (+ shared, + residual: the combine)

The grouped GEMMs (``worker.device.kernels.moe`` / ``moe_quant``) run 16-row blocks through
the tensor cores; a decode step's block holds one token, so quantized experts had each
[BLOCK_K, BLOCK_N] weight tile dequantized for one row's product (0.04-0.09 TB/s on the
H200), and float ones pad 15 of 16 rows. Here a program owns one pair and BLOCK_N outputs of
its expert and reads each weight once.

Quantized: its WARPS warps take one quantization group each (the experts' words are K-major,
``worker.layers.quant_experts``: a group is GROUP / P word rows of one column). A code
becomes an fp32 operand in one AND (``_code``: the code at bits a.. read as a denormal,
code * 2^(a - 149); the codes above bit 23 come from ``word >> 8``) and is multiplied by its
x scaled by a power of two (exact); at a group's end the group's scale (and offset, or
int8's 128) applies once. int8 words are XORed with 0x80808080 first, so their codes read as
code + 128. Each weight is ``code * scale (+ offset)`` in fp32, as
``worker.layers.quant.dequantize``. Two kernels:

- ``_pair_gemv_lanes_kernel`` (steps of at least LANES_MIN_PAIRS pairs; ``GemvTiles.lanes``):
  each lane takes 4 adjacent columns of 2 or 4 [WARPS, 128] tiles (one 128-bit load a word
  row), so the x values a lane loads serve 8-16 columns, and x is scaled per code position
  (``_x_scale``) so that one accumulator takes all of a word's codes: ~2.8-3.1
  instructions per weight and pair (sm_90 SASS, Triton 3.6), 56-96 registers. One layer of
  the 35B-A3B shape at 32 tokens: 126.9 us against 168.4 (H200).
- ``_pair_gemv_kernel`` (fewer pairs: faster at 1-4 tokens, where the lanes kernel splits K
  finely): one accumulator per code position, x scaled by 2^90. Its [WARPS, COLS] tiles
  are laid out by Triton with the warps along the columns (the gated gate_up's columns are
  not provably contiguous), so each lane holds all WARPS groups of a few columns and
  converts each x value for them: ~4.4 instructions per weight and pair.

Float: [BLOCK_N, BLOCK_K] tiles of the expert's rows (K contiguous), fp32 products summed
along K at the end.

K is split over programs when the pairs and output blocks alone leave the SMs idle; the
partial sums (fp32) are added in a fixed order (deterministic) by the epilogue kernels, and
the gate / up / pair outputs are rounded to x's dtype where the grouped kernels round them.
This module imports Triton: import it only after ``worker.device.kernels.triton_available()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.device.kernels.moe import combine_pairs
from worker.layers.quant import INT4
from worker.layers.quant_experts import ExpertMatrix

# quantized: steps of up to this many (token, expert) pairs take this path (H200, int4, per
# layer: 1 token 15.2 us against 199.4 for the grouped GEMMs, 4 tokens 35.3 against 768.2)
GEMV_MAX_PAIRS = 512
FLOAT_GEMV_MAX_PAIRS = 8  # float: one token of top-8 (more re-read experts the grouped GEMMs share)


@dataclass(frozen=True)
class GemvTiles:
    """Output columns per program, warps per program (one group each at a time), and the
    programs wanted per launch (K is split over programs to reach them). ``lanes``: the
    tiles of ``_pair_gemv_lanes_kernel`` a program takes (2 or 4, block_n columns each);
    0: ``_pair_gemv_kernel`` (block_n columns a program, gate and up each)."""

    block_n: int = 128
    warps: int = 4
    programs: int = 264  # 2 per SM of an H200 (the fastest of 12 tiles at 1 token)
    lanes: int = 4

    @property
    def program_n(self) -> int:
        """The columns of an [E, N, K] matrix one program covers (gate_up: gate and up)."""
        return self.lanes * self.block_n if self.lanes else self.block_n


LANES_MIN_PAIRS = 64
"""Steps of at least this many pairs (8 tokens of top 8) take the lanes kernel. H200, one
layer of int4 g32 experts (session 10): 32 tokens 126.9 us (4 tiles; 2 tiles 135.2) against
the per-pair kernel's 168.4; 4 tokens 34.6 against 32.5, 1 token 17.5 against 14.9 (its
K splits: the per-pair kernel stays below)."""


def tiles(pairs: int = LANES_MIN_PAIRS) -> GemvTiles:
    """The tiles of a step of ``pairs`` pairs (the lanes kernel from LANES_MIN_PAIRS, else the
    per-pair kernel), or TOKENPIPE_MOE_GEMV_TILES (three or four comma-separated fields: the
    tile sweep's choice, tools/bench_qwen3_5_moe_kernels.py)."""
    override = os.environ.get("TOKENPIPE_MOE_GEMV_TILES")
    if override:
        return GemvTiles(*(int(v) for v in override.split(",")))
    return GemvTiles() if pairs >= LANES_MIN_PAIRS else GemvTiles(lanes=0)


def split_for(pairs: int, n: int, groups: int, t: GemvTiles) -> tuple[int, int]:
    """(splits, groups per split) of K that bring the launch to about ``t.programs``
    programs: a split's groups a multiple of the warps where K allows, none empty (pure)."""
    programs = pairs * triton.cdiv(n, t.program_n)
    wanted = max(1, min(groups // t.warps, triton.cdiv(t.programs, programs)))
    span = triton.cdiv(triton.cdiv(groups, wanted), t.warps) * t.warps
    return triton.cdiv(groups, span), span


@dataclass(frozen=True)
class FloatTiles:
    """Float experts: outputs and K elements per tile, warps, programs wanted per launch."""

    block_n: int = 32
    block_k: int = 128
    warps: int = 4
    programs: int = 528  # the fastest of 5 tiles at 1 token on the H200 (21.2 us a layer)


def float_tiles() -> FloatTiles:
    """The default tiles, or TOKENPIPE_MOE_FLOAT_GEMV_TILES (four comma-separated fields)."""
    override = os.environ.get("TOKENPIPE_MOE_FLOAT_GEMV_TILES")
    return FloatTiles(*(int(v) for v in override.split(","))) if override else FloatTiles()


def float_split_for(pairs: int, n: int, k: int, t: FloatTiles) -> tuple[int, int]:
    """(splits, K elements per split: whole tiles, none empty) for about ``t.programs``
    programs (pure)."""
    programs = pairs * triton.cdiv(n, t.block_n)
    wanted = max(1, min(triton.cdiv(k, t.block_k), triton.cdiv(t.programs, programs)))
    span = triton.cdiv(triton.cdiv(k, wanted), t.block_k) * t.block_k
    return triton.cdiv(k, span), span


@triton.jit
def _pair_gemv_float_kernel(
    x_ptr, ids_ptr, w_ptr, part_ptr, PAIRS, SPAN,
    X_DIV: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """part[split, pair, n] = sum over this split's K of x[pair // X_DIV, k] * W[e, n, k],
    e = ids[pair]; W [E, N, K] contiguous."""
    pair = tl.program_id(0)
    split = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // X_DIV).to(tl.int64) * K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + expert * (N * K) + offs_n[:, None].to(tl.int64) * K
    first = split * SPAN
    last = tl.minimum(first + SPAN, K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(first, last, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < last
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_row + offs_k, mask=mask_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    dst = part_ptr + (split * PAIRS + pair).to(tl.int64) * N + offs_n
    tl.store(dst, tl.sum(acc, axis=1), mask=mask_n)


@triton.jit
def _code(word, high, p: tl.constexpr, INT4_KIND: tl.constexpr):
    """Code p of each word as the fp32 code * 2^(a_p - 149) (a denormal, exact); ``high`` is
    ``word >> 8`` (the codes above bit 23 taken from bits 16..23)."""
    if INT4_KIND:
        if p < 6:
            bits = word & (15 << (4 * p))
        else:
            bits = high & (15 << (4 * p - 8))
    else:
        if p < 3:
            bits = word & (255 << (8 * p))
        else:
            bits = high & (255 << 16)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _unscale(p: tl.constexpr, INT4_KIND: tl.constexpr):
    """2^(59 - a_p): ``_code`` times an x scaled by 2^90, times this, is code * x (a_p the
    code's lowest bit: 4p / 8p, or 16 / 20 for int4's codes 6 and 7, 16 for int8's code 3)."""
    if INT4_KIND:
        if p == 0:
            u = 5.764607523034235e17  # 2^59
        elif p == 1:
            u = 3.602879701896397e16  # 2^55
        elif p == 2:
            u = 2251799813685248.0  # 2^51
        elif p == 3:
            u = 140737488355328.0  # 2^47
        elif p == 4 or p == 6:
            u = 8796093022208.0  # 2^43
        else:
            u = 549755813888.0  # 2^39
    else:
        if p == 0:
            u = 5.764607523034235e17  # 2^59
        elif p == 1:
            u = 2251799813685248.0  # 2^51
        else:
            u = 8796093022208.0  # 2^43
    return u


@triton.jit
def _pair_gemv_kernel(
    x_ptr, ids_ptr, w_ptr, s_ptr, o_ptr, part_ptr, PAIRS, SPAN,
    X_DIV: tl.constexpr, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
    INT4_KIND: tl.constexpr, BLOCK_N: tl.constexpr, WARPS: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """part[split, pair, n] = sum over this split's groups of x[pair // X_DIV, k] * W[e, n, k],
    e = ids[pair]; words int32 [E, K / P, N], scales (offsets) fp16 [E, K / GROUP, N].
    GATED (gate_up, one split): the program takes BLOCK_N gate columns and the same up
    columns (N = 2I) and stores act[pair, :I] = silu(gate) * up in part's dtype instead."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    R: tl.constexpr = GROUP // P  # word rows per group
    GROUPS: tl.constexpr = K // GROUP
    COLS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    pair = tl.program_id(0)
    split = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // X_DIV).to(tl.int64) * K
    if GATED:  # columns j < BLOCK_N: gate rows; the rest: the up rows INNER further
        j = tl.arange(0, COLS)
        col = tl.program_id(1) * BLOCK_N + j % BLOCK_N
        mask_n = col < N // 2
        offs_n = tl.where(mask_n, col, 0) + (j // BLOCK_N) * (N // 2)
    else:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    w_base = w_ptr + expert * (K // P * N)
    meta_base = expert * (GROUPS * N)
    lanes = tl.arange(0, WARPS)
    first = split * SPAN
    last = tl.minimum(first + SPAN, GROUPS)
    acc = tl.zeros([WARPS, COLS], dtype=tl.float32)
    for g0 in range(first, last, WARPS):
        g = g0 + lanes  # [WARPS]: one group per warp
        mask_g = g < last
        mask = mask_g[:, None] & mask_n[None, :]
        d0 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        d1 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        d2 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        d3 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        d4 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        d5 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        d6 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        d7 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        xs = tl.zeros([WARPS], dtype=tl.float32)
        for r in tl.static_range(R):
            rows = g * R + r  # [WARPS] word rows
            word = tl.load(w_base + rows[:, None] * N + offs_n[None, :], mask=mask, other=0)
            if not INT4_KIND:
                word = word ^ -2139062144  # 0x80808080: each signed byte + 128
            high = word >> 8
            xk = x_row + rows * P
            x0 = tl.load(xk + 0, mask=mask_g, other=0.0).to(tl.float32)
            x1 = tl.load(xk + 1, mask=mask_g, other=0.0).to(tl.float32)
            x2 = tl.load(xk + 2, mask=mask_g, other=0.0).to(tl.float32)
            x3 = tl.load(xk + 3, mask=mask_g, other=0.0).to(tl.float32)
            d0 += _code(word, high, 0, INT4_KIND) * (x0 * 1.2379400392853803e27)[:, None]
            d1 += _code(word, high, 1, INT4_KIND) * (x1 * 1.2379400392853803e27)[:, None]
            d2 += _code(word, high, 2, INT4_KIND) * (x2 * 1.2379400392853803e27)[:, None]
            d3 += _code(word, high, 3, INT4_KIND) * (x3 * 1.2379400392853803e27)[:, None]
            xs += x0 + x1 + x2 + x3
            if INT4_KIND:
                x4 = tl.load(xk + 4, mask=mask_g, other=0.0).to(tl.float32)
                x5 = tl.load(xk + 5, mask=mask_g, other=0.0).to(tl.float32)
                x6 = tl.load(xk + 6, mask=mask_g, other=0.0).to(tl.float32)
                x7 = tl.load(xk + 7, mask=mask_g, other=0.0).to(tl.float32)
                d4 += _code(word, high, 4, INT4_KIND) * (x4 * 1.2379400392853803e27)[:, None]
                d5 += _code(word, high, 5, INT4_KIND) * (x5 * 1.2379400392853803e27)[:, None]
                d6 += _code(word, high, 6, INT4_KIND) * (x6 * 1.2379400392853803e27)[:, None]
                d7 += _code(word, high, 7, INT4_KIND) * (x7 * 1.2379400392853803e27)[:, None]
                xs += x4 + x5 + x6 + x7
        dot = d0 * _unscale(0, INT4_KIND) + d1 * _unscale(1, INT4_KIND)
        dot += d2 * _unscale(2, INT4_KIND) + d3 * _unscale(3, INT4_KIND)
        if INT4_KIND:
            dot += d4 * _unscale(4, INT4_KIND) + d5 * _unscale(5, INT4_KIND)
            dot += d6 * _unscale(6, INT4_KIND) + d7 * _unscale(7, INT4_KIND)
        meta = meta_base + g[:, None] * N + offs_n[None, :]
        scale = tl.load(s_ptr + meta, mask=mask, other=0.0).to(tl.float32)
        if INT4_KIND:
            offset = tl.load(o_ptr + meta, mask=mask, other=0.0).to(tl.float32)
            acc += dot * scale + offset * xs[:, None]
        else:
            acc += (dot - 128.0 * xs[:, None]) * scale
    total = tl.sum(acc, axis=0)  # [COLS]
    if GATED:
        both = tl.reshape(total, [2, BLOCK_N])
        half = tl.arange(0, 2)[:, None]
        out_ty = part_ptr.dtype.element_ty
        gate = tl.sum(tl.where(half == 0, both, 0.0), axis=0).to(out_ty).to(tl.float32)
        up = tl.sum(tl.where(half == 1, both, 0.0), axis=0).to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        dst = part_ptr + pair.to(tl.int64) * (N // 2) + col
        tl.store(dst, (act * up).to(out_ty), mask=col < N // 2)
    else:
        dst = part_ptr + (split * PAIRS + pair).to(tl.int64) * N + offs_n
        tl.store(dst, total, mask=mask_n)


@triton.jit
def _x_scale(p: tl.constexpr, INT4_KIND: tl.constexpr):
    """2^(89 - a_p): ``_code`` of position p (code * 2^(a_p - 149)) times x scaled by this is
    code * x * 2^-60 for every position alike (a_p as in ``_unscale``), so one accumulator
    takes all of a word's codes. x up to 2^39 in magnitude, as ``_pair_gemv_kernel``'s 2^90."""
    if INT4_KIND:
        if p == 0:
            u = 6.1897001964269014e26  # 2^89
        elif p == 1:
            u = 3.8685626227668134e25  # 2^85
        elif p == 2:
            u = 2.4178516392292583e24  # 2^81
        elif p == 3:
            u = 1.5111572745182865e23  # 2^77
        elif p == 4 or p == 6:
            u = 9.44473296573929e21  # 2^73
        else:
            u = 5.902958103587057e20  # 2^69
    else:
        if p == 0:
            u = 6.1897001964269014e26  # 2^89
        elif p == 1:
            u = 2.4178516392292583e24  # 2^81
        else:
            u = 9.44473296573929e21  # 2^73
    return u


@triton.jit
def _word_dot(word, xa, xb, xc, xd, xe, xf, xg, xh, d, INT4_KIND: tl.constexpr):
    """d + sum over a word row's codes of code * x * 2^-60 ([WARPS, LANE_N]; the x values
    [WARPS, 1] scaled by ``_x_scale``)."""
    high = word >> 8
    d += _code(word, high, 0, INT4_KIND) * xa
    d += _code(word, high, 1, INT4_KIND) * xb
    d += _code(word, high, 2, INT4_KIND) * xc
    d += _code(word, high, 3, INT4_KIND) * xd
    if INT4_KIND:
        d += _code(word, high, 4, INT4_KIND) * xe
        d += _code(word, high, 5, INT4_KIND) * xf
        d += _code(word, high, 6, INT4_KIND) * xg
        d += _code(word, high, 7, INT4_KIND) * xh
    return d


@triton.jit
def _x_value(x_row, k, mask_g, X_BF16: tl.constexpr, HIGH: tl.constexpr):
    """x[k] in fp32 ([WARPS]); X_BF16: ``k`` indexes x's bf16 pairs as int32 words, HIGH
    picks the pair's second value (bits 16..31; a bf16 is an fp32's top half)."""
    if X_BF16:
        pair = tl.load(x_row + k, mask=mask_g, other=0)
        bits = pair & -65536 if HIGH else pair << 16
        return bits.to(tl.float32, bitcast=True)
    return tl.load(x_row + k, mask=mask_g, other=0.0).to(tl.float32)


@triton.jit
def _pair_gemv_lanes_kernel(
    x_ptr, ids_ptr, order_ptr, w_ptr, s_ptr, o_ptr, part_ptr, PAIRS, SPAN,
    X_DIV: tl.constexpr, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
    INT4_KIND: tl.constexpr, LANE_N: tl.constexpr, WARPS: tl.constexpr, GATED: tl.constexpr,
    X_BF16: tl.constexpr, TILES: tl.constexpr, ORDERED: tl.constexpr,
):  # fmt: skip
    """``_pair_gemv_kernel``'s sums with each warp on one group at a time and each lane on
    LANE_N / 32 adjacent columns of TILES (2 or 4) [WARPS, LANE_N] tiles (LANE_N = 32 lanes x
    one 128-bit load: Triton then lays the warps along the groups, so a lane's x values serve
    all its columns), and one accumulator per column for all code positions (``_x_scale``).
    The tiles: columns [TILES * LANE_N * b, + TILES * LANE_N); GATED (gate_up, one split):
    gate columns [TILES / 2 * LANE_N * b, + TILES / 2 * LANE_N) and the same up columns INNER
    further, storing act[pair, :INNER] = silu(gate) * up in part's dtype. X_BF16: x is read
    as int32 pairs of bf16 (x_ptr an int32 view; K even). ORDERED: program i takes pair
    order[i] (the pairs sorted by expert: an expert's programs run side by side)."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    R: tl.constexpr = GROUP // P  # word rows per group
    GROUPS: tl.constexpr = K // GROUP
    XK: tl.constexpr = 2 if X_BF16 else 1  # x values per load
    if ORDERED:
        pair = tl.load(order_ptr + tl.program_id(0))
    else:
        pair = tl.program_id(0)
    split = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // X_DIV).to(tl.int64) * (K // XK)
    HALF: tl.constexpr = TILES // 2 * LANE_N  # gate columns per program (GATED)
    if GATED:  # tiles a (and c): gate columns; b (and d): the same up columns
        cols_a = tl.program_id(1) * HALF + tl.arange(0, LANE_N)
        cols_c = cols_a + LANE_N
        cols_b = cols_a + N // 2
        cols_d = cols_c + N // 2
        mask_a = cols_a < N // 2
        mask_c = cols_c < N // 2
        mask_b = mask_a
        mask_d = mask_c
    else:
        cols_a = tl.program_id(1) * (TILES * LANE_N) + tl.arange(0, LANE_N)
        cols_b = cols_a + LANE_N
        cols_c = cols_a + 2 * LANE_N
        cols_d = cols_a + 3 * LANE_N
        mask_a = cols_a < N
        mask_b = cols_b < N
        mask_c = cols_c < N
        mask_d = cols_d < N
    w_base = w_ptr + expert * (K // P * N)
    meta_base = expert * (GROUPS * N)
    lanes = tl.arange(0, WARPS)
    first = split * SPAN
    last = tl.minimum(first + SPAN, GROUPS)
    acc_a = tl.zeros([WARPS, LANE_N], dtype=tl.float32)  # sums * 2^-60
    acc_b = tl.zeros([WARPS, LANE_N], dtype=tl.float32)
    acc_c = tl.zeros([WARPS, LANE_N], dtype=tl.float32)  # TILES 4 only, as c and d below
    acc_d = tl.zeros([WARPS, LANE_N], dtype=tl.float32)
    for g0 in range(first, last, WARPS):
        g = g0 + lanes  # [WARPS]: one group per warp
        mask_g = g < last
        in_a = mask_g[:, None] & mask_a[None, :]
        in_b = mask_g[:, None] & mask_b[None, :]
        in_c = mask_g[:, None] & mask_c[None, :]
        in_d = mask_g[:, None] & mask_d[None, :]
        d_a = tl.zeros([WARPS, LANE_N], dtype=tl.float32)
        d_b = tl.zeros([WARPS, LANE_N], dtype=tl.float32)
        d_c = tl.zeros([WARPS, LANE_N], dtype=tl.float32)
        d_d = tl.zeros([WARPS, LANE_N], dtype=tl.float32)
        xs = tl.zeros([WARPS], dtype=tl.float32)
        for r in tl.static_range(R):
            rows = g * R + r  # [WARPS] word rows
            row_ptr = w_base + rows[:, None] * N
            word_a = tl.load(row_ptr + cols_a[None, :], mask=in_a, other=0)
            word_b = tl.load(row_ptr + cols_b[None, :], mask=in_b, other=0)
            if not INT4_KIND:
                word_a = word_a ^ -2139062144  # 0x80808080: each signed byte + 128
                word_b = word_b ^ -2139062144
            xk = rows * (P // XK)  # x's load index of k = P * row (+ position p: p // XK)
            x0 = _x_value(x_row, xk, mask_g, X_BF16, False)
            x1 = _x_value(x_row, xk + (1 // XK), mask_g, X_BF16, XK == 2)
            x2 = _x_value(x_row, xk + (2 // XK), mask_g, X_BF16, False)
            x3 = _x_value(x_row, xk + (3 // XK), mask_g, X_BF16, XK == 2)
            xs += x0 + x1 + x2 + x3
            if INT4_KIND:
                x4 = _x_value(x_row, xk + (4 // XK), mask_g, X_BF16, False)
                x5 = _x_value(x_row, xk + (5 // XK), mask_g, X_BF16, XK == 2)
                x6 = _x_value(x_row, xk + (6 // XK), mask_g, X_BF16, False)
                x7 = _x_value(x_row, xk + (7 // XK), mask_g, X_BF16, XK == 2)
                xs += x4 + x5 + x6 + x7
            else:
                x4 = x0
                x5 = x0
                x6 = x0
                x7 = x0
            xa = (x0 * _x_scale(0, INT4_KIND))[:, None]
            xb = (x1 * _x_scale(1, INT4_KIND))[:, None]
            xc = (x2 * _x_scale(2, INT4_KIND))[:, None]
            xd = (x3 * _x_scale(3, INT4_KIND))[:, None]
            xe = (x4 * _x_scale(4, INT4_KIND))[:, None]
            xf = (x5 * _x_scale(5, INT4_KIND))[:, None]
            xg = (x6 * _x_scale(6, INT4_KIND))[:, None]
            xh = (x7 * _x_scale(7, INT4_KIND))[:, None]
            d_a = _word_dot(word_a, xa, xb, xc, xd, xe, xf, xg, xh, d_a, INT4_KIND)
            d_b = _word_dot(word_b, xa, xb, xc, xd, xe, xf, xg, xh, d_b, INT4_KIND)
            if TILES == 4:
                word_c = tl.load(row_ptr + cols_c[None, :], mask=in_c, other=0)
                word_d = tl.load(row_ptr + cols_d[None, :], mask=in_d, other=0)
                if not INT4_KIND:
                    word_c = word_c ^ -2139062144
                    word_d = word_d ^ -2139062144
                d_c = _word_dot(word_c, xa, xb, xc, xd, xe, xf, xg, xh, d_c, INT4_KIND)
                d_d = _word_dot(word_d, xa, xb, xc, xd, xe, xf, xg, xh, d_d, INT4_KIND)
        meta_a = meta_base + g[:, None] * N + cols_a[None, :]
        meta_b = meta_base + g[:, None] * N + cols_b[None, :]
        scale_a = tl.load(s_ptr + meta_a, mask=in_a, other=0.0).to(tl.float32)
        scale_b = tl.load(s_ptr + meta_b, mask=in_b, other=0.0).to(tl.float32)
        xs = (xs * 8.673617379884035e-19)[:, None]  # 2^-60, as the d's
        if INT4_KIND:
            offset_a = tl.load(o_ptr + meta_a, mask=in_a, other=0.0).to(tl.float32)
            offset_b = tl.load(o_ptr + meta_b, mask=in_b, other=0.0).to(tl.float32)
            acc_a += d_a * scale_a + offset_a * xs
            acc_b += d_b * scale_b + offset_b * xs
        else:
            acc_a += (d_a - 128.0 * xs) * scale_a
            acc_b += (d_b - 128.0 * xs) * scale_b
        if TILES == 4:
            meta_c = meta_base + g[:, None] * N + cols_c[None, :]
            meta_d = meta_base + g[:, None] * N + cols_d[None, :]
            scale_c = tl.load(s_ptr + meta_c, mask=in_c, other=0.0).to(tl.float32)
            scale_d = tl.load(s_ptr + meta_d, mask=in_d, other=0.0).to(tl.float32)
            if INT4_KIND:
                offset_c = tl.load(o_ptr + meta_c, mask=in_c, other=0.0).to(tl.float32)
                offset_d = tl.load(o_ptr + meta_d, mask=in_d, other=0.0).to(tl.float32)
                acc_c += d_c * scale_c + offset_c * xs
                acc_d += d_d * scale_d + offset_d * xs
            else:
                acc_c += (d_c - 128.0 * xs) * scale_c
                acc_d += (d_d - 128.0 * xs) * scale_d
    _store_lanes(acc_a, acc_b, cols_a, cols_b, mask_a, mask_b, part_ptr, pair, split, PAIRS,
                 N, GATED)  # fmt: skip
    if TILES == 4:
        _store_lanes(acc_c, acc_d, cols_c, cols_d, mask_c, mask_d, part_ptr, pair, split,
                     PAIRS, N, GATED)  # fmt: skip


@triton.jit
def _store_lanes(
    acc_a, acc_b, cols_a, cols_b, mask_a, mask_b, part_ptr, pair, split, PAIRS,
    N: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """The lanes kernel's epilogue for two tiles (sums * 2^-60, [WARPS, LANE_N]): their
    fp32 partial sums, or (GATED: a the gate, b the up columns) silu(gate) * up."""
    total_a = tl.sum(acc_a, axis=0) * 1.152921504606847e18  # [LANE_N]; 2^60
    total_b = tl.sum(acc_b, axis=0) * 1.152921504606847e18
    if GATED:
        out_ty = part_ptr.dtype.element_ty
        gate = total_a.to(out_ty).to(tl.float32)
        up = total_b.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        dst = part_ptr + pair.to(tl.int64) * (N // 2) + cols_a
        tl.store(dst, (act * up).to(out_ty), mask=mask_a)
    else:
        dst = part_ptr + (split * PAIRS + pair).to(tl.int64) * N
        tl.store(dst + cols_a, total_a, mask=mask_a)
        tl.store(dst + cols_b, total_b, mask=mask_b)


@triton.jit
def _gated_sum_kernel(
    part_ptr, act_ptr, PAIRS, INNER: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr
):
    """act[pair] = silu(gate) * up over the summed splits of part [SPLIT, PAIRS, 2 * INNER],
    rounded as ``moe._store_gated`` rounds."""
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INNER
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        row = part_ptr + (s * PAIRS + pair) * (2 * INNER)
        gate += tl.load(row + offs, mask=mask, other=0.0)
        up += tl.load(row + INNER + offs, mask=mask, other=0.0)
    out_ty = act_ptr.dtype.element_ty
    gate = gate.to(out_ty).to(tl.float32)
    up = up.to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    tl.store(act_ptr + pair * INNER + offs, (act * up).to(out_ty), mask=mask)


def _offsets(matrix: ExpertMatrix) -> torch.Tensor:
    return matrix.offsets if matrix.offsets is not None else matrix.scales  # int8: never read


def pair_gemv(
    x: torch.Tensor, matrix: ExpertMatrix, ids: torch.Tensor, rows_per_x: int, t: GemvTiles,
    gated: bool = False, order: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Quantized: x [R, K], ids [pairs] (the expert of each pair; pair p reads
    x[p // rows_per_x]) -> fp32 partial sums [split, pairs, N] (``split_for``); ``gated``
    (gate_up) and one split: act [pairs, N / 2] in x's dtype, silu(gate) * up."""
    num_experts, n, k = matrix.shape
    pairs = ids.numel()
    split, span = split_for(pairs, n, k // matrix.group_size, t)
    gated = gated and split == 1
    if gated:
        part = torch.empty((pairs, n // 2), dtype=x.dtype, device=x.device)
    else:
        part = torch.empty((split, pairs, n), dtype=torch.float32, device=x.device)
    if pairs and t.lanes:
        x_bf16 = x.dtype == torch.bfloat16 and k % 2 == 0
        blocks = triton.cdiv(n, t.program_n)  # gated: program_n / 2 gate columns each
        _pair_gemv_lanes_kernel[(pairs, blocks, split)](
            x.view(torch.int32) if x_bf16 else x, ids, ids if order is None else order,
            matrix.words, matrix.scales,
            _offsets(matrix), part, pairs, span, X_DIV=rows_per_x, N=n, K=k,
            GROUP=matrix.group_size, INT4_KIND=matrix.kind == INT4, LANE_N=t.block_n,
            WARPS=t.warps, GATED=gated, X_BF16=x_bf16, TILES=t.lanes, ORDERED=order is not None,
            num_warps=t.warps,
        )  # fmt: skip
    elif pairs:
        columns = n // 2 if gated else n
        _pair_gemv_kernel[(pairs, triton.cdiv(columns, t.block_n), split)](
            x, ids, matrix.words, matrix.scales, _offsets(matrix), part, pairs, span,
            X_DIV=rows_per_x, N=n, K=k, GROUP=matrix.group_size, INT4_KIND=matrix.kind == INT4,
            BLOCK_N=t.block_n, WARPS=t.warps, GATED=gated, num_warps=t.warps,
        )  # fmt: skip
    return part


def pair_gemv_float(
    x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, rows_per_x: int, t: FloatTiles
) -> torch.Tensor:
    """Float: x [R, K], weight [E, N, K] -> fp32 partial sums [split, pairs, N]."""
    num_experts, n, k = weight.shape
    pairs = ids.numel()
    split, span = float_split_for(pairs, n, k, t)
    part = torch.empty((split, pairs, n), dtype=torch.float32, device=x.device)
    if pairs:
        _pair_gemv_float_kernel[(pairs, triton.cdiv(n, t.block_n), split)](
            x, ids, weight, part, pairs, span, X_DIV=rows_per_x, N=n, K=k,
            BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps,
        )  # fmt: skip
    return part


Project = Callable[[torch.Tensor, str, torch.Tensor, int, bool], torch.Tensor]


def _moe_gemv(
    x: torch.Tensor, inner: int, weights: torch.Tensor, ids: torch.Tensor, project: Project,
    shared: torch.Tensor | None, shared_gate: torch.Tensor | None,
    residual: torch.Tensor | None, shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The module docstring's four launches; ``project(x, matrix, ids, rows_per_x, gated)``
    the partial sums of one matrix ("gate_up_proj" / "down_proj"), or with ``gated`` the
    activations themselves (2-D) where it can (one launch fewer)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    pairs = tokens * top_k
    x = x.contiguous()
    flat_ids = ids.reshape(-1).contiguous()
    part = project(x, "gate_up_proj", flat_ids, top_k, True)
    act = part if part.dim() == 2 else torch.empty(pairs, inner, dtype=x.dtype, device=x.device)
    if pairs and part.dim() == 3:
        block = 256
        _gated_sum_kernel[(pairs, triton.cdiv(inner, block))](
            part, act, pairs, INNER=inner, SPLIT=part.shape[0], BLOCK=block, num_warps=2
        )
    out = project(act, "down_proj", flat_ids, 1, False)
    route = weights.reshape(-1).contiguous()
    return combine_pairs(out, tokens, top_k, shared, shared_gate, residual, x,
                         shared_gate_weight, route)  # fmt: skip


def moe_quant_gemv(
    x: torch.Tensor,
    gate_up: ExpertMatrix,
    down: ExpertMatrix,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    t: GemvTiles | None = None,
    order: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_quant.fused_moe_quant_triton`` for a few tokens: x [T, H]; weights [T, k] in x's
    dtype; ids [T, k] int64 -> [T, H] in x's dtype. ``order`` [T * k] int32: the pairs in
    the order the lanes kernel's programs take them (by expert: ``expert_order``)."""
    tiles_ = t or tiles(ids.numel())
    matrices = {"gate_up_proj": gate_up, "down_proj": down}

    def project(
        x: torch.Tensor, name: str, ids: torch.Tensor, rows: int, gated: bool
    ) -> torch.Tensor:
        return pair_gemv(x, matrices[name], ids, rows, tiles_, gated, order)

    inner = gate_up.shape[1] // 2
    return _moe_gemv(x, inner, weights, ids, project, shared, shared_gate, residual,
                     shared_gate_weight)  # fmt: skip


def expert_order(ids: torch.Tensor) -> torch.Tensor:
    """ids [T, k] -> int32 [T * k]: the pairs sorted by expert (ties in pair order)."""
    return torch.argsort(ids.reshape(-1), stable=True).to(torch.int32)


def moe_float_gemv(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    t: FloatTiles | None = None,
    shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe.fused_moe_triton`` for a token or two: gate_up [E, 2I, H], down [E, H, I]
    (contiguous); the rest as there."""
    tiles_ = t or float_tiles()
    matrices = {"gate_up_proj": gate_up, "down_proj": down}

    def project(
        x: torch.Tensor, name: str, ids: torch.Tensor, rows: int, gated: bool
    ) -> torch.Tensor:
        return pair_gemv_float(x, matrices[name], ids, rows, tiles_)

    inner = gate_up.shape[1] // 2
    return _moe_gemv(x, inner, weights, ids, project, shared, shared_gate, residual,
                     shared_gate_weight)  # fmt: skip


def use_float_gemv(pairs: int) -> bool:
    """Float experts take the per-pair GEMVs for a step of at most FLOAT_GEMV_MAX_PAIRS
    pairs (H200, bf16, one layer at 1 token: 21.2 us against 25.9 for the grouped GEMMs,
    whose routing also aligns the pairs), unless TOKENPIPE_MOE_FLOAT_GEMV=0."""
    return pairs <= FLOAT_GEMV_MAX_PAIRS and os.environ.get("TOKENPIPE_MOE_FLOAT_GEMV") != "0"
