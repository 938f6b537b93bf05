"""Decode batches of the MoE over quantized experts (8-64 tokens: a few pairs per expert):
the pairs grouped by expert (``moe.align_pairs_triton`` in blocks of ``block_m`` rows, 1, 2 or
4), and one program per block and ``block_n`` outputs that reads its expert's words once for
all its rows, on the CUDA cores.

    plan = align_pairs(ids, E, block_m)
    gate_up: part[s, pair, :2I] = x[pair // k] @ W_gate_up[e]^T over split s of K
    act[pair] = silu(sum_s gate) * sum_s up             (or in gate_up's epilogue, one split)
    down:    part[s, pair, :H]  = act[pair] @ W_down[e]^T over split s of K
    out[t] = sum_j route[t, j] * sum_s part[s, t*k + j]  (+ shared, + residual: the combine)

``moe_gemv``'s per-pair GEMVs read an expert's words once per pair: at 32 tokens of top 8 a
layer's 256 pairs touch ~163 of 256 experts (uniform routing), ~1.6x the distinct bytes.
Here each word is read once per block and its codes feed every row of the block (one FMA a
row per weight, padding rows included).

The layout and arithmetic are ``moe_gemv._pair_gemv_kernel``'s ([WARPS, COLS] tiles, one
quantization group per warp, codes read as fp32 denormals by one AND, the group's scale and
offset applied once per group, fp32 partial sums per split, the same epilogues), with the
block's rows unrolled, and one accumulator a row instead of one per code position: each word
is shifted so that every code lands at bit 16 or 20 (``_code16``), and x is scaled by 2^90 or
2^86 to match, so all products share one power of two. The sums' order differs from the
per-pair kernel's (equal but for fp32 rounding). Its outputs go to the same per-pair buffers,
so the activation, down projection and combine are shared.

(A first version kept the rows as a leading dimension of 3-D tiles: 3-5x slower than the
per-pair GEMVs on the H200; float experts the same way reached 2.2-2.9 TB/s against the
grouped GEMMs' 4.1, so float experts keep those.) This module imports Triton: import it only
after ``worker.device.kernels.triton_available()``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.device.kernels.moe import AlignedPairs, align_pairs_triton
from worker.device.kernels.moe_gemv import GemvTiles, _moe_gemv, _offsets, split_for
from worker.layers.quant import INT4
from worker.layers.quant_experts import ExpertMatrix

BLOCK_GEMV_DEFAULT = "0"  # off until measured on the H200 (TOKENPIPE_MOE_BLOCK_GEMV=1: on)
BLOCK_GEMV_MIN_PAIRS = 64
"""Quantized steps of at least this many pairs (8 tokens of top 8) and at most
``moe_gemv.GEMV_MAX_PAIRS`` take the blocked GEMVs (``use_block_gemv``)."""


@dataclass(frozen=True)
class BlockTiles:
    """Rows per expert block, output columns per program, warps (one group each at a time),
    and the programs wanted per launch (K is split to reach them)."""

    block_m: int = 2
    block_n: int = 128
    warps: int = 4
    programs: int = 264

    def gemv(self) -> GemvTiles:
        return GemvTiles(self.block_n, self.warps, self.programs)


def block_tiles() -> BlockTiles:
    """The default tiles, or TOKENPIPE_MOE_BLOCK_GEMV_TILES (four comma-separated fields)."""
    override = os.environ.get("TOKENPIPE_MOE_BLOCK_GEMV_TILES")
    return BlockTiles(*(int(v) for v in override.split(","))) if override else BlockTiles()


def use_block_gemv(pairs: int, flag: str | None = None) -> bool:
    """A quantized step of ``pairs`` pairs takes the blocked GEMVs. ``flag`` (default:
    TOKENPIPE_MOE_BLOCK_GEMV, else BLOCK_GEMV_DEFAULT): "1" for BLOCK_GEMV_MIN_PAIRS <= pairs
    <= GEMV_MAX_PAIRS, "all" for any step up to GEMV_MAX_PAIRS, "0" never."""
    from worker.device.kernels.moe_gemv import GEMV_MAX_PAIRS

    if flag is None:
        flag = os.environ.get("TOKENPIPE_MOE_BLOCK_GEMV", BLOCK_GEMV_DEFAULT)
    if flag not in ("1", "all"):
        return False
    low = 1 if flag == "all" else BLOCK_GEMV_MIN_PAIRS
    return low <= pairs <= GEMV_MAX_PAIRS


@triton.jit
def _code16(shifted, p: tl.constexpr, INT4_KIND: tl.constexpr):
    """Code p of each word as the fp32 code * 2^(a - 149), a denormal with its lowest bit at
    a = 16 (int4's even codes, int8's) or a = 20 (int4's odd codes): ``shifted`` is the word
    moved so that the code's byte sits at bits 16..23 (``word << 16``, ``<< 8``, itself,
    ``>> 8`` for codes 0-1, 2-3, 4-5, 6-7 of int4; 0, 1, 2, 3 of int8)."""
    if INT4_KIND:
        if p % 2 == 0:
            bits = shifted & 983040  # 0xF0000
        else:
            bits = shifted & 15728640  # 0xF00000
    else:
        bits = shifted & 16711680  # 0xFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fma(d, shifted, x, p: tl.constexpr, INT4_KIND: tl.constexpr):
    """d [WARPS, COLS] + code p of each word [WARPS, COLS] times x [WARPS] (a row's, one k per
    warp), x scaled so that every product is code * x * 2^-43 (one accumulator for all
    positions: 2^90 at a = 16, 2^86 at a = 20; exact powers of two)."""
    if INT4_KIND and p % 2 == 1:
        scaled = x * 7.737125245533627e25  # 2^86
    else:
        scaled = x * 1.2379400392853803e27  # 2^90
    return d + _code16(shifted, p, INT4_KIND) * scaled[:, None]


@triton.jit
def _row(d, xs, w16, w8, word, high, xk, mask, INT4_KIND: tl.constexpr):
    """One row's products with a word row: d [WARPS, COLS], xs [WARPS] (its x's sum, for the
    offsets) updated; xk [WARPS] the row's x at the word row's first k."""
    x0 = tl.load(xk + 0, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(xk + 1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xk + 2, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(xk + 3, mask=mask, other=0.0).to(tl.float32)
    if INT4_KIND:
        x4 = tl.load(xk + 4, mask=mask, other=0.0).to(tl.float32)
        x5 = tl.load(xk + 5, mask=mask, other=0.0).to(tl.float32)
        x6 = tl.load(xk + 6, mask=mask, other=0.0).to(tl.float32)
        x7 = tl.load(xk + 7, mask=mask, other=0.0).to(tl.float32)
        d = _fma(d, w16, x0, 0, INT4_KIND)
        d = _fma(d, w16, x1, 1, INT4_KIND)
        d = _fma(d, w8, x2, 2, INT4_KIND)
        d = _fma(d, w8, x3, 3, INT4_KIND)
        d = _fma(d, word, x4, 4, INT4_KIND)
        d = _fma(d, word, x5, 5, INT4_KIND)
        d = _fma(d, high, x6, 6, INT4_KIND)
        d = _fma(d, high, x7, 7, INT4_KIND)
        xs += x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
    else:
        d = _fma(d, w16, x0, 0, INT4_KIND)
        d = _fma(d, w8, x1, 1, INT4_KIND)
        d = _fma(d, word, x2, 2, INT4_KIND)
        d = _fma(d, high, x3, 3, INT4_KIND)
        xs += x0 + x1 + x2 + x3
    return d, xs


@triton.jit
def _group_sum(acc, d, xs, scale, offset, INT4_KIND: tl.constexpr):
    """acc [WARPS, COLS] + a group's products d (scaled by 2^-43) with its scale (and
    offset, or int8's 128) applied."""
    dot = d * 8796093022208.0  # 2^43
    if INT4_KIND:
        return acc + dot * scale + offset * xs[:, None]
    return acc + (dot - 128.0 * xs[:, None]) * scale


@triton.jit
def _store_row(
    acc, part_ptr, pair, offs_n, mask_n, split, PAIRS, N: tl.constexpr,
    BLOCK_N: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """One row's sums acc [WARPS, COLS] to part[split, pair] (fp32), or GATED: silu(gate) * up
    to part[pair, :N / 2] (``moe._store_gated``'s roundings); nothing for a padding row."""
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
        tl.store(dst, (act * up).to(out_ty), mask=(col < N // 2) & (col * 0 + pair < PAIRS))
    else:
        dst = part_ptr + (split * PAIRS + pair).to(tl.int64) * N + offs_n
        tl.store(dst, total, mask=mask_n & (offs_n * 0 + pair < PAIRS))


@triton.jit
def _block_gemv_kernel(
    x_ptr, sorted_ptr, block_expert_ptr, w_ptr, s_ptr, o_ptr, part_ptr, PAIRS, E, SPAN,
    X_DIV: tl.constexpr, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
    INT4_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WARPS: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """For each pair p of block b (``sorted`` rows b * BLOCK_M.., BLOCK_M of 1, 2 or 4; expert
    e = block_expert[b], none past the used blocks): part[split, p, n] = sum over this split's
    groups of x[p // X_DIV, k] * W[e, n, k]; words int32 [E, K / P, N], scales (offsets) fp16
    [E, K / GROUP, N]. GATED (gate_up, one split): BLOCK_N gate columns and the same up
    columns (N = 2I), storing act[p, :I] = silu(gate) * up in part's dtype. The rows are
    unrolled (one [WARPS, COLS] accumulator each, ``moe_gemv._pair_gemv_kernel``'s layout)."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    R: tl.constexpr = GROUP // P  # word rows per group
    GROUPS: tl.constexpr = K // GROUP
    COLS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    block = tl.program_id(0)
    split = tl.program_id(2)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= E:
        return
    lanes = tl.arange(0, WARPS)
    first_row = sorted_ptr + block * BLOCK_M
    pair0 = tl.load(first_row)  # PAIRS: padding
    valid0 = (lanes * 0 + pair0) < PAIRS  # [WARPS]
    x0_row = x_ptr + tl.where(pair0 < PAIRS, pair0 // X_DIV, 0).to(tl.int64) * K
    if BLOCK_M > 1:
        pair1 = tl.load(first_row + 1)
        valid1 = (lanes * 0 + pair1) < PAIRS  # [WARPS]
        x1_row = x_ptr + tl.where(pair1 < PAIRS, pair1 // X_DIV, 0).to(tl.int64) * K
    if BLOCK_M > 2:
        pair2 = tl.load(first_row + 2)
        valid2 = (lanes * 0 + pair2) < PAIRS  # [WARPS]
        x2_row = x_ptr + tl.where(pair2 < PAIRS, pair2 // X_DIV, 0).to(tl.int64) * K
        pair3 = tl.load(first_row + 3)
        valid3 = (lanes * 0 + pair3) < PAIRS  # [WARPS]
        x3_row = x_ptr + tl.where(pair3 < PAIRS, pair3 // X_DIV, 0).to(tl.int64) * K
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
    first = split * SPAN
    last = tl.minimum(first + SPAN, GROUPS)
    acc0 = tl.zeros([WARPS, COLS], dtype=tl.float32)
    if BLOCK_M > 1:
        acc1 = tl.zeros([WARPS, COLS], dtype=tl.float32)
    if BLOCK_M > 2:
        acc2 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        acc3 = tl.zeros([WARPS, COLS], dtype=tl.float32)
    for g0 in range(first, last, WARPS):
        g = g0 + lanes  # [WARPS]: one group per warp
        mask_g = g < last
        mask = mask_g[:, None] & mask_n[None, :]
        d0 = tl.zeros([WARPS, COLS], dtype=tl.float32)
        s0 = tl.zeros([WARPS], dtype=tl.float32)
        if BLOCK_M > 1:
            d1 = tl.zeros([WARPS, COLS], dtype=tl.float32)
            s1 = tl.zeros([WARPS], dtype=tl.float32)
        if BLOCK_M > 2:
            d2 = tl.zeros([WARPS, COLS], dtype=tl.float32)
            s2 = tl.zeros([WARPS], dtype=tl.float32)
            d3 = tl.zeros([WARPS, COLS], dtype=tl.float32)
            s3 = tl.zeros([WARPS], dtype=tl.float32)
        for r in tl.static_range(R):
            rows = g * R + r  # [WARPS] word rows
            word = tl.load(w_base + rows[:, None] * N + offs_n[None, :], mask=mask, other=0)
            if not INT4_KIND:
                word = word ^ -2139062144  # 0x80808080: each signed byte + 128
            w16 = word << 16
            w8 = word << 8
            high = word >> 8
            k = rows * P
            d0, s0 = _row(d0, s0, w16, w8, word, high, x0_row + k, mask_g & valid0, INT4_KIND)
            if BLOCK_M > 1:
                d1, s1 = _row(d1, s1, w16, w8, word, high, x1_row + k, mask_g & valid1,
                              INT4_KIND)  # fmt: skip
            if BLOCK_M > 2:
                d2, s2 = _row(d2, s2, w16, w8, word, high, x2_row + k, mask_g & valid2,
                              INT4_KIND)  # fmt: skip
                d3, s3 = _row(d3, s3, w16, w8, word, high, x3_row + k, mask_g & valid3,
                              INT4_KIND)  # fmt: skip
        meta = meta_base + g[:, None] * N + offs_n[None, :]
        scale = tl.load(s_ptr + meta, mask=mask, other=0.0).to(tl.float32)
        offset = scale
        if INT4_KIND:
            offset = tl.load(o_ptr + meta, mask=mask, other=0.0).to(tl.float32)
        acc0 = _group_sum(acc0, d0, s0, scale, offset, INT4_KIND)
        if BLOCK_M > 1:
            acc1 = _group_sum(acc1, d1, s1, scale, offset, INT4_KIND)
        if BLOCK_M > 2:
            acc2 = _group_sum(acc2, d2, s2, scale, offset, INT4_KIND)
            acc3 = _group_sum(acc3, d3, s3, scale, offset, INT4_KIND)
    _store_row(acc0, part_ptr, pair0, offs_n, mask_n, split, PAIRS, N, BLOCK_N, GATED)
    if BLOCK_M > 1:
        _store_row(acc1, part_ptr, pair1, offs_n, mask_n, split, PAIRS, N, BLOCK_N,
                   GATED)  # fmt: skip
    if BLOCK_M > 2:
        _store_row(acc2, part_ptr, pair2, offs_n, mask_n, split, PAIRS, N, BLOCK_N,
                   GATED)  # fmt: skip
        _store_row(acc3, part_ptr, pair3, offs_n, mask_n, split, PAIRS, N, BLOCK_N,
                   GATED)  # fmt: skip


def block_gemv(
    x: torch.Tensor, matrix: ExpertMatrix, aligned: AlignedPairs, rows_per_x: int,
    t: BlockTiles, gated: bool = False,
) -> torch.Tensor:  # fmt: skip
    """x [R, K], the pairs aligned in blocks of ``t.block_m`` (pair p reads x[p // rows_per_x])
    -> fp32 partial sums [split, pairs, N]; ``gated`` (gate_up) and one split: act
    [pairs, N / 2] in x's dtype, silu(gate) * up."""
    assert aligned.block_m == t.block_m
    num_experts, n, k = matrix.shape
    pairs = aligned.pairs
    blocks = aligned.block_expert.shape[0]
    split, span = split_for(blocks, n, k // matrix.group_size, t.gemv())
    gated = gated and split == 1
    if gated:
        part = torch.empty((pairs, n // 2), dtype=x.dtype, device=x.device)
    else:
        part = torch.empty((split, pairs, n), dtype=torch.float32, device=x.device)
    if pairs:
        columns = n // 2 if gated else n
        _block_gemv_kernel[(blocks, triton.cdiv(columns, t.block_n), split)](
            x, aligned.sorted_pairs, aligned.block_expert, matrix.words, matrix.scales,
            _offsets(matrix), part, pairs, num_experts, span, X_DIV=rows_per_x, N=n, K=k,
            GROUP=matrix.group_size, INT4_KIND=matrix.kind == INT4, BLOCK_M=t.block_m,
            BLOCK_N=t.block_n, WARPS=t.warps, GATED=gated, num_warps=t.warps,
        )  # fmt: skip
    return part


def moe_quant_block_gemv(
    x: torch.Tensor,
    gate_up: ExpertMatrix,
    down: ExpertMatrix,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    t: BlockTiles | None = None,
    aligned: AlignedPairs | None = None,
) -> torch.Tensor:
    """``moe_gemv.moe_quant_gemv`` with the pairs grouped by expert: x [T, H]; weights [T, k]
    in x's dtype; ids [T, k] int64 -> [T, H] in x's dtype. ``aligned``: the pairs already
    aligned for ``t.block_m``."""
    tiles_ = t or block_tiles()
    if aligned is None:
        aligned = align_pairs_triton(ids, gate_up.shape[0], tiles_.block_m)
    matrices = {"gate_up_proj": gate_up, "down_proj": down}

    def project(
        x: torch.Tensor, name: str, ids: torch.Tensor, rows: int, gated: bool
    ) -> torch.Tensor:
        return block_gemv(x, matrices[name], aligned, rows, tiles_, gated)

    inner = gate_up.shape[1] // 2
    return _moe_gemv(x, inner, weights, ids, project, shared, shared_gate, residual)
