"""The Triton kernel of `worker.device.kernels.batched_sampling.sample_rows` (see its module
doc for the algorithm): one program per row, a few passes over the row's logits, no sort."""

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
def sample_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, counter_ptr,
    out_ptr, vocab, BLOCK: tl.constexpr, MAX_TRIES: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    temperature = tl.load(temp_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    sampling = (temperature > 0.0) & (top_k != 1)
    inv_t = 1.0 / tl.where(sampling, temperature, 1.0)
    offs = tl.arange(0, BLOCK)
    zero_f = tl.full((), 0.0, tl.float32)
    zero_i = tl.full((), 0, tl.int32)
    # pass 1: max, argmax, min and the normaliser of the whole row (online)
    top = zero_f - float("inf")
    low = zero_f + float("inf")
    arg = zero_i
    total_all = zero_f
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        valid = idx < vocab
        s = tl.load(base + idx, mask=valid, other=-float("inf")).to(tl.float32) * inv_t
        block_top = tl.max(s, 0)
        block_arg = tl.argmax(s, 0).to(tl.int32)
        arg = tl.where(block_top > top, start + block_arg, arg)
        new_top = tl.maximum(top, block_top)
        total_all = total_all * tl.exp(top - new_top) + tl.sum(tl.exp(s - new_top), 0)
        top = new_top
        low = tl.minimum(low, tl.min(tl.where(valid, s, float("inf")), 0))
    picked = arg
    if sampling:
        floor = tl.where(min_p > 0.0, top + tl.log(tl.maximum(min_p, 1e-30)), -float("inf"))
        if (top_k > 0) & (top_k < vocab):
            # bisection for the k-th largest value: count(s >= lo) >= k > count(s >= hi)
            lo = tl.maximum(floor, low)
            hi = top + 1.0
            count = top_k + 1  # unknown: != top_k
            tries = zero_i
            while (count != top_k) & (tries < 64):
                mid = lo + (hi - lo) * 0.5
                count = top_k * 0
                for start in range(0, vocab, BLOCK):
                    idx = start + offs
                    s = tl.load(base + idx, mask=idx < vocab, other=-float("inf"))
                    count += tl.sum((s.to(tl.float32) * inv_t >= mid).to(tl.int32), 0)
                stuck = (mid <= lo) | (mid >= hi)  # no float between lo and hi
                lo = tl.where(count >= top_k, mid, lo)
                hi = tl.where(count >= top_k, hi, mid)
                tries = tl.where(stuck, 64, tries + 1)
            floor = tl.maximum(floor, lo)
        total = total_all
        if floor > -float("inf"):
            total = zero_f
            for start in range(0, vocab, BLOCK):
                idx = start + offs
                s = tl.load(base + idx, mask=idx < vocab, other=-float("inf"))
                s = s.to(tl.float32) * inv_t
                total += tl.sum(tl.where(s >= floor, tl.exp(s - top), 0.0), 0)
        key = row_key(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
        above_of = zero_f - float("inf")  # candidates: s >= floor and s > above_of
        mass = total  # their mass
        attempt = zero_i
        searching = zero_i + 1
        token = arg
        while searching > 0:
            bits = mix32(key ^ attempt.to(tl.uint32))
            target = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0) * mass
            carry = zero_f
            token = zero_i - 1
            last = arg
            start = zero_i
            while (start < vocab) & (token < 0):
                idx = start + offs
                s = tl.load(base + idx, mask=idx < vocab, other=-float("inf"))
                s = s.to(tl.float32) * inv_t
                keep = (s >= floor) & (s > above_of)
                w = tl.where(keep, tl.exp(s - top), 0.0)
                running = tl.cumsum(w, 0) + carry
                reached = tl.sum((running >= target).to(tl.int32), 0)
                token = tl.where(reached > 0, start + BLOCK - reached, token)
                last = tl.maximum(last, tl.max(tl.where(keep, idx, -1), 0))
                carry += tl.sum(w, 0)
                start += BLOCK
            token = tl.where(token < 0, last, token)  # rounding: u * Z past the sum
            searching = zero_i
            if top_p < 1.0:
                s_token = tl.load(base + token).to(tl.float32) * inv_t
                above = zero_f
                for start2 in range(0, vocab, BLOCK):
                    idx = start2 + offs
                    s = tl.load(base + idx, mask=idx < vocab, other=-float("inf"))
                    s = s.to(tl.float32) * inv_t
                    above += tl.sum(tl.where((s >= floor) & (s > s_token),
                                             tl.exp(s - top), 0.0), 0)  # fmt: skip
                accepted = above < top_p * total
                above_of = s_token
                mass = above
                attempt += 1
                token = tl.where(accepted | (attempt < MAX_TRIES), token, arg)
                searching = tl.where(accepted | (attempt >= MAX_TRIES), 0, 1)
        picked = token
    tl.store(out_ptr + row, picked.to(tl.int64))
