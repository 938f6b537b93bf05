"""Triton prefill attention ("flash attention" forward) for one sequence's new tokens.

The n new tokens of a sequence that already holds `cached` tokens attend to two key sources:

- the previous keys, `k_prev` / `v_prev` [Hkv, P, D] (optional): for a full layer, the
  slot's cached prefix (entry i holds position i); for a sliding layer, the ring as it was
  before this step, with `prev_pos` [P] int32 giving the position each entry holds (< 0:
  empty);
- the new keys, `k_new` / `v_new` [n, Hkv, D], straight from the step's projections; new
  key j holds position `cached + j`.

Query i (position `cached + i`) may attend to key position p when p <= cached + i and, for a
sliding layer with window W, p > cached + i - W. Nothing of size [n, n] is built: the mask is
computed per tile, and tiles wholly outside the causal band are never visited. GQA: query head
h reads KV head h // (Hq / Hkv), in place (no repeat of the KV heads).

Grid: (cdiv(n, BLOCK_M), Hq). Shapes are run-time arguments, so one compile per head size
serves every prompt length.

`prefill_attention_slot` is the same kernel for a step replayed from a CUDA graph
(worker/device/prefill_graphs.py): the slot, the cached length and the number of real rows come from
a device tensor, the previous keys are read from the layer's whole pool, and the ring's
positions are computed from the cached length instead of a table. The query rows are padded to
the graph's size; rows past the real ones are computed over the previous keys only and their
outputs ignored. This module imports Triton: import it only after
`worker.device.kernels.triton_available()`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# a bf16 step over an fp8 cache takes its dots in fp16 (`_fp16_operands`); 0: in bf16
FP16_OVER_FP8 = os.environ.get("TOKENPIPE_PREFILL_FP16", "1") != "0"
PREV_NONE = 0  # no previous keys
PREV_INDEX = 1  # previous entry i holds position i (a full layer's cached prefix)
PREV_TABLE = 2  # previous entry i holds position prev_pos[i] (a ring)
PREV_RING = 3  # a ring of `n_prev` entries after `cached` tokens: entry i holds the latest
# position p < cached with p % n_prev == i (only the slot variant uses it)


@triton.jit
def _tile(
    q, m_i, l_i, acc, q_pos, k_base, v_base, pos_ptr, start, limit, pos_offset, ring,
    stride_kn, stride_vn, qk_scale, window,
    POS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over key entries [start, start + BLOCK_N) ∩ [0, limit).

    q: [BLOCK_M, D]; q_pos, m_i, l_i: [BLOCK_M]; acc: [BLOCK_M, D] float32 (base-2 logits).
    Entry i holds position: POS 0, pos_offset + i; 1, pos_ptr[i]; 2, the latest p < pos_offset
    with p % ring == i (i < limit <= pos_offset, so the modulus is of a non-negative)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_bounds = offs_n < limit
    if POS == 1:
        k_pos = tl.load(pos_ptr + offs_n, mask=in_bounds, other=-1)
    elif POS == 2:
        k_pos = pos_offset - 1 - (pos_offset - 1 - offs_n) % ring
    else:
        k_pos = pos_offset + offs_n
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=in_bounds[:, None],
                other=0.0)  # fmt: skip
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=in_bounds[:, None],
                other=0.0)  # fmt: skip
    if INTERPRET:  # the CPU interpreter has no bf16 dot
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:  # an fp8 cache's entries widen to q's dtype (a no-op for the model's own)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
    allowed = (
        in_bounds[None, :]
        & (k_pos[None, :] >= 0)
        & (k_pos[None, :] <= q_pos[:, None])
        & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))
    )
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# lengths and offsets change with every prompt: not specialised (one compile per head size,
# key mode and dtype, made at start-up by `warm_up` instead of during a request)
@triton.jit(do_not_specialize=["n_new", "n_prev", "cached", "window", "n_rows"])
def _prefill_kernel(
    q_ptr, k_new_ptr, v_new_ptr, k_prev_ptr, v_prev_ptr, prev_pos_ptr, out_ptr, meta_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_pks, stride_pkh, stride_pkn, stride_pvs, stride_pvh, stride_pvn,
    stride_on, stride_oh,
    n_new, n_prev, cached, qk_scale, window, n_rows,
    GROUP: tl.constexpr, PREV: tl.constexpr, META: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    k_prev_base = k_prev_ptr + kv_head * stride_pkh
    v_prev_base = v_prev_ptr + kv_head * stride_pvh
    ring = n_prev
    if META:  # the slot variant: (slot, cached, n_new) from the device; n_prev: pool entries
        # int32 lengths, as the int arguments are; the slot offset keeps the pool's
        # alignment (the strides are multiples of 16), so K/V loads stay vectorised
        slot = tl.load(meta_ptr).to(tl.int64)
        cached = tl.load(meta_ptr + 1).to(tl.int32)
        n_new = tl.load(meta_ptr + 2).to(tl.int32)
        k_prev_base += tl.multiple_of(slot * stride_pks, 16)
        v_prev_base += tl.multiple_of(slot * stride_pvs, 16)
        n_prev = tl.minimum(cached, n_prev)  # a full layer's prefix, or a ring's filled part
    m0 = block * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < n_rows
    q = tl.load(
        q_ptr + offs_m[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None],
        other=0.0,
    )  # [BLOCK_M, D]
    q_pos = cached + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # previous keys: all positions < cached; a sliding window reaches them only from the
    # first `window` queries. With SPLITS > 1, split s takes the s-th of SPLITS equal runs
    # of them (whole tiles), and the last split also takes the new keys.
    p_lo = 0
    p_hi = n_prev
    if SPLITS > 1:
        chunk = (n_prev + SPLITS * BLOCK_N - 1) // (SPLITS * BLOCK_N) * BLOCK_N
        p_lo = split * chunk
        p_hi = tl.minimum(p_lo + chunk, n_prev)
    if PREV != 0:
        if (window <= 0) | (m0 < window):
            prev_offset = cached  # PREV_RING's entries hold positions below it
            if PREV != 3:
                prev_offset = 0
            if INTERPRET:  # the interpreter takes no tensor bounds in range()
                start = p_lo
                while start < p_hi:
                    m_i, l_i, acc = _tile(
                        q, m_i, l_i, acc, q_pos, k_prev_base, v_prev_base, prev_pos_ptr, start,
                        p_hi, prev_offset, ring, stride_pkn, stride_pvn,
                        qk_scale, window, PREV - 1, HEAD_DIM, BLOCK_N, DOT_PRECISION, INTERPRET,
                    )  # fmt: skip
                    start += BLOCK_N
            else:
                for start in range(p_lo, p_hi, BLOCK_N):
                    m_i, l_i, acc = _tile(
                        q, m_i, l_i, acc, q_pos, k_prev_base, v_prev_base, prev_pos_ptr, start,
                        p_hi, prev_offset, ring, stride_pkn, stride_pvn,
                        qk_scale, window, PREV - 1, HEAD_DIM, BLOCK_N, DOT_PRECISION, INTERPRET,
                    )  # fmt: skip

    # new keys: from the start of the band of the block's first query to its last query
    lo = tl.where(window > 0, tl.maximum(m0 - window + 1, 0), 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(m0 + BLOCK_M, n_new)
    if SPLITS > 1:
        hi = tl.where(split == SPLITS - 1, hi, lo)
    k_base = k_new_ptr + kv_head * stride_kh
    v_base = v_new_ptr + kv_head * stride_vh
    if INTERPRET:
        start = lo
        while start < hi:
            m_i, l_i, acc = _tile(
                q, m_i, l_i, acc, q_pos, k_base, v_base, prev_pos_ptr, start, hi,
                cached, ring, stride_kn, stride_vn, qk_scale, window,
                0, HEAD_DIM, BLOCK_N, DOT_PRECISION, INTERPRET,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _tile(
                q, m_i, l_i, acc, q_pos, k_base, v_base, prev_pos_ptr, start, hi,
                cached, ring, stride_kn, stride_vn, qk_scale, window,
                0, HEAD_DIM, BLOCK_N, DOT_PRECISION, INTERPRET,
            )  # fmt: skip

    if SPLITS > 1:  # partial state, merged by _combine_kernel: [SPLITS, rows, heads(, D)]
        part = (split * n_rows + offs_m) * tl.num_programs(1) + head
        tl.store(part_m_ptr + part, m_i, mask=mask_m)
        tl.store(part_l_ptr + part, l_i, mask=mask_m)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=mask_m[:, None])  # fmt: skip
    else:
        # every real query sees at least itself, so l_i > 0 on its row; a padding row (slot
        # variant) may see nothing and is stored as zeros
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + offs_m[:, None] * stride_on + head * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None],
        )


@triton.jit
def _combine_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_on, stride_oh, n_rows,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Merge the SPLITS partial softmax states of one (row, head) into its output."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.load(part_m_ptr + row * heads + head)
    for s in tl.static_range(1, SPLITS):
        m = tl.maximum(m, tl.load(part_m_ptr + (s * n_rows + row) * heads + head))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_sum = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        part = (s * n_rows + row) * heads + head
        weight = tl.math.exp2(tl.load(part_m_ptr + part) - m_safe)  # 0 for an empty split
        l_sum += tl.load(part_l_ptr + part) * weight
        acc += tl.load(part_acc_ptr + part * HEAD_DIM + offs_d) * weight
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)
    out_row = out_ptr + row * stride_on + head * stride_oh
    tl.store(out_row + offs_d, out.to(out_ptr.dtype.element_ty))


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head size. 256 and 512: the fastest of a sweep
# on an H200 (tools/bench_gpu_kernels.py, 31B layer shapes, 2,048 and 8,192 tokens); the
# smaller sizes are untuned.
CONFIGS: dict[int, tuple[int, int, int, int]] = {
    64: (128, 64, 4, 2),
    128: (128, 64, 8, 2),
    256: (128, 64, 8, 2),
    512: (64, 64, 8, 1),
}


def fit_config(
    config: tuple[int, int, int, int], head_dim: int, element_size: int, budget: int = 200 << 10
) -> tuple[int, int, int, int]:
    """Shrink a tile config until its Q tile and pipelined K/V tiles fit `budget` bytes of
    shared memory (fp32 needs twice the bf16 room): fewer stages, then narrower K/V tiles,
    then fewer query rows (pure)."""
    block_m, block_n, num_warps, num_stages = config

    def need() -> int:
        return (block_m + 2 * block_n * num_stages) * head_dim * element_size

    while need() > budget and num_stages > 1:
        num_stages -= 1
    while need() > budget and block_n > 16:
        block_n //= 2
    while need() > budget and block_m > 16:
        block_m //= 2
    return block_m, block_n, num_warps, num_stages


def prefill_attention_triton(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    out: torch.Tensor,
    *,
    cached: int,
    sm_scale: float,
    window: int = 0,
    k_prev: torch.Tensor | None = None,
    v_prev: torch.Tensor | None = None,
    prev_pos: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of one sequence's new tokens; writes and returns `out` [n, Hq, D].

    q: [n, Hq, D]; k_new, v_new: [n, Hkv, D]; k_prev, v_prev: [Hkv, P, D] or None; prev_pos:
    [P] int32 positions of the previous entries, or None when entry i holds position i.
    Every tensor needs a contiguous last dim; D a power of two >= 16.
    """
    _check_shapes(q, k_new, v_new, out, k_prev, v_prev)
    if k_prev is None or v_prev is None or k_prev.shape[1] == 0:
        mode, k_prev, v_prev, n_prev = PREV_NONE, k_new, v_new, 0
        k_prev_strides = v_prev_strides = (0, 0, 0)
    else:
        mode = PREV_INDEX if prev_pos is None else PREV_TABLE
        n_prev = k_prev.shape[1]
        k_prev_strides = (0, k_prev.stride(0), k_prev.stride(1))
        v_prev_strides = (0, v_prev.stride(0), v_prev.stride(1))
    if prev_pos is None:
        prev_pos = k_new  # never read: PREV_TABLE is off
    elif prev_pos.dtype != torch.int32 or prev_pos.numel() != n_prev:
        raise ValueError("prev_pos must be int32 with one entry per previous key")
    n = q.shape[0]
    _launch(
        q, k_new, v_new, k_prev, v_prev, prev_pos, out, prev_pos, k_prev_strides,
        v_prev_strides, n, n_prev, cached, sm_scale, window, mode, False, config,
    )  # fmt: skip
    return out


def prefill_attention_slot(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: torch.Tensor,
    *,
    sm_scale: float,
    window: int = 0,
    config: tuple[int, int, int, int] | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """The slot variant (see the module doc): capturable, no host value read.

    q, out: [N, Hq, D]; k_new, v_new: [N, Hkv, D], rows >= n padding; k_cache, v_cache: the
    layer's pool [S, Hkv, R, D], as it was before this step (a full layer: entry i holds
    position i; a sliding one (`window` > 0): a ring); meta: int64 [3] (slot, cached, n) on
    the device. Writes every row of `out` (padding rows: values to ignore) and returns it.

    A few query rows give few programs (one per query tile and head), each streaming the
    whole prefix. `splits` > 1 cuts the previous keys into that many runs, one program each,
    and merges their softmax states in a second kernel. Default: enough splits to give every
    SM a program (`default_splits`).
    """
    _check_shapes(q, k_new, v_new, out, k_cache[0], v_cache[0])
    if meta.dtype != torch.int64 or meta.numel() != 3:
        raise ValueError("meta must be int64 (slot, cached, n)")
    mode = PREV_RING if window > 0 else PREV_INDEX
    n = q.shape[0]
    _launch(
        q, k_new, v_new, k_cache, v_cache, meta, out, meta, k_cache.stride()[:3],
        v_cache.stride()[:3], n, k_cache.shape[2], 0, sm_scale, window, mode, True, config,
        splits,
    )  # fmt: skip
    return out


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter (tests): some splitting
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def default_splits(programs: int, device: torch.device, most: int = 8) -> int:
    """Splits of the previous keys that bring `programs` (query tiles x heads) up to about
    one per SM, at most `most` (pure but for the device query)."""
    return max(1, min(most, _sm_count(device) // max(programs, 1)))


def _check_shapes(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    out: torch.Tensor,
    k_prev: torch.Tensor | None,
    v_prev: torch.Tensor | None,
) -> None:
    _, q_heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    if q_heads % kv_heads or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"unsupported shape: Hq={q_heads}, Hkv={kv_heads}, D={head_dim}")
    tensors = [q, k_new, v_new, out] + [t for t in (k_prev, v_prev) if t is not None]
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("q, k, v and out need a contiguous last dim")


@triton.jit
def _round_row(src, stored, wide, offs, mask, HEAD_DIM: tl.constexpr):
    """src's [BLOCK] entries at `offs` of a row of [Hkv, D] (src at the row, its head
    stride given through the head-major offsets) rounded into e4m3, saturating at +-448,
    stored as those bytes and widened to `wide`'s type."""
    x = tl.load(src, mask=mask, other=0.0)
    x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    rounded = x.to(tl.float8e4nv)
    tl.store(stored + offs, rounded, mask=mask)
    tl.store(wide + offs, rounded.to(wide.dtype.element_ty), mask=mask)


@triton.jit
def _round_kv_kernel(
    k_ptr, v_ptr, stored_k_ptr, stored_v_ptr, wide_k_ptr, wide_v_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh, row_len,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One token's new keys and values (a row of [Hkv, D], strided) as an fp8 cache holds
    them: `stored_*` the e4m3 bytes a store copies, `wide_*` those values widened, both
    contiguous [n, Hkv, D]. Grid: (n, cdiv(Hkv * D, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_len
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    out = row * row_len + offs
    k_src = k_ptr + row * stride_kn + head * stride_kh + dim
    v_src = v_ptr + row * stride_vn + head * stride_vh + dim
    _round_row(k_src, stored_k_ptr, wide_k_ptr, out, mask, HEAD_DIM)
    _round_row(v_src, stored_v_ptr, wide_v_ptr, out, mask, HEAD_DIM)


def round_kv_to_fp8(
    k: torch.Tensor, v: torch.Tensor, wide_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill's new keys and values [n, Hkv, D] (any strides, a contiguous last dim) as an
    fp8 cache holds them, in one launch: (stored k, stored v) in e4m3, the bytes a store
    copies, and (k, v) those values widened to `wide_dtype` (the step's dtype, or fp16 where
    the dots take fp16 operands: `_fp16_pays`; e4m3 values are exact in both). What
    ``worker.layers.kv.round_to_cache`` gives for each, without its four elementwise passes a
    tensor (the clamp, the rounding, the widening, and the fp16 operands' cast)."""
    n, heads, head_dim = k.shape
    if v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need one shape and a contiguous last dim")
    stored_k = torch.empty(k.shape, dtype=torch.float8_e4m3fn, device=k.device)
    stored_v = torch.empty_like(stored_k)
    wide_k = torch.empty(k.shape, dtype=wide_dtype, device=k.device)
    wide_v = torch.empty_like(wide_k)
    if n == 0:
        return stored_k, stored_v, wide_k, wide_v
    row_len = heads * head_dim
    block = min(triton.next_power_of_2(row_len), 2048)
    _round_kv_kernel[(n, triton.cdiv(row_len, block))](
        k, v, stored_k, stored_v, wide_k, wide_v, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), row_len, HEAD_DIM=head_dim, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return stored_k, stored_v, wide_k, wide_v


def _fp16_operands(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qk_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """A bf16 step's operands for dots in fp16 over an fp8 cache: q scaled first (so a q far
    past fp16's largest value, 65,504, stays in range), the new keys as they are (an fp8
    cache's new keys are rounded to its values, which fp16 holds exactly). Returns (q, k_new,
    v_new, the scale left for the kernel: 1).

    Why: the kernel widens every cached K/V tile to its dots' dtype. e4m3 widens to fp16 in
    one instruction a pair; to bf16 it takes more, and those conversions, not the bytes, made
    an fp8 cache's prefill slower than a bf16 one's (H100, the 31B full layer's 1,024 new
    tokens over 15,360 cached: bf16 5.87 ms, fp8 widened to bf16 6.64, to fp16 5.72 with
    these casts; the widened q made in the kernel instead stays in registers and took 7.20:
    BENCHMARKS.md, session 42). fp16 keeps 3 more mantissa bits than bf16 for q and the
    probabilities. Where it pays: `_fp16_pays`."""
    q16 = torch.empty(q.shape, dtype=torch.float16, device=q.device)
    torch.mul(q, qk_scale, out=q16)  # one pass: the product rounded once, to fp16
    return q16, k_new.to(torch.float16), v_new.to(torch.float16), 1.0


def _fp16_pays(q: torch.Tensor, k_prev: torch.Tensor, window: int) -> bool:
    """Whether a step takes `_fp16_operands`: a bf16 step over an fp8 cache's full layer. The
    casts cost a pass over q; over a full layer's prefix the kernel wins back 13-16% of itself
    (a short prefix loses the pass, under 0.3% of a step), but over a sliding layer's ring (at
    most its window) the casts cost more than the kernel saves: 1,024 new rows over a
    1,024-entry ring took 330 us against 282 (H100, session 42). Not by length: one kernel
    variant a layer kind, the ones the start-up warm-up compiles."""
    if not FP16_OVER_FP8 or q.dtype != torch.bfloat16:
        return False
    # fp16 keys: a first chunk's new keys into an fp8 cache, widened to fp16 already
    # (`round_kv_to_fp8`), so its dots match the prefill graphs' over the same layer
    return k_prev.dtype in (torch.float8_e4m3fn, torch.float16) and window <= 0


def _launch(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_prev: torch.Tensor,
    v_prev: torch.Tensor,
    prev_pos: torch.Tensor,
    out: torch.Tensor,
    meta: torch.Tensor,
    k_prev_strides: tuple[int, ...],
    v_prev_strides: tuple[int, ...],
    n: int,
    n_prev: int,
    cached: int,
    sm_scale: float,
    window: int,
    mode: int,
    slot_meta: bool,
    config: tuple[int, int, int, int] | None,
    splits: int | None = 1,
) -> None:
    q_heads, head_dim = q.shape[1], q.shape[2]
    qk_scale = float(sm_scale) * 1.4426950408889634  # base-2 logits
    if _fp16_pays(q, k_prev, window):
        q, k_new, v_new, qk_scale = _fp16_operands(q, k_new, v_new, qk_scale)
    block_m, block_n, num_warps, num_stages = config or fit_config(
        CONFIGS.get(head_dim, (64, 32, 8, 1)), head_dim, q.element_size()
    )
    blocks = triton.cdiv(n, block_m)
    if splits is None:
        splits = default_splits(blocks * q_heads, q.device)
    part_m = part_l = part_acc = out  # never touched with one split
    if splits > 1:
        # contiguous [splits, n, Hq(, D)] float32: the running max, sum and output of each
        part_acc = torch.empty((splits, n, q_heads, head_dim), dtype=torch.float32,
                               device=q.device)  # fmt: skip
        part_m, part_l = torch.empty((2, splits, n, q_heads), dtype=torch.float32,
                                     device=q.device)  # fmt: skip
    interpret = bool(triton.knobs.runtime.interpret)
    _prefill_kernel[(blocks, q_heads, splits)](
        q, k_new, v_new, k_prev, v_prev, prev_pos, out, meta, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), *k_prev_strides, *v_prev_strides,
        out.stride(0), out.stride(1),
        n, n_prev, cached, qk_scale, window, n,
        GROUP=q_heads // k_new.shape[1], PREV=mode, META=slot_meta, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRET=interpret, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(n, q_heads)](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), n,
            SPLITS=splits, HEAD_DIM=head_dim, num_warps=4,
        )  # fmt: skip
