"""The Triton kernel of `worker.device.kernels.batched_sampling.sample_rows` (see its module
doc for the algorithm): one program per row, a few passes over the row's logits, no sort of
the row. A full pass accumulates per lane (lane i: the elements i mod BLOCK) and reduces
across threads once at its end; only the draw's scan reduces per block (it must stop at the
token), and it takes a prefix sum only in the block where the target is reached.

Top-k (k <= BUCKETS) by compaction: the first pass also keeps the maximum of each of BUCKETS
disjoint buckets of the row; each is a distinct element, so at least k elements are >= the
k-th largest bucket maximum (`bound`), and the k-th largest value is >= it. One more pass
copies the elements >= bound (the scaled value and the id, in index order) into the row's
candidate slots; when they fit, the k-th value and the draw come from those few registers
(a radix select over the candidates' values, the inverse-CDF scan over the candidates in
index order, the top-p rejection likewise). Otherwise, or for k > BUCKETS, the k-th value is
found by bisection (a counting pass per step, from `bound` up) and the draw scans the row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix32(x):
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def row_key(seed, counter):
    """The per-draw key of `batched_sampling.draw_uniform` (seed, counter: int64 scalars)."""
    h = mix32((seed & 0xFFFFFFFF).to(tl.uint32))
    h = mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = mix32(h ^ (counter & 0xFFFFFFFF).to(tl.uint32))
    return mix32(h ^ ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def draw_target(key, attempt, mass):
    """u * mass for the uniform u of (key, attempt)."""
    bits = mix32(key ^ attempt.to(tl.uint32))
    return ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0) * mass


@triton.jit
def kth_largest(values, k):
    """The k-th largest (1-based) of `values` (a float32 vector; -inf padding counts as values),
    exactly: a radix select, one count per bit of an order-preserving integer key."""
    sign = tl.full((), 0x80000000, tl.uint32)
    bits = values.to(tl.int32, bitcast=True)
    keys = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.uint32, bitcast=True) ^ sign
    found = tl.full((), 0, tl.uint32)  # the largest t with count(keys >= t) >= k, bit by bit
    for bit in tl.static_range(31, -1, -1):
        trial = found | tl.full((), 1 << bit, tl.uint32)
        found = tl.where(tl.sum((keys >= trial).to(tl.int32), 0) >= k, trial, found)
    bits = (found ^ sign).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def load_block(base, idx, vocab):
    """Logits at idx (-inf past the row), as stored."""
    return tl.load(base + idx, mask=idx < vocab, other=-float("inf"))


# Each pass below keeps the next block's load in flight while it works on a block.


@triton.jit
def row_stats(base, vocab, inv_t, BLOCK: tl.constexpr):
    """Pass 1, kept per lane (lane i: the elements i mod BLOCK), so the loop does no work
    across threads: (max, first index of the max, sum of exp(s - max), each lane's max)."""
    offs = tl.arange(0, BLOCK)
    lane_top = tl.full((BLOCK,), -float("inf"), tl.float32)
    lane_arg = tl.zeros((BLOCK,), tl.int32)
    lane_sum = tl.zeros((BLOCK,), tl.float32)  # sum of exp(s - lane_top) over the lane
    ahead = load_block(base, offs, vocab)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        raw = ahead
        ahead = load_block(base, idx + BLOCK, vocab)  # in flight while this block is used
        s = raw.to(tl.float32) * inv_t
        grow = s > lane_top
        finite = s > -float("inf")
        e = tl.where(finite, tl.exp(-tl.abs(tl.where(finite, s, 0.0) - lane_top)), 0.0)
        lane_sum = tl.where(grow, lane_sum * e + 1.0, lane_sum + e)
        lane_arg = tl.where(grow, idx, lane_arg)
        lane_top = tl.maximum(lane_top, s)
    top = tl.max(lane_top, 0)
    arg = tl.min(tl.where(lane_top == top, lane_arg, vocab), 0)
    total = tl.sum(tl.where(lane_top > -float("inf"), lane_sum * tl.exp(lane_top - top), 0.0), 0)
    return top, arg, total, lane_top


@triton.jit
def compact_candidates(
    base, vocab, inv_t, bound, cand_val, cand_id, slots,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Copy the finite scaled values >= bound and their ids into the first `slots` candidate
    slots, in index order. Returns how many there are (may exceed `slots`)."""
    offs = tl.arange(0, BLOCK)
    count = tl.full((), 0, tl.int32)
    ahead = load_block(base, offs, vocab)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        raw = ahead
        ahead = load_block(base, idx + BLOCK, vocab)  # in flight while this block is used
        s = raw.to(tl.float32) * inv_t
        take = (s >= bound) & (s > -float("inf"))
        taken = tl.sum(take.to(tl.int32), 0)
        if taken > 0:
            pos = count + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(cand_val + pos, s, mask=take & (pos < slots))
            tl.store(cand_id + pos, idx, mask=take & (pos < slots))
        count += taken
    tl.debug_barrier()  # the slots are read back by other threads of this program
    return count


@triton.jit
def draw_from_candidates(
    cand_val, cand_id, count, top_k, floor, top, top_p, key, arg,
    SLOTS: tl.constexpr, MAX_TRIES: tl.constexpr,
):  # fmt: skip
    """The draw of the row over its `count` candidates (every element that the top-k filter
    can keep, in index order): the k-th value, min-p floor, inverse CDF, top-p rejection."""
    j = tl.arange(0, SLOTS)
    used = j < count
    v = tl.load(cand_val + j, mask=used, other=-float("inf"))  # [SLOTS] scaled logits
    ids = tl.load(cand_id + j, mask=used, other=0)
    floor = tl.maximum(floor, kth_largest(v, top_k))
    live = used & (v >= floor)  # the candidates of this attempt
    w = tl.where(live, tl.exp(v - top), 0.0)
    total = tl.sum(w, 0)
    mass = total
    attempt = tl.full((), 0, tl.int32)
    searching = attempt + 1
    token = arg
    while searching > 0:
        target = draw_target(key, attempt, mass)
        reached = tl.sum((tl.cumsum(w, 0) >= target).to(tl.int32), 0)
        last = tl.max(tl.where(live, j, -1), 0)
        pick = tl.where(reached > 0, SLOTS - reached, last)  # rounding: u * Z past the sum
        token = tl.sum(tl.where(j == pick, ids, 0), 0)
        searching = attempt * 0
        if top_p < 1.0:
            s_token = tl.max(tl.where(j == pick, v, -float("inf")), 0)
            live = live & (v > s_token)
            w = tl.where(live, w, 0.0)
            above = tl.sum(w, 0)
            accepted = above < top_p * total
            mass = above
            attempt += 1
            token = tl.where(accepted | (attempt < MAX_TRIES), token, arg)
            searching = tl.where(accepted | (attempt >= MAX_TRIES), 0, 1)
    return token


@triton.jit
def mass_above(
    base, vocab, inv_t, floor, above_of, top, BLOCK: tl.constexpr
):  # fmt: skip
    """sum of exp(s - top) over s >= floor and s > above_of (per lane, one reduction)."""
    offs = tl.arange(0, BLOCK)
    lane_mass = tl.zeros((BLOCK,), tl.float32)
    ahead = load_block(base, offs, vocab)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        raw = ahead
        ahead = load_block(base, idx + BLOCK, vocab)  # in flight while this block is used
        s = raw.to(tl.float32) * inv_t
        lane_mass += tl.where((s >= floor) & (s > above_of), tl.exp(s - top), 0.0)
    return tl.sum(lane_mass, 0)


@triton.jit
def count_at_or_above(base, vocab, inv_t, threshold, BLOCK: tl.constexpr):
    """How many s >= threshold (per lane, one reduction)."""
    offs = tl.arange(0, BLOCK)
    lane_count = tl.zeros((BLOCK,), tl.int32)
    ahead = load_block(base, offs, vocab)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        raw = ahead
        ahead = load_block(base, idx + BLOCK, vocab)  # in flight while this block is used
        lane_count += (raw.to(tl.float32) * inv_t >= threshold).to(tl.int32)
    return tl.sum(lane_count, 0)


@triton.jit
def scan_to_target(
    base, vocab, inv_t, floor, above_of, top, target, arg,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """The first token (in index order) among s >= floor, s > above_of at which the running
    sum of exp(s - top) reaches target: a block's prefix sum only in the block that gets there."""
    offs = tl.arange(0, BLOCK)
    carry = tl.full((), 0.0, tl.float32)
    token = tl.full((), -1, tl.int32)
    lane_last = tl.full((BLOCK,), -1, tl.int32)
    start = tl.full((), 0, tl.int32)
    ahead = load_block(base, offs, vocab)
    while (start < vocab) & (token < 0):
        idx = start + offs
        raw = ahead
        ahead = load_block(base, idx + BLOCK, vocab)  # in flight while this block is used
        s = raw.to(tl.float32) * inv_t
        keep = (s >= floor) & (s > above_of)
        w = tl.where(keep, tl.exp(s - top), 0.0)
        lane_last = tl.where(keep, idx, lane_last)
        block_mass = tl.sum(w, 0)
        if carry + block_mass >= target:
            running = tl.cumsum(w, 0) + carry
            first = tl.min(tl.where(keep & (running >= target), idx, vocab), 0)
            token = tl.where(first < vocab, first, -1)
        carry += block_mass
        start += BLOCK
    last = tl.maximum(arg, tl.max(lane_last, 0))  # rounding: u * Z past the sum
    return tl.where(token < 0, last, token)


@triton.jit
def draw_from_row(
    base, vocab, inv_t, floor, top, total_all, top_p, key, arg,
    BLOCK: tl.constexpr, MAX_TRIES: tl.constexpr,
):  # fmt: skip
    """The draw of the row over all its elements s >= floor: inverse CDF, top-p rejection."""
    total = total_all
    if floor > -float("inf"):
        total = mass_above(base, vocab, inv_t, floor, -float("inf"), top, BLOCK)
    above_of = tl.full((), -float("inf"), tl.float32)  # candidates: s >= floor, s > above_of
    mass = total  # their mass
    attempt = tl.full((), 0, tl.int32)
    searching = attempt + 1
    token = arg
    while searching > 0:
        target = draw_target(key, attempt, mass)
        token = scan_to_target(
            base, vocab, inv_t, floor, above_of, top, target, arg, BLOCK
        )  # fmt: skip
        searching = attempt * 0
        if top_p < 1.0:
            s_token = tl.load(base + token).to(tl.float32) * inv_t
            above = mass_above(base, vocab, inv_t, floor, s_token, top, BLOCK)
            accepted = above < top_p * total
            above_of = s_token
            mass = above
            attempt += 1
            token = tl.where(accepted | (attempt < MAX_TRIES), token, arg)
            searching = tl.where(accepted | (attempt >= MAX_TRIES), 0, 1)
    return token


@triton.jit
def sample_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, counter_ptr,
    out_ptr, cand_val_ptr, cand_id_ptr, slots, vocab,
    BLOCK: tl.constexpr, BUCKETS: tl.constexpr, SLOTS: tl.constexpr, MAX_TRIES: tl.constexpr,
):  # fmt: skip
    """cand_val / cand_id: [rows, SLOTS] float32 / int32 scratch, of which the first `slots`
    (<= SLOTS) are used (0: no compaction, top-k always by bisection)."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    cand_val = cand_val_ptr + row.to(tl.int64) * SLOTS
    cand_id = cand_id_ptr + row.to(tl.int64) * SLOTS
    temperature = tl.load(temp_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    sampling = (temperature > 0.0) & (top_k != 1)
    inv_t = 1.0 / tl.where(sampling, temperature, 1.0)
    top, arg, total_all, lane_top = row_stats(base, vocab, inv_t, BLOCK)
    picked = arg
    if sampling:
        floor = tl.where(min_p > 0.0, top + tl.log(tl.maximum(min_p, 1e-30)), -float("inf"))
        count = arg * 0 - 1  # candidates in the slots (-1: none, draw from the row)
        if (top_k > 0) & (top_k < vocab):
            # below top - 104, exp(s - top) is 0 in float32: such s are never drawn
            lo = tl.maximum(floor, top - 104.0)
            if (top_k <= BUCKETS) & (slots > 0):
                bucket_top = tl.max(tl.reshape(lane_top, (BUCKETS, BLOCK // BUCKETS)), 1)
                bound = kth_largest(bucket_top, top_k)
                count = compact_candidates(
                    base, vocab, inv_t, bound, cand_val, cand_id, slots, BLOCK
                )  # fmt: skip
                lo = tl.maximum(lo, bound)
                count = tl.where(count <= slots, count, -1)
            if count < 0:
                # bisection for the k-th largest value: count(s >= lo) >= k > count(s >= hi)
                hi = top + 1.0
                above_lo = top_k + 1  # unknown: != top_k
                tries = arg * 0
                while (above_lo != top_k) & (tries < 64):
                    mid = lo + (hi - lo) * 0.5
                    above_lo = top_k * 0 + count_at_or_above(base, vocab, inv_t, mid, BLOCK)
                    stuck = (mid <= lo) | (mid >= hi)  # no float between lo and hi
                    lo = tl.where(above_lo >= top_k, mid, lo)
                    hi = tl.where(above_lo >= top_k, hi, mid)
                    tries = tl.where(stuck, 64, tries + 1)
                floor = tl.maximum(floor, lo)
        key = row_key(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
        if count >= 0:
            picked = draw_from_candidates(
                cand_val, cand_id, count, top_k, floor, top, top_p, key, arg, SLOTS, MAX_TRIES
            )  # fmt: skip
        else:
            picked = draw_from_row(
                base, vocab, inv_t, floor, top, total_all, top_p, key, arg,
                BLOCK, MAX_TRIES,
            )  # fmt: skip
    tl.store(out_ptr + row, picked.to(tl.int64))
