"""Triton decode attention over the preallocated KV pool ("flash decoding").

One query token per sequence: q [B, Hq, D]. K/V are read in place from the pool
(`cache[slot, kv_head, entry, head_dim]`, see `reference.py` for the entry/position rule)
through `slots` and `lens`, with no gather copy. GQA: one program serves the G = Hq / Hkv
query heads that share a KV head, so each K/V tile is loaded once for the whole group.

Two launches with static shapes (capturable in a CUDA graph):
1. split: grid (B, Hkv, num_splits); program s takes the s-th of `num_splits` equal
   chunks of the min(len, R) valid entries and writes its normalised partial output and
   log-sum-exp;
2. combine: grid (B, Hq) merges the splits.
`num_splits` is fixed per launch (chosen from the static batch and capacity by
`choose_num_splits`; a run-time argument, so no recompiles); the chunk length follows each
row's own `len` at run time, so short and long sequences in one batch share the launch.
Padded rows (slot < 0 or len == 0) get a zero output.

This module imports Triton: import it only after `worker.device.kernels.triton_available()`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from worker.device.kernels import dependent_launch, dependent_small
from worker.device.kernels.rmsnorm import dependent_start, to_cache


@triton.jit
def _attend_block(
    q, k_base, v_base, block_start, end, last, m_i, l_i, acc,
    stride_kr, stride_vr, sm_scale, capacity, window,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over entries [block_start, block_start + BLOCK_N) ∩ [.., end).
    q: [BLOCK_G, D]; m_i, l_i: [BLOCK_G]; acc: [BLOCK_G, D] float32."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = block_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    k = tl.load(
        k_base + offs_n[:, None] * stride_kr + offs_d[None, :],
        mask=mask_n[:, None],
        other=0.0,
    )  # [BLOCK_N, D]
    # V's load is issued with K's, ahead of the scores (the configs below were timed so)
    v = tl.load(
        v_base + offs_n[:, None] * stride_vr + offs_d[None, :],
        mask=mask_n[:, None],
        other=0.0,
    )  # [BLOCK_N, D]
    if INTERPRET:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:  # an fp8 cache widens to q's dtype (a no-op for the model's own)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    # scores: [BLOCK_G, BLOCK_N]
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
    # entry j < n_valid holds position last - (last - j) % R  (last - j >= 0 here)
    pos = last - ((last - offs_n) % capacity)
    valid = mask_n & ((window <= 0) | (pos > last - window))
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kr,
    stride_vs, stride_vh, stride_vr,
    sm_scale, capacity, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False,
    out_ptr=None, stride_ob=0, stride_oh=0, DIRECT: tl.constexpr = False,
):  # fmt: skip
    """One split of a (row, KV head)'s positions: its normalised partial output and log-sum-
    exp for `_decode_combine_kernel`; DIRECT (one split): the output itself, in out's dtype
    (what the combine would make of one split: the same values), and no combine kernel."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    q_heads = tl.num_programs(1) * GROUP

    # the step's lengths and slots come from its start, not from the kernel before (which
    # writes q and this token's K/V): loaded before the wait, off the K loads' critical path
    length = tl.load(lens_ptr + row).to(tl.int32)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    dependent_start(WAIT, TRIGGER)
    length = tl.where(slot < 0, 0, length)
    n_valid = tl.minimum(length, capacity)
    per_split = (n_valid + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n_valid)
    last = length - 1  # position of the query token

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]
    q = tl.load(
        q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None],
        other=0.0,
    )  # [BLOCK_G, D]
    safe_slot = tl.maximum(slot, 0)
    k_base = k_ptr + safe_slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + safe_slot * stride_vs + kv_head * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    if INTERPRET:  # Triton's CPU interpreter: no tensor bounds in range(), no bf16 dot
        block_start = start
        while block_start < end:
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, block_start, end, last, m_i, l_i, acc,
                stride_kr, stride_vr, sm_scale, capacity, window,
                HEAD_DIM, BLOCK_N, DOT_PRECISION, INTERPRET,
            )  # fmt: skip
            block_start += BLOCK_N
    else:
        for block_start in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, block_start, end, last, m_i, l_i, acc,
                stride_kr, stride_vr, sm_scale, capacity, window,
                HEAD_DIM, BLOCK_N, DOT_PRECISION, INTERPRET,
            )  # fmt: skip

    has_any = l_i > 0.0
    out = tl.where(has_any[:, None], acc / tl.where(has_any, l_i, 1.0)[:, None], 0.0)
    if DIRECT:
        dest = out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        lse = tl.where(has_any, m_i + tl.log(tl.where(has_any, l_i, 1.0)), float("-inf"))
        # part_out: [B, Hq, num_splits, D] float32 contiguous; part_lse: [B, Hq, num_splits]
        base = (row * q_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=mask_g[:, None])  # fmt: skip
        tl.store(part_lse_ptr + base, lse, mask=mask_g)


@triton.jit
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, TRIGGER: tl.constexpr = False,
    WAIT: tl.constexpr = False,
):  # fmt: skip
    dependent_start(WAIT, TRIGGER)  # TRIGGER: the o_proj GEMV may start loading its weights
    row = tl.program_id(0)
    head = tl.program_id(1)
    q_heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < num_splits
    base = (row * q_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None],
        other=0.0,
    )  # [BLOCK_S, D]
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # empty splits: exp(-inf) = 0
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + row * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty)
    )


# one split per (row, KV head) (the 31B sliding layers from 17 rows up on an H200): the split
# kernel writes the output and no combine kernel runs; TOKENPIPE_ATTN_ONE_SPLIT_DIRECT=0: the
# combine runs for one split too
ONE_SPLIT_DIRECT = os.environ.get("TOKENPIPE_ATTN_ONE_SPLIT_DIRECT", "1") != "0"


def choose_num_splits(batch: int, kv_heads: int, capacity: int, sm_count: int) -> int:
    """Splits per (row, KV head) so the grid has about two programs per SM, each with at
    least 256 entries of work at full capacity (pure: static shapes only). On an H200
    (BENCHMARKS, session 20; 31B int4) 4 or 8 programs an SM lost 1% at 32 sessions, and 128
    / 512 / 1,040 entries 8.5% / 0.5% / 0.5% at batch 1."""
    programs = batch * kv_heads
    want = max(1, -(-2 * sm_count // programs))
    most = max(1, capacity // 256)
    return int(min(want, most, 64))


def _split_config(head_dim: int, batch: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel for a head size and batch (static
    shapes only: a graph's rows may be at any length). On an H200 (BENCHMARKS, session 21;
    31B int4 through `tokenpipe run`) against (32, 4, 2) for 256 and (32, 8, 2) for 512:
    900-token prompts decode 3% faster at 1 session and 5% at 32; 32-token prompts at 32
    sessions 1.3% slower (every config tried off (32, 4, 2) lost 1.2-1.9% there, which the
    kernel alone does not show). Kernel alone at 1 and 32 rows, ~90 / 512 / 1,000 entries:
    head size 512 with four warps 9-16% less time everywhere; 256 with more stages 15-33%
    less from ~500 entries up."""
    if head_dim >= 512:
        return 32, 4, 2
    if head_dim >= 256:
        return (16, 4, 3) if batch >= 16 else (32, 4, 4)
    return 64, 4, 2


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    *,
    sm_scale: float,
    window: int = 0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.decode_attention_reference` (same arguments and result).

    q: [B, Hq, D] (last dim contiguous); k_cache / v_cache: [S, Hkv, R, D] views with a
    contiguous last dim; D a power of two >= 16.
    """
    batch, q_heads, head_dim = q.shape
    _, kv_heads, capacity, _ = k_cache.shape
    group = q_heads // kv_heads
    if q_heads % kv_heads or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"unsupported shape: Hq={q_heads}, Hkv={kv_heads}, D={head_dim}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dim")
    if num_splits is None:
        sm_count = (
            torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        )
        num_splits = choose_num_splits(batch, kv_heads, capacity, sm_count)
    out = torch.empty_like(q)
    direct = num_splits == 1 and ONE_SPLIT_DIRECT
    part_out = part_lse = out  # unused when direct
    if not direct:
        part_out = torch.empty(
            (batch, q_heads, num_splits, head_dim), device=q.device, dtype=torch.float32
        )
        part_lse = torch.empty((batch, q_heads, num_splits), device=q.device, dtype=torch.float32)
    block_g = max(16, triton.next_power_of_2(group))
    block_n, num_warps, num_stages = _split_config(head_dim, batch)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, slots, lens, part_out, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        float(sm_scale), capacity, window,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRET=bool(triton.knobs.runtime.interpret),
        TRIGGER=dependent_launch(q.device), WAIT=dependent_small(q.device),
        out_ptr=out, stride_ob=out.stride(0), stride_oh=out.stride(1), DIRECT=direct,
        launch_pdl=dependent_small(q.device), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if direct:
        return out
    _decode_combine_kernel[(batch, q_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        TRIGGER=dependent_launch(out.device), WAIT=dependent_small(out.device),
        launch_pdl=dependent_small(out.device), num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, positions_ptr,
    stride_kb, stride_kh, stride_vb, stride_vh,
    stride_ks, stride_kc_h, stride_kr,
    stride_vs, stride_vc_h, stride_vr,
    capacity,
    HEAD_DIM: tl.constexpr, TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False,
):  # fmt: skip
    dependent_start(WAIT, TRIGGER)
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        entry = tl.load(positions_ptr + row).to(tl.int64) % capacity
        offs_d = tl.arange(0, HEAD_DIM)
        k = tl.load(k_ptr + row * stride_kb + head * stride_kh + offs_d)
        v = tl.load(v_ptr + row * stride_vb + head * stride_vh + offs_d)
        k_dst = k_cache_ptr + slot * stride_ks + head * stride_kc_h + entry * stride_kr
        v_dst = v_cache_ptr + slot * stride_vs + head * stride_vc_h + entry * stride_vr
        tl.store(k_dst + offs_d, to_cache(k, k_cache_ptr))
        tl.store(v_dst + offs_d, to_cache(v, v_cache_ptr))


def store_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Triton twin of `reference.store_kv_reference`, with no host sync (rows with a
    negative slot write nothing). k, v: [B, Hkv, D] with a contiguous last dim."""
    batch, kv_heads, head_dim = k.shape
    _store_kv_kernel[(batch, kv_heads)](
        k, v, k_cache, v_cache, slots, positions,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[2], HEAD_DIM=head_dim, TRIGGER=dependent_launch(k.device),
        WAIT=dependent_small(k.device), launch_pdl=dependent_small(k.device),
        num_warps=1 if head_dim <= 256 else 2,
    )  # fmt: skip
