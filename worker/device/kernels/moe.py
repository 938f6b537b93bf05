"""Fused mixture-of-experts on the GPU: the (token, expert) pairs of a step grouped by expert
and run as one grouped GEMM per matrix, with no host sync (capturable in a CUDA graph).

    plan = align_pairs(ids, num_experts, block_m)      # torch ops, static shapes
    hidden = gate_up: silu(x W_g^T) * (x W_u^T)         # one launch, every expert hit
    out = down: (hidden W_d^T) * routing weight         # one launch
    y[t] = sum over t's k pairs of out                  # [T, k, H] -> [T, H]

``align_pairs`` sorts the T * k pairs by expert and pads each expert's run to a multiple of
``block_m`` (vLLM's ``moe_align_block_size``, in plain torch): row r of the padded order holds a
pair id (``pairs`` marks padding), and block b of ``block_m`` rows belongs to one expert
(``num_experts`` past the last used block: the kernels return at once there). The bound on the
padded length depends only on T, k, E and ``block_m``, so the grid is fixed for a given T.

Each GEMM program owns ``block_m`` rows of one expert and ``block_n`` output features: it
gathers its tokens' rows of x (or of the hidden activations) and streams that expert's weight
tiles once for all of them, so a weight is read once per block of tokens that picked it.

Numerics: float32 accumulation (IEEE products for float32 weights, the tests' path); the
gate/up products and the down product are rounded to the weights' dtype as the torch path
rounds them; the k pairs of a token are summed in float32. This module imports Triton: import
it only after `worker.device.kernels.triton_available()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class AlignedPairs:
    """The pairs of a step sorted by expert, padded per expert to whole blocks."""

    sorted_pairs: torch.Tensor  # [padded] int32 pair id (t * k + j), `pairs` for padding
    block_expert: torch.Tensor  # [padded / block_m] int32 expert of each block (E: unused)
    pairs: int  # T * k
    block_m: int


def padded_length(pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded length, a multiple of block_m (pure): each expert that was
    hit (at most min(E, pairs) of them) adds fewer than block_m rows of padding."""
    bound = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """ids [T, k] int64 expert of each pair -> AlignedPairs (no host sync)."""
    flat = ids.reshape(-1)
    pairs = flat.shape[0]
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded_counts, 0)  # [E] end row of each expert's run
    starts = ends - padded_counts
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [E] index in `order`
    rank = torch.arange(pairs, device=device) - first_of_expert[sorted_experts]
    dest = starts[sorted_experts] + rank
    length = padded_length(pairs, num_experts, block_m)
    sorted_pairs = torch.full((length,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, length, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return AlignedPairs(sorted_pairs, block_expert, pairs, block_m)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, PAIRS, E,
    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INNER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
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
    offs_n = tl.where(mask_n, offs_n, 0)  # columns past INNER read row 0, never stored
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * HIDDEN  # [BLOCK_M, 1]
    w_base = w_ptr + expert * (2 * INNER * HIDDEN)
    gate_cols = w_base + offs_n[None, :].to(tl.int64) * HIDDEN  # [1, BLOCK_N]
    up_cols = gate_cols + INNER * HIDDEN
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            a = tl.load(x_rows + ks[None, :], mask=valid[:, None], other=0.0)
            w_gate = tl.load(gate_cols + ks[:, None])  # [BLOCK_K, BLOCK_N]
            w_up = tl.load(up_cols + ks[:, None])
        else:
            in_k = ks < HIDDEN
            a = tl.load(x_rows + ks[None, :], mask=valid[:, None] & in_k[None, :], other=0.0)
            w_gate = tl.load(gate_cols + ks[:, None], mask=in_k[:, None], other=0.0)
            w_up = tl.load(up_cols + ks[:, None], mask=in_k[:, None], other=0.0)
        if IEEE:
            acc_gate += tl.dot(a, w_gate, input_precision="ieee")
            acc_up += tl.dot(a, w_up, input_precision="ieee")
        else:
            acc_gate += tl.dot(a, w_gate)
            acc_up += tl.dot(a, w_up)
    out_ty = out_ptr.dtype.element_ty
    gate = acc_gate.to(out_ty).to(tl.float32)
    up = acc_up.to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    hidden = (act * up).to(out_ty)
    dst = out_ptr + pair[:, None].to(tl.int64) * INNER + offs_n[None, :]
    if EVEN_N:
        tl.store(dst, hidden, mask=valid[:, None])
    else:
        tl.store(dst, hidden, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, route_ptr, out_ptr, sorted_ptr, block_expert_ptr, PAIRS, E,
    HIDDEN: tl.constexpr, INNER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
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
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + safe_pair[:, None] * INNER
    w_cols = w_ptr + expert * (HIDDEN * INNER) + offs_n[None, :].to(tl.int64) * INNER
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INNER, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            a = tl.load(h_rows + ks[None, :], mask=valid[:, None], other=0.0)
            w = tl.load(w_cols + ks[:, None])  # [BLOCK_K, BLOCK_N]
        else:
            in_k = ks < INNER
            a = tl.load(h_rows + ks[None, :], mask=valid[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None], mask=in_k[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    out_ty = out_ptr.dtype.element_ty
    route = tl.load(route_ptr + safe_pair, mask=valid, other=0.0).to(tl.float32)
    out = (acc.to(out_ty).to(tl.float32) * route[:, None]).to(out_ty)
    dst = out_ptr + safe_pair[:, None] * HIDDEN + offs_n[None, :]
    if EVEN_N:
        tl.store(dst, out, mask=valid[:, None])
    else:
        tl.store(dst, out, mask=valid[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class MoeBlocks:
    """Tile sizes of one call: rows per expert block, output features, reduction step."""

    block_m: int
    gate_up_n: int
    down_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _tile(limit: int, size: int) -> int:
    """The power of two <= limit covering size, at least 16 (tl.dot's minimum)."""
    return max(16, min(limit, 1 << (size - 1).bit_length()))


def choose_blocks(tokens: int, hidden: int, inner: int) -> MoeBlocks:
    """Small steps (decode) want many programs over the weights and little row padding;
    prefill chunks want bigger tiles (pure)."""
    if tokens <= 64:
        k = _tile(128, min(hidden, inner))
        return MoeBlocks(16, _tile(32, inner), _tile(64, hidden), k, 4, 3)
    return MoeBlocks(64, _tile(64, inner), _tile(128, hidden), _tile(64, min(hidden, inner)), 4, 3)


def fused_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    blocks: MoeBlocks | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j].

    x [T, H]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]; weights [T, k] in x's
    dtype; ids [T, k] int64 -> [T, H] in x's dtype."""
    tokens, hidden = x.shape
    num_experts, two_inner, _ = gate_up.shape
    inner = two_inner // 2
    top_k = ids.shape[1]
    assert gate_up.is_contiguous() and down.is_contiguous() and down.shape[1:] == (hidden, inner)
    x = x.contiguous()
    blocks = blocks or choose_blocks(tokens, hidden, inner)
    aligned = align_pairs(ids, num_experts, blocks.block_m)
    pairs = aligned.pairs
    num_blocks = aligned.block_expert.shape[0]
    ieee = x.dtype == torch.float32
    act = torch.empty(pairs, inner, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inner, blocks.gate_up_n))](
        x, gate_up, act, aligned.sorted_pairs, aligned.block_expert, pairs, num_experts,
        TOP_K=top_k, HIDDEN=hidden, INNER=inner, BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.gate_up_n, BLOCK_K=blocks.block_k, EVEN_K=hidden % blocks.block_k == 0,
        EVEN_N=inner % blocks.gate_up_n == 0, IEEE=ieee,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    route = weights.reshape(-1).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, blocks.down_n))](
        act, down, route, out, aligned.sorted_pairs, aligned.block_expert, pairs, num_experts,
        HIDDEN=hidden, INNER=inner, BLOCK_M=blocks.block_m, BLOCK_N=blocks.down_n,
        BLOCK_K=blocks.block_k, EVEN_K=inner % blocks.block_k == 0,
        EVEN_N=hidden % blocks.down_n == 0, IEEE=ieee,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    return out.view(tokens, top_k, hidden).float().sum(dim=1).to(x.dtype)
