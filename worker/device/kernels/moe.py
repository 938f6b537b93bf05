"""Fused mixture-of-experts on the GPU: the (token, expert) pairs of a step grouped by expert
and run as one grouped GEMM per matrix, with no host sync (capturable in a CUDA graph).

    plan = align_pairs(ids, num_experts, block_m)      # one launch, static shapes
    hidden = gate_up: silu(x W_g^T) * (x W_u^T)         # one launch, every expert hit
    out = down: (hidden W_d^T) * routing weight         # one launch
    y[t] = sum over t's k pairs of out                  # [T, k, H] -> [T, H]

``align_pairs`` sorts the T * k pairs by expert and pads each expert's run to a multiple of
``block_m`` (vLLM's ``moe_align_block_size``; plain torch here, one Triton launch in
``align_pairs_triton``, which the GPU path uses): row r of the padded order holds a
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

import os
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


@triton.jit(do_not_specialize=["PAIRS", "NUM_BLOCKS"])  # one variant for any prompt length
def _align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, PAIRS, E, NUM_BLOCKS,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """``align_pairs`` in one launch: program e counts every expert's pairs (so it knows
    where its run starts), then writes its own pairs in pair order, its run's padding and its
    blocks' expert; program 0 also marks the unused blocks."""
    e = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, PAIRS, CHUNK):
        idx = start + offs
        expert = tl.load(ids_ptr + idx, mask=idx < PAIRS, other=BINS - 1).to(tl.int32)
        counts += tl.histogram(expert, BINS)
    bins = tl.arange(0, BINS)
    counts = tl.where(bins < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    mine = bins == e
    run_end = tl.sum(tl.where(mine, ends, 0), 0)
    run_len = tl.sum(tl.where(mine, padded, 0), 0)
    count = tl.sum(tl.where(mine, counts, 0), 0)
    run_start = run_end - run_len
    written = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), 0)
    for start in range(0, PAIRS, CHUNK):
        idx = start + offs
        expert = tl.load(ids_ptr + idx, mask=idx < PAIRS, other=-1).to(tl.int32)
        hit = expert == e
        pos = run_start + written + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(sorted_ptr + pos, idx, mask=hit)
        written += tl.sum(hit.to(tl.int32), 0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + run_start + count + pad, PAIRS + pad * 0, mask=count + pad < run_len)
    tail = tl.arange(0, TAIL)
    for b0 in range(0, run_len // BLOCK_M, TAIL):
        block = b0 + tail
        tl.store(block_expert_ptr + run_start // BLOCK_M + block, e + block * 0,
                 mask=block < run_len // BLOCK_M)  # fmt: skip
    if e == 0:
        for b0 in range(tl.sum(padded, 0) // BLOCK_M, NUM_BLOCKS, TAIL):
            block = b0 + tail
            tl.store(block_expert_ptr + block, E + block * 0, mask=block < NUM_BLOCKS)


def align_pairs_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """``align_pairs`` in one kernel launch; rows past the used blocks are left unset (the
    GEMM kernels never read them: their blocks' expert is ``num_experts``)."""
    flat = ids.reshape(-1)
    pairs = flat.shape[0]
    length = padded_length(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(length, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(length // block_m, dtype=torch.int32, device=flat.device)
    _align_kernel[(num_experts,)](
        flat, sorted_pairs, block_expert, pairs, num_experts, length // block_m,
        BLOCK_M=block_m, CHUNK=1024, BINS=1 << num_experts.bit_length(), TAIL=64,
        num_warps=4,
    )  # fmt: skip
    return AlignedPairs(sorted_pairs, block_expert, pairs, block_m)


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, stride_row,
    TOP_K: tl.constexpr, E_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
):  # fmt: skip
    """One token: softmax over the experts (float32), the top k (lowest index on ties),
    renormalised to sum 1, rounded to the weights' dtype."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_BLOCK)
    logit = tl.load(logits_ptr + row * stride_row + offs, mask=offs < E, other=-float("inf"))
    logit = logit.to(tl.float32)
    numer = tl.exp(logit - tl.max(logit, 0))
    probs = numer / tl.sum(numer, 0)
    probs = tl.where(offs < E, probs, -1.0)
    # one max per pick: (the probability's bits, a non-negative float's order as an int) above
    # (E_BLOCK - 1 - index), the lowest index winning a tie; taken experts drop to -1
    key = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (E_BLOCK - 1 - offs)
    slots = tl.arange(0, K_BLOCK)
    picked = tl.zeros([K_BLOCK], dtype=tl.float32)
    picked_ids = tl.zeros([K_BLOCK], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best_key = tl.max(key, 0)
        best_id = E_BLOCK - 1 - (best_key & 0xFFFFFFFF)
        best = (best_key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        picked = tl.where(slots == j, best, picked)
        picked_ids = tl.where(slots == j, best_id, picked_ids)
        key = tl.where(offs == best_id, -1, key)
    picked = picked / tl.sum(picked, 0)
    out = row * TOP_K + slots
    tl.store(weights_ptr + out, picked.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + out, picked_ids, mask=slots < TOP_K)


def route_triton(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (the router's output) -> (weights [T, k] in logits' dtype, ids [T, k]
    int64): ``SparseMoE.route`` after its matmul, in one launch."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
            E_BLOCK=max(16, 1 << (experts - 1).bit_length()),
            K_BLOCK=max(2, 1 << (top_k - 1).bit_length()), num_warps=1,  # shuffles only
        )  # fmt: skip
    return weights, ids


@triton.jit
def _route_align_kernel(
    logits_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, T, E, stride_row,
    NUM_BLOCKS, TOP_K: tl.constexpr, T_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BINS: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """``_route_kernel`` for every token and then ``_align_kernel`` in one launch, for a few
    tokens: program e routes all of them (cheap, and nothing to wait for), program 0 stores
    the weights and ids, and each program places its own expert's pairs."""
    e = tl.program_id(0)
    rows = tl.arange(0, T_BLOCK)
    cols = tl.arange(0, E_BLOCK)
    live = rows < T
    inside = live[:, None] & (cols < E)[None, :]
    logit = tl.load(logits_ptr + rows[:, None] * stride_row + cols[None, :], mask=inside,
                    other=-float("inf")).to(tl.float32)  # fmt: skip
    logit = tl.where(live[:, None], logit, 0.0)  # padding rows: finite, never stored
    numer = tl.exp(logit - tl.max(logit, 1)[:, None])
    probs = numer / tl.sum(numer, 1)[:, None]
    probs = tl.where((cols < E)[None, :], probs, -1.0)
    slots = tl.arange(0, K_BLOCK)
    picked = tl.zeros([T_BLOCK, K_BLOCK], dtype=tl.float32)
    picked_ids = tl.zeros([T_BLOCK, K_BLOCK], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 1)  # [T_BLOCK]
        best_id = tl.min(tl.where(probs == best[:, None], cols[None, :], E_BLOCK), 1)
        picked = tl.where(slots[None, :] == j, best[:, None], picked)
        picked_ids = tl.where(slots[None, :] == j, best_id[:, None], picked_ids)
        probs = tl.where(cols[None, :] == best_id[:, None], -1.0, probs)
    picked = picked / tl.sum(picked, 1)[:, None]
    valid = live[:, None] & (slots < TOP_K)[None, :]
    pair = rows[:, None] * TOP_K + slots[None, :]  # [T_BLOCK, K_BLOCK]
    if e == 0:
        tl.store(weights_ptr + pair, picked.to(weights_ptr.dtype.element_ty), mask=valid)
        tl.store(ids_ptr + pair, picked_ids.to(tl.int64), mask=valid)
    flat_pair = tl.reshape(pair, [T_BLOCK * K_BLOCK])
    expert = tl.reshape(tl.where(valid, picked_ids, BINS - 1), [T_BLOCK * K_BLOCK])
    bins = tl.arange(0, BINS)
    counts = tl.where(bins < E, tl.histogram(expert, BINS), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    mine = bins == e
    run_end = tl.sum(tl.where(mine, ends, 0), 0)
    run_len = tl.sum(tl.where(mine, padded, 0), 0)
    count = tl.sum(tl.where(mine, counts, 0), 0)
    run_start = run_end - run_len
    hit = expert == e
    pos = run_start + tl.cumsum(hit.to(tl.int32), 0) - 1  # pair order within the run
    tl.store(sorted_ptr + pos, flat_pair, mask=hit)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + run_start + count + pad, T * TOP_K + pad * 0,
             mask=count + pad < run_len)  # fmt: skip
    tail = tl.arange(0, TAIL)
    for b0 in range(0, run_len // BLOCK_M, TAIL):
        block = b0 + tail
        tl.store(block_expert_ptr + run_start // BLOCK_M + block, e + block * 0,
                 mask=block < run_len // BLOCK_M)  # fmt: skip
    if e == 0:
        for b0 in range(tl.sum(padded, 0) // BLOCK_M, NUM_BLOCKS, TAIL):
            block = b0 + tail
            tl.store(block_expert_ptr + block, E + block * 0, mask=block < NUM_BLOCKS)


ROUTE_ALIGN_MAX_PAIRS = 128
"""``route_align_triton`` routes every token in every program: up to this many pairs (decode
steps of up to 16 rows at top 8)."""


def route_align_triton(
    logits: torch.Tensor, top_k: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, AlignedPairs]:
    """``route_triton`` then ``align_pairs_triton`` in one launch (at most
    ROUTE_ALIGN_MAX_PAIRS pairs, T * k): logits [T, E] (rows may be strided) -> (weights
    [T, k] in logits' dtype, ids [T, k] int64, their AlignedPairs)."""
    tokens, experts = logits.shape
    assert logits.stride(1) == 1 and tokens * top_k <= ROUTE_ALIGN_MAX_PAIRS
    device = logits.device
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    pairs = tokens * top_k
    length = padded_length(pairs, experts, block_m)
    sorted_pairs = torch.empty(length, dtype=torch.int32, device=device)
    block_expert = torch.empty(length // block_m, dtype=torch.int32, device=device)
    if tokens:
        _route_align_kernel[(experts,)](
            logits, weights, ids, sorted_pairs, block_expert, tokens, experts, logits.stride(0),
            length // block_m, TOP_K=top_k, T_BLOCK=max(2, triton.next_power_of_2(tokens)),
            E_BLOCK=max(16, triton.next_power_of_2(experts)),
            K_BLOCK=max(2, triton.next_power_of_2(top_k)), BLOCK_M=block_m,
            BINS=1 << experts.bit_length(), TAIL=64, num_warps=4,
        )  # fmt: skip
    return weights, ids, AlignedPairs(sorted_pairs, block_expert, pairs, block_m)


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
        acc_gate = _dot(a, w_gate, acc_gate, IEEE)
        acc_up = _dot(a, w_up, acc_up, IEEE)
    _store_gated(acc_gate, acc_up, out_ptr, pair, offs_n, valid, mask_n, INNER, EVEN_N)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b (fp32 inputs exactly with IEEE, else the tensor cores' default)."""
    if IEEE:
        return acc + tl.dot(a, b, input_precision="ieee")
    return acc + tl.dot(a, b)


@triton.jit
def _store_gated(
    acc_gate, acc_up, out_ptr, pair, offs_n, valid, mask_n,
    INNER: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """silu(gate) * up, each rounded to the output dtype as the torch path does, stored at the
    rows of `pair` (the gate/up kernels' epilogue, float and quantized experts alike)."""
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
def _store_routed(
    acc, out_ptr, route_ptr, safe_pair, offs_n, valid, mask_n,
    HIDDEN: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """The down kernels' epilogue: each pair's output times its routing weight, rounded to the
    output dtype as the torch path does."""
    out_ty = out_ptr.dtype.element_ty
    route = tl.load(route_ptr + safe_pair, mask=valid, other=0.0).to(tl.float32)
    out = (acc.to(out_ty).to(tl.float32) * route[:, None]).to(out_ty)
    dst = out_ptr + safe_pair[:, None] * HIDDEN + offs_n[None, :]
    if EVEN_N:
        tl.store(dst, out, mask=valid[:, None])
    else:
        tl.store(dst, out, mask=valid[:, None] & mask_n[None, :])


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
        acc = _dot(a, w, acc, IEEE)
    _store_routed(acc, out_ptr, route_ptr, safe_pair, offs_n, valid, mask_n, HIDDEN, EVEN_N)


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


def choose_blocks(tokens: int, hidden: int, inner: int, quantized: bool = False) -> MoeBlocks:
    """Small steps (decode) want many programs over the weights and little row padding;
    prefill chunks want bigger tiles (pure, but for TOKENPIPE_MOE_QUANT_BLOCKS: six
    comma-separated MoeBlocks fields for quantized experts' steps of <= 64 tokens, the tile
    sweep's choice of tools/bench_qwen3_5_moe_kernels.py)."""
    override = os.environ.get("TOKENPIPE_MOE_QUANT_BLOCKS")
    if quantized and tokens <= 64 and override:
        return MoeBlocks(*(int(v) for v in override.split(",")))
    if tokens <= 64:
        k = _tile(128, min(hidden, inner))
        return MoeBlocks(16, _tile(32, inner), _tile(64, hidden), k, 4, 3)
    return MoeBlocks(64, _tile(64, inner), _tile(128, hidden), _tile(64, min(hidden, inner)), 4, 3)


@triton.jit
def _combine_kernel(
    pairs_ptr, shared_ptr, gate_ptr, residual_ptr, out_ptr, stride_gate, stride_residual, HIDDEN,
    route_ptr, PAIRS, x_ptr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr, ROUTED: tl.constexpr, BLOCK: tl.constexpr,
    GATE_FROM_X: tl.constexpr, GATE_K: tl.constexpr,
):  # fmt: skip
    """out[t] = round(sum_j pairs[t, j]) (+ round(round(sigmoid(gate[t])) * shared[t])), each
    sum rounded; then residual[t] + that, rounded, when given. ROUTED: pairs are fp32 partial
    sums [SPLIT, PAIRS, HIDDEN] not yet routed; pair p is round(round(sum_s) * route[p])
    (``_store_routed``'s rounding; worker.device.kernels.moe_gemv). GATE_FROM_X: gate_ptr is
    the shared expert gate's weight [HIDDEN] and gate[t] = round(x[t] . weight) (fp32 sum),
    x [T, HIDDEN] contiguous, GATE_K a power of two >= HIDDEN."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    out_ty = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        if ROUTED:
            part = tl.zeros([BLOCK], dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                part += tl.load(pairs_ptr + (s * PAIRS + pair) * HIDDEN + offs, mask=mask)
            route = tl.load(route_ptr + pair).to(tl.float32)
            acc += (part.to(out_ty).to(tl.float32) * route).to(out_ty).to(tl.float32)
        else:
            acc += tl.load(pairs_ptr + pair * HIDDEN + offs, mask=mask).to(tl.float32)
    out = acc.to(out_ty).to(tl.float32)
    if HAS_SHARED:
        if GATE_FROM_X:  # the whole row in one load: no loop of dependent round trips
            ks = tl.arange(0, GATE_K)
            in_k = ks < HIDDEN
            xk = tl.load(x_ptr + token * HIDDEN + ks, mask=in_k, other=0.0).to(tl.float32)
            wk = tl.load(gate_ptr + ks, mask=in_k, other=0.0).to(tl.float32)
            logit = tl.sum(xk * wk, 0).to(out_ty).to(tl.float32)
        else:
            logit = tl.load(gate_ptr + token * stride_gate).to(tl.float32)
        scale = (1.0 / (1.0 + tl.exp(-logit))).to(out_ty).to(tl.float32)
        shared = tl.load(shared_ptr + token * HIDDEN + offs, mask=mask).to(tl.float32)
        out += (scale * shared).to(out_ty).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + token * stride_residual + offs, mask=mask).to(tl.float32)
        out = res + out.to(out_ty).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + offs, out.to(out_ty), mask=mask)


def fused_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    blocks: MoeBlocks | None = None,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    aligned: AlignedPairs | None = None,
    shared_gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j], plus
    sigmoid(shared_gate[t]) * shared[t] when given (the shared expert, added in the same
    launch that sums the k pairs), plus residual[t] when given (the decoder layer's sum).

    x [T, H]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]; weights [T, k] in x's
    dtype; ids [T, k] int64; shared [T, H], shared_gate [T, 1] (or ``shared_gate_weight``
    [1, H]: the logits x @ weight^T computed in the combine), residual [T, H] -> [T, H] in
    x's dtype. ``aligned``: the pairs already aligned (``route_align_triton``) for
    ``blocks.block_m``."""
    tokens, hidden = x.shape
    num_experts, two_inner, _ = gate_up.shape
    inner = two_inner // 2
    top_k = ids.shape[1]
    assert gate_up.is_contiguous() and down.is_contiguous() and down.shape[1:] == (hidden, inner)
    x = x.contiguous()
    blocks = blocks or choose_blocks(tokens, hidden, inner)
    if aligned is None:
        aligned = align_pairs_triton(ids, num_experts, blocks.block_m)
    assert aligned.block_m == blocks.block_m
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
    return combine_pairs(out, tokens, top_k, shared, shared_gate, residual, x, shared_gate_weight)


def combine_pairs(
    out: torch.Tensor,
    tokens: int,
    top_k: int,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
    route: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T * k, H] (the down GEMM's weighted pairs; or with ``route`` [T * k], fp32
    partial sums [split, T * k, H] not yet weighted) -> [T, H]: each token's k pairs summed,
    plus sigmoid(gate[t]) * shared[t] when given, plus residual[t] when given; one launch.
    gate: the logits ``shared_gate`` [T, 1], or x [T, H] times ``shared_gate_weight`` [1, H]
    (the shared expert gate's matmul in the same launch)."""
    hidden = out.shape[-1]
    dtype = x.dtype if x is not None else out.dtype
    result = torch.empty(tokens, hidden, dtype=dtype, device=out.device)
    gate_from_x = shared_gate_weight is not None and x is not None
    has_shared = shared is not None and (shared_gate is not None or gate_from_x)
    gate = shared_gate_weight if gate_from_x else shared_gate
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    if tokens:
        _combine_kernel[(tokens, triton.cdiv(hidden, 256))](
            out, shared.contiguous() if has_shared else out,  # type: ignore[union-attr]
            gate if has_shared else out, residual if residual is not None else out,
            result, gate.stride(0) if has_shared and not gate_from_x else 0,  # type: ignore[union-attr]
            residual.stride(0) if residual is not None else 0, hidden,
            route if route is not None else out, out.shape[-2],
            x.contiguous() if gate_from_x else out,  # type: ignore[union-attr]
            TOP_K=top_k, HAS_SHARED=has_shared, HAS_RESIDUAL=residual is not None,
            SPLIT=out.shape[0] if route is not None else 1, ROUTED=route is not None,
            BLOCK=256, GATE_FROM_X=gate_from_x, GATE_K=triton.next_power_of_2(hidden),
            num_warps=2,
        )  # fmt: skip
    return result
