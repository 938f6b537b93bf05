"""The fused MoE of ``worker.device.kernels.moe`` over quantized experts (int4 / int8,
``worker.layers.quant_experts``): the same pair alignment, grouped gate/up and down GEMMs and
combine, with each expert's weight tiles read from its K-major words and dequantized in
registers before ``tl.dot``. Decode steps (at most ``GEMV_MAX_PAIRS`` pairs) take the per-pair
GEMVs of ``worker.device.kernels.moe_gemv`` instead; longer steps (prefill chunks) by default
dequantize the experts they hit into a float scratch of ``FusedExperts``' layout and run the
float grouped GEMMs (``dequantize_experts``: one pass over the words; the quantized grouped
GEMMs reached 0.08 TB/s of expert weights, 3,478 tok/s for a 2,048-token int4 prefill on the
H200 against bf16's 23,706).

    gate_up words int32 [E, H / P, 2I], scales (offsets) fp16 [E, H / g, 2I]
    down    words int32 [E, I / P, H],  scales (offsets) fp16 [E, I / g, H]

A program owns ``block_m`` rows of one expert and ``block_n`` outputs; per K tile (a multiple
of the group, so a tile holds whole groups) it loads the [BLOCK_K, BLOCK_N] words (each word
read by its P rows, once from memory), extracts the codes with the 2^23 mantissa trick
(``quant_matmul._extract``), applies each group's scale (and offset) in fp32 and rounds the
tile to x's dtype for the tensor cores. A weight is ``code * scale (+ offset)`` in fp32 as in
``worker.layers.quant.dequantize``; the roundings after the products are the float kernels'.
Groups must be a power of two from 8 (``supports``; ``--quantize`` checks it before loading on
CUDA). This module imports Triton: import it only after
``worker.device.kernels.triton_available()``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from worker.device.kernels.moe import (
    AlignedPairs,
    MoeBlocks,
    _dot,
    _store_gated,
    _store_routed,
    align_pairs_triton,
    choose_blocks,
    combine_pairs,
    fused_moe_triton,
)
from worker.device.kernels.moe_gemv import GEMV_MAX_PAIRS, moe_quant_gemv
from worker.device.kernels.quant_matmul import _extract
from worker.layers.quant import INT4
from worker.layers.quant_experts import DEQUANT_SCRATCH, ExpertMatrix, QuantExperts, per_word


def use_dequant() -> bool:
    """Steps too long for the per-pair GEMVs (prefill chunks) dequantize the experts they hit
    into a float scratch and run the float grouped GEMMs (``dequantize_experts``); with
    TOKENPIPE_MOE_QUANT_DEQUANT=0 the quantized grouped GEMMs instead (for comparison), and
    where the worker found no room for the scratch (``quant_experts.DEQUANT_SCRATCH``)."""
    if not DEQUANT_SCRATCH["allowed"]:
        return False
    return os.environ.get("TOKENPIPE_MOE_QUANT_DEQUANT", "1") != "0"


def use_gemv(pairs: int) -> bool:
    """A step of ``pairs`` (token, expert) pairs takes the per-pair GEMVs (decode); the grouped
    GEMMs otherwise, or always with TOKENPIPE_MOE_QUANT_GEMV=0 (for comparison)."""
    return pairs <= GEMV_MAX_PAIRS and os.environ.get("TOKENPIPE_MOE_QUANT_GEMV", "1") != "0"


def supports(experts: QuantExperts) -> bool:
    """Both matrices' groups a power of two from 8 (a word never straddles two groups)."""
    return all(g >= 8 and g & (g - 1) == 0 for g in experts.groups.values())


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, o_ptr, word_offs, meta_offs, position, mask_k, mask_g,
    INT4_KIND: tl.constexpr, GROUP: tl.constexpr, GPB: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """[BLOCK_K, BLOCK_N] fp32 weights: words at word_offs [BK, BN], the GPB groups' scales
    and offsets at meta_offs [GPB, BN]."""
    word = tl.load(w_ptr + word_offs, mask=mask_k, other=0)
    code = tl.reshape(_extract(word, position, INT4_KIND), [GPB, GROUP, BLOCK_N])
    scale = tl.load(s_ptr + meta_offs, mask=mask_g, other=0.0).to(tl.float32)
    if INT4_KIND:
        offset = tl.load(o_ptr + meta_offs, mask=mask_g, other=0.0).to(tl.float32)
        weight = code * scale[:, None, :] + offset[:, None, :]
    else:
        weight = code * scale[:, None, :]
    return tl.reshape(weight, [BLOCK_K, BLOCK_N])


@triton.jit
def _qgate_up_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, out_ptr, sorted_ptr, block_expert_ptr, PAIRS, E,
    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INNER: tl.constexpr, GROUP: tl.constexpr,
    INT4_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    P: tl.constexpr = 8 if INT4_KIND else 4
    GPB: tl.constexpr = BLOCK_K // GROUP
    N: tl.constexpr = 2 * INNER  # columns of an expert's K-major matrix: gate, then up
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= E:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < PAIRS
    token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INNER
    offs_n = tl.where(mask_n, offs_n, 0)  # columns past INNER read column 0, never stored
    x_rows = x_ptr + token[:, None] * HIDDEN  # [BLOCK_M, 1]
    w_base = w_ptr + expert * (HIDDEN // P * N)
    meta_base = expert * (HIDDEN // GROUP * N)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < HIDDEN
        a = tl.load(x_rows + offs_k[None, :], mask=valid[:, None] & in_k[None, :], other=0.0)
        word_offs = (offs_k // P)[:, None] * N + offs_n[None, :]  # [BK, BN]
        groups = k0 // GROUP + tl.arange(0, GPB)
        mask_g = (groups < HIDDEN // GROUP)[:, None]
        meta_offs = meta_base + groups[:, None] * N + offs_n[None, :]  # [GPB, BN]
        position = (offs_k % P)[:, None]
        w_gate = _weight_tile(
            w_base,
            s_ptr,
            o_ptr,
            word_offs,
            meta_offs,
            position,
            in_k[:, None],
            mask_g,
            INT4_KIND,
            GROUP,
            GPB,
            BLOCK_K,
            BLOCK_N,
        )
        w_up = _weight_tile(
            w_base,
            s_ptr,
            o_ptr,
            word_offs + INNER,
            meta_offs + INNER,
            position,
            in_k[:, None],
            mask_g,
            INT4_KIND,
            GROUP,
            GPB,
            BLOCK_K,
            BLOCK_N,
        )
        w_gate = w_gate.to(a.dtype)
        w_up = w_up.to(a.dtype)
        acc_gate = _dot(a, w_gate, acc_gate, IEEE)
        acc_up = _dot(a, w_up, acc_up, IEEE)
    _store_gated(acc_gate, acc_up, out_ptr, pair, offs_n, valid, mask_n, INNER, EVEN_N)


@triton.jit
def _qdown_kernel(
    h_ptr, w_ptr, s_ptr, o_ptr, route_ptr, out_ptr, sorted_ptr, block_expert_ptr, PAIRS, E,
    HIDDEN: tl.constexpr, INNER: tl.constexpr, GROUP: tl.constexpr, INT4_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    P: tl.constexpr = 8 if INT4_KIND else 4
    GPB: tl.constexpr = BLOCK_K // GROUP
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= E:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < PAIRS
    safe_pair = tl.where(valid, pair, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    offs_n = tl.where(mask_n, offs_n, 0)
    h_rows = h_ptr + safe_pair[:, None] * INNER
    w_base = w_ptr + expert * (INNER // P * HIDDEN)
    meta_base = expert * (INNER // GROUP * HIDDEN)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INNER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < INNER
        a = tl.load(h_rows + offs_k[None, :], mask=valid[:, None] & in_k[None, :], other=0.0)
        groups = k0 // GROUP + tl.arange(0, GPB)
        w = _weight_tile(
            w_base, s_ptr, o_ptr, (offs_k // P)[:, None] * HIDDEN + offs_n[None, :],
            meta_base + groups[:, None] * HIDDEN + offs_n[None, :], (offs_k % P)[:, None],
            in_k[:, None], (groups < INNER // GROUP)[:, None],
            INT4_KIND, GROUP, GPB, BLOCK_K, BLOCK_N,
        ).to(a.dtype)  # fmt: skip
        acc = _dot(a, w, acc, IEEE)
    _store_routed(acc, out_ptr, route_ptr, safe_pair, offs_n, valid, mask_n, HIDDEN, EVEN_N)


@triton.jit
def _dequant_experts_kernel(
    w_ptr, s_ptr, o_ptr, hit_ptr, out_ptr,
    K: tl.constexpr, N: tl.constexpr, GROUP: tl.constexpr, INT4_KIND: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[e, n, k] = code * scale (+ offset), in out's dtype, for the [BLOCK_W * P, BLOCK_N]
    tile of expert e = program 0 when hit[e] (an expert no pair chose is left unwritten)."""
    expert = tl.program_id(0)
    if tl.load(hit_ptr + expert) == 0:
        return
    P: tl.constexpr = 8 if INT4_KIND else 4
    BLOCK_K: tl.constexpr = BLOCK_W * P
    e = expert.to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    words = w_ptr + e * (K // P * N) + offs_w[:, None] * N + offs_n[None, :]
    word = tl.load(words, mask=(offs_w < K // P)[:, None] & mask_n[None, :], other=0)
    position = tl.arange(0, P)
    code = _extract(word[:, None, :], position[None, :, None], INT4_KIND)  # [BW, P, BN]
    code = tl.reshape(code, [BLOCK_K, BLOCK_N])  # row w * P + p: k of the tile
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_k < K)[:, None] & mask_n[None, :]
    meta = e * (K // GROUP * N) + (offs_k // GROUP)[:, None] * N + offs_n[None, :]
    scale = tl.load(s_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    if INT4_KIND:
        offset = tl.load(o_ptr + meta, mask=mask, other=0.0).to(tl.float32)
        weight = code * scale + offset
    else:
        weight = code * scale
    dst = out_ptr + e * (N * K) + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    tile = tl.trans(weight.to(out_ptr.dtype.element_ty))  # [BN, BK]: k contiguous in out
    tl.store(dst, tile, mask=mask_n[:, None] & (offs_k < K)[None, :])


def hit_experts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [T, k] -> int32 [E], 1 where some pair chose the expert (no host sync, no host
    tensor: capturable in a CUDA graph). Ids outside [0, E), which a padding row's garbage
    logits route to (the router's keys of NaN; the grouped GEMMs skip such pairs), are
    clamped: past the end into a spare entry, below 0 onto expert 0 (dequantized for
    nothing; the H200's worker start-up hit index_fill_'s bounds assert without this)."""
    hit = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    hit.index_fill_(0, ids.reshape(-1).clamp(0, num_experts), 1)
    return hit[:num_experts]


def dequantize_experts(matrix: ExpertMatrix, hit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stacked float weights [E, N, K] in ``dtype`` (the layout of ``FusedExperts``) of
    the experts ``hit`` marks (``hit_experts``); the others' rows are left uninitialised.
    Each weight is ``quant.dequantize``'s ``code * scale (+ offset)`` in fp32, rounded once,
    as the quantized grouped GEMMs round their tiles: one pass over the words, ~2.5 bytes
    written per weight (35B-A3B: 805 MB for a layer's 256 experts, ~0.3 ms on an H200)."""
    experts, n, k = matrix.shape
    out = torch.empty((experts, n, k), dtype=dtype, device=matrix.words.device)
    block_w = 16 if matrix.kind == INT4 else 32  # 128 inputs a tile
    grid = (experts, triton.cdiv(k // per_word(matrix.kind), block_w), triton.cdiv(n, 64))
    _dequant_experts_kernel[grid](
        matrix.words, matrix.scales, _offsets(matrix), hit, out,
        K=k, N=n, GROUP=matrix.group_size, INT4_KIND=matrix.kind == INT4,
        BLOCK_W=block_w, BLOCK_N=64, num_warps=4,
    )  # fmt: skip
    return out


def _block_k(group: int, wanted: int) -> int:
    """A K tile of whole groups, at least 16 (tl.dot's minimum)."""
    return max(group, 16, wanted - wanted % group)


def _offsets(matrix: ExpertMatrix) -> torch.Tensor:
    return matrix.offsets if matrix.offsets is not None else matrix.scales  # int8: never read


def fused_moe_quant_triton(
    x: torch.Tensor,
    gate_up: ExpertMatrix,
    down: ExpertMatrix,
    weights: torch.Tensor,
    ids: torch.Tensor,
    blocks: MoeBlocks | None = None,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    aligned: AlignedPairs | None = None,
    gemv: bool | None = None,
    dequant: bool | None = None,
    shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_moe_triton`` over quantized experts: x [T, H]; gate_up [E, 2I, H] and down
    [E, H, I] as ``ExpertMatrix``; weights [T, k] in x's dtype; ids [T, k] int64; shared
    [T, H], shared_gate [T, 1] (or ``shared_gate_weight``), residual [T, H] -> [T, H] in x's
    dtype (``aligned`` as there). ``gemv``: the per-pair GEMVs of ``moe_gemv.moe_quant_gemv``
    instead of the grouped GEMMs (None: for steps of at most GEMV_MAX_PAIRS pairs,
    ``use_gemv``). Otherwise ``dequant`` (None: ``use_dequant``): the hit experts dequantized
    to a float scratch, then the float grouped GEMMs; else the quantized grouped GEMMs (tiles
    dequantized in registers)."""
    if gemv is None:
        gemv = use_gemv(ids.numel())
    if gemv:
        return moe_quant_gemv(x, gate_up, down, weights, ids, shared, shared_gate, residual,
                              shared_gate_weight=shared_gate_weight)  # fmt: skip
    if dequant if dequant is not None else use_dequant():
        hit = hit_experts(ids, gate_up.shape[0])
        gate_up_weights = dequantize_experts(gate_up, hit, x.dtype)
        down_weights = dequantize_experts(down, hit, x.dtype)
        return fused_moe_triton(x, gate_up_weights, down_weights, weights, ids, blocks, shared,
                                shared_gate, residual, aligned, shared_gate_weight)  # fmt: skip
    tokens, hidden = x.shape
    num_experts, two_inner, _ = gate_up.shape
    inner = two_inner // 2
    top_k = ids.shape[1]
    assert down.shape == (num_experts, hidden, inner) and gate_up.shape[2] == hidden
    x = x.contiguous()
    blocks = blocks or choose_blocks(tokens, hidden, inner, quantized=True)
    if aligned is None:
        aligned = align_pairs_triton(ids, num_experts, blocks.block_m)
    assert aligned.block_m == blocks.block_m
    pairs = aligned.pairs
    num_blocks = aligned.block_expert.shape[0]
    ieee = x.dtype == torch.float32
    act = torch.empty(pairs, inner, dtype=x.dtype, device=x.device)
    _qgate_up_kernel[(num_blocks, triton.cdiv(inner, blocks.gate_up_n))](
        x, gate_up.words, gate_up.scales, _offsets(gate_up), act, aligned.sorted_pairs,
        aligned.block_expert, pairs, num_experts,
        TOP_K=top_k, HIDDEN=hidden, INNER=inner, GROUP=gate_up.group_size,
        INT4_KIND=gate_up.kind == INT4, BLOCK_M=blocks.block_m, BLOCK_N=blocks.gate_up_n,
        BLOCK_K=_block_k(gate_up.group_size, blocks.block_k),
        EVEN_N=inner % blocks.gate_up_n == 0, IEEE=ieee,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    route = weights.reshape(-1).contiguous()
    _qdown_kernel[(num_blocks, triton.cdiv(hidden, blocks.down_n))](
        act, down.words, down.scales, _offsets(down), route, out, aligned.sorted_pairs,
        aligned.block_expert, pairs, num_experts,
        HIDDEN=hidden, INNER=inner, GROUP=down.group_size, INT4_KIND=down.kind == INT4,
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.down_n,
        BLOCK_K=_block_k(down.group_size, blocks.block_k),
        EVEN_N=hidden % blocks.down_n == 0, IEEE=ieee,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    return combine_pairs(out, tokens, top_k, shared, shared_gate, residual, x, shared_gate_weight)
