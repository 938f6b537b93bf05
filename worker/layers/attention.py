"""Attention over the KV cache for one flattened step (see worker/models/step.py).

``AttentionPlan`` is built once per forward from the StepInput: token ranges, the decode group
(sequences adding one token: one batched SDPA call per layer) and the prefill sequences (one SDPA
call each). Masks depend only on the plan and the layer geometry (full, or ring size + window),
so each is built once per forward and shared by all layers of that geometry.

Mask convention: bool, True = may attend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from worker.device import cpu_gemv
from worker.device.kernels.attention import use_triton
from worker.layers.kv import LayerCache, as_cache, index_copy, round_to_cache
from worker.models.step import StepInput


@dataclass(frozen=True)
class SeqView:
    start: int  # first row of this sequence in the flattened step
    slot: int
    cached: int  # tokens already in the slot
    new: int  # tokens added by this step

    @property
    def end(self) -> int:
        return self.start + self.new


@dataclass
class AttentionPlan:
    device: torch.device
    prefill: list[SeqView]  # sequences with new > 1, or a fresh single token
    decode: list[SeqView]  # sequences with new == 1 and cached > 0
    last_rows: torch.Tensor  # [B] row of each sequence's last new token (StepInput order)
    decode_rows: torch.Tensor | None = None  # [Bd] rows of the decode group
    decode_slots: torch.Tensor | None = None  # [Bd]
    decode_pos: torch.Tensor | None = None  # [Bd] position of the new token (== cached)
    decode_slot_range: slice | None = None  # the decode slots when they are consecutive
    decode_max_pos: int = -1
    _masks: dict[tuple[object, ...], Any] = field(default_factory=dict)

    @staticmethod
    def build(step: StepInput, device: torch.device) -> AttentionPlan:
        n = len(step.slots)
        if not (len(step.cached_lens) == len(step.new_lens) == n):
            raise ValueError("slots, cached_lens and new_lens must have the same length")
        if sum(step.new_lens) != step.input_ids.shape[0]:
            raise ValueError(
                f"sum(new_lens)={sum(step.new_lens)} != {step.input_ids.shape[0]} input ids"
            )
        if len(set(step.slots)) != n:
            raise ValueError(f"a slot appears twice in one step: {step.slots}")
        prefill: list[SeqView] = []
        decode: list[SeqView] = []
        last_rows: list[int] = []
        start = 0
        for slot, cached, new in zip(step.slots, step.cached_lens, step.new_lens, strict=True):
            if new < 1 or cached < 0:
                raise ValueError(f"bad sequence: cached_len={cached}, new_len={new}")
            view = SeqView(start, slot, cached, new)
            (decode if new == 1 and cached > 0 else prefill).append(view)
            start += new
            last_rows.append(start - 1)
        plan = AttentionPlan(
            device=device,
            prefill=prefill,
            decode=decode,
            last_rows=torch.tensor(last_rows, dtype=torch.int64, device=device),
        )
        if decode:
            plan.decode_rows = torch.tensor([s.start for s in decode], device=device)
            plan.decode_slots = torch.tensor([s.slot for s in decode], device=device)
            plan.decode_pos = torch.tensor([s.cached for s in decode], device=device)
            plan.decode_max_pos = max(s.cached for s in decode)
            first = decode[0].slot
            if [s.slot for s in decode] == list(range(first, first + len(decode))):
                plan.decode_slot_range = slice(first, first + len(decode))
        return plan

    # -- masks (memoized per geometry) ---------------------------------------------------------

    def prefill_mask(self, i: int, cache: LayerCache) -> torch.Tensor | None:
        """Mask of prefill sequence i for this layer geometry; None means plain causal."""
        key = ("prefill", i, cache.capacity, cache.window)
        if key not in self._masks:
            self._masks[key] = self._prefill_mask(self.prefill[i], cache)
        return self._masks[key]

    def _prefill_mask(self, seq: SeqView, cache: LayerCache) -> torch.Tensor | None:
        c, n, dev = seq.cached, seq.new, self.device
        q_pos = torch.arange(c, c + n, device=dev)[:, None]  # [n, 1]
        if cache.window is None:
            if c == 0:
                return None  # keys are exactly the new tokens: is_causal
            k_pos = torch.arange(c + n, device=dev)[None, :]  # [1, c + n]
            return k_pos <= q_pos  # [n, c + n]
        window = cache.window
        new_pos = torch.arange(c, c + n, device=dev)[None, :]  # [1, n]
        new_part = (new_pos <= q_pos) & (new_pos > q_pos - window)  # [n, n]
        if c == 0:
            return new_part
        ring_pos = ring_positions(c, cache.capacity, dev)[None, :]  # [1, R]
        ring_part = (ring_pos >= 0) & (ring_pos > q_pos - window)  # [n, R]
        return torch.cat([ring_part, new_part], dim=1)  # [n, R + n]

    def ring_tables(self, i: int, ring: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(positions the ring holds before this step as int32, or None when it is empty;
        ring indices the last min(n, R) new tokens go to) of prefill sequence i (memoized)."""
        key = ("ring", i, ring)
        if key not in self._masks:
            seq = self.prefill[i]
            c, n = seq.cached, seq.new
            held = ring_positions(c, ring, self.device).to(torch.int32) if c else None
            kept = min(n, ring)
            index = torch.arange(c + n - kept, c + n, device=self.device) % ring  # [kept]
            self._masks[key] = (held, index)
        return self._masks[key]  # type: ignore[no-any-return]

    def decode_mask(self, cache: LayerCache) -> torch.Tensor:
        """[Bd, 1, 1, L] mask of the decode group, after its new keys were written."""
        key = ("decode", cache.capacity, cache.window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_pos is not None
            q_pos = self.decode_pos[:, None]  # [Bd, 1]
            length = self.decode_max_pos + 1
            if cache.window is None or length <= cache.capacity:
                # a full layer, or a ring not yet wrapped: index == position, and nothing
                # past the furthest row's new token is read (not the whole ring)
                k_pos = torch.arange(length, device=self.device)[None, :]  # [1, L]
                mask = k_pos <= q_pos  # [Bd, L]
                if cache.window is not None:
                    mask = mask & (k_pos > q_pos - cache.window)
            else:
                ring = cache.capacity
                idx = torch.arange(ring, device=self.device)[None, :]  # [1, R]
                oldest = q_pos + 1 - ring  # [Bd, 1] oldest position the ring can hold
                k_pos = oldest + (idx - oldest) % ring  # [Bd, R] position held at each index
                mask = (k_pos >= 0) & (k_pos > q_pos - cache.window)
            mask = mask[:, None, None, :]
            self._masks[key] = mask
        return mask


def ring_positions(cached: int, ring: int, device: torch.device) -> torch.Tensor:
    """[R] position held at each ring index when ``cached`` tokens were written (< 0: empty).

    Index r holds the unique p in [cached - R, cached) with p % R == r.
    """
    idx = torch.arange(ring, device=device)
    oldest = cached - ring
    return oldest + (idx - oldest) % ring


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Write this step's keys/values into ``cache`` and attend.

    q [T, H, D]; k, v [T, KVH, D] (rotated, normed) -> out [T, H, D].
    A plan object with its own ``attend`` (worker/device/decode_graphs.py's fused decode plan) does
    the work itself, with the same cache layout.
    """
    if not isinstance(plan, AttentionPlan) and hasattr(plan, "attend"):
        return plan.attend(q, k, v, cache, scale)
    out = torch.empty_like(q)
    if plan.decode:
        _decode_group(q, k, v, cache, plan, scale, out)
    for i, seq in enumerate(plan.prefill):
        _prefill_one(q, k, v, cache, plan, i, seq, scale, out)
    return out


def _decode_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    rows, slots, pos = plan.decode_rows, plan.decode_slots, plan.decode_pos
    assert rows is not None and slots is not None and pos is not None
    if cache.window is None and plan.decode_max_pos >= cache.capacity:
        raise ValueError(f"a sequence reached max_context {cache.capacity}")
    on_cpu = q.device.type == "cpu"
    if on_cpu and _cpu_kernel_takes(q, k, v, cache, plan, out):
        for seq_index in range(len(plan.decode)):
            _decode_seq_cpu(q, k, v, cache, plan, seq_index, scale, out)
        return
    if on_cpu and len(plan.decode) == 1:
        _decode_one_sdpa(q, k, v, cache, plan, scale, out)
        return
    # write first: on a ring the overwritten index held position pos - R <= pos - W, unseen
    index = pos if cache.window is None else pos % cache.capacity  # [Bd]
    cache.k[slots, :, index] = as_cache(k[rows], cache.k)  # [Bd, KVH, D]
    cache.v[slots, :, index] = as_cache(v[rows], cache.v)
    mask = plan.decode_mask(cache)  # [Bd, 1, 1, L]
    length = mask.shape[-1]
    if on_cpu:
        # SDPA on the CPU converts a bool one per call
        mask = _additive_decode_mask(plan, cache, q.dtype)
    # consecutive slots are a view; others a gather (a copy of the keys the group reads)
    by = plan.decode_slot_range if plan.decode_slot_range is not None else slots
    keys = cache.k[by, :, :length]  # [Bd, KVH, L, D]
    values = cache.v[by, :, :length]
    query = q[rows][:, :, None, :]  # [Bd, H, 1, D]
    o = _sdpa(query, keys, values, mask, False, scale)  # [Bd, H, 1, D]
    out[rows] = o[:, :, 0, :]


def _seq_range(seq: SeqView, cache: LayerCache) -> tuple[int, int, int, bool]:
    """(cache index of the new token, [first, end) of the cache entries it may see, whether
    those are the whole ring with a mask) of a decoding sequence. The keys are plain index
    ranges: a full layer's prefix, an unwrapped ring's last W entries, or W consecutive
    entries modulo R, which need the ring and a mask only when they wrap around its end."""
    pos, ring = seq.cached, cache.capacity
    if cache.window is None:
        return pos, 0, pos + 1, False  # every position up to the new token
    if pos < ring:  # not wrapped: index == position
        return pos, max(0, pos + 1 - cache.window), pos + 1, False
    first = (pos + 1 - cache.window) % ring
    if first + cache.window > ring:
        return pos % ring, 0, ring, True
    return pos % ring, first, first + cache.window, False


def _cpu_kernel_takes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    plan: AttentionPlan,
    out: torch.Tensor,
) -> bool:
    """The C decode attention takes this step's rows (the same layout for every row)."""
    row = plan.decode[0].start
    return cpu_gemv.can_decode_attention(q[row], k[row], v[row], cache.k, cache.v, out[row])


def _decode_seq_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    plan: AttentionPlan,
    seq_index: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One decoding sequence on the CPU in one C call: its new K/V written into its slot
    (first: on a ring the overwritten index held position pos - R <= pos - W, unseen), then
    its attention over `_seq_range` (~10 µs a layer, where SDPA took ~100-150 µs)."""
    seq = plan.decode[seq_index]
    row = seq.start
    index, first, end, masked = _seq_range(seq, cache)
    mask = _additive_decode_mask(plan, cache, q.dtype)[seq_index, 0, 0] if masked else None
    cpu_gemv.decode_attention(
        q[row], k[row], v[row], cache.k, cache.v, seq.slot, index, first, end, mask, scale,
        out[row],
    )  # fmt: skip


def _decode_one_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    """`_decode_group` for a single decoding sequence on the CPU without the C kernel: plain
    slices (`_seq_range`) and no index tensors."""
    seq = plan.decode[0]
    row, slot = seq.start, seq.slot
    index, first, end, masked = _seq_range(seq, cache)
    mask = _additive_decode_mask(plan, cache, q.dtype) if masked else None  # [1, 1, 1, R]
    cache.k[slot, :, index] = as_cache(k[row], cache.k)  # [KVH, D]
    cache.v[slot, :, index] = as_cache(v[row], cache.v)
    keys = cache.k[slot : slot + 1, :, first:end]  # [1, KVH, L, D]
    values = cache.v[slot : slot + 1, :, first:end]
    query = q[row : row + 1, :, None, :]  # [1, H, 1, D]
    o = _sdpa(query, keys, values, mask, False, scale)  # [1, H, 1, D]
    out[row] = o[0, :, 0, :]


def _additive_decode_mask(
    plan: AttentionPlan, cache: LayerCache, dtype: torch.dtype
) -> torch.Tensor:
    """`plan.decode_mask` as 0 / -inf in the step's dtype (memoized per geometry)."""
    key = ("decode_additive", cache.capacity, cache.window, dtype)
    mask = plan._masks.get(key)
    if mask is None:
        allowed = plan.decode_mask(cache)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, float("-inf"))
        plan._masks[key] = mask
    return mask


def _prefill_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    plan: AttentionPlan,
    i: int,
    seq: SeqView,
    scale: float,
    out: torch.Tensor,
) -> None:
    c, n, s = seq.cached, seq.new, seq.slot
    if use_triton(q) and os.environ.get("TOKENPIPE_NO_TRITON_PREFILL") != "1":
        _prefill_one_triton(q, k, v, cache, plan, i, seq, scale, out)
        return
    # [KVH, n, D] in the cache's dtype (the store copies these bytes), and as attention sees them
    stored_k, new_k = round_to_cache(k[seq.start : seq.end].transpose(0, 1), cache.k)
    stored_v, new_v = round_to_cache(v[seq.start : seq.end].transpose(0, 1), cache.v)
    mask = plan.prefill_mask(i, cache)  # see AttentionPlan._prefill_mask for the shapes
    if cache.window is None:
        _store_full(cache, seq, stored_k, stored_v)
        keys, values = cache.k[s, :, : c + n], cache.v[s, :, : c + n]  # [KVH, c + n, D]
    else:
        if c == 0:
            keys, values = new_k, new_v  # [KVH, n, D]
        else:
            # the ring as it was before this step, then the new keys: [KVH, R + n, D]
            keys = torch.cat([cache.k[s].to(new_k.dtype), new_k], dim=1)
            values = torch.cat([cache.v[s].to(new_v.dtype), new_v], dim=1)
        _store_ring(cache, plan, i, seq, stored_k, stored_v)
    query = q[seq.start : seq.end].transpose(0, 1)[None]  # [1, H, n, D]
    if mask is not None and cache.window is None and q.is_cuda:
        # full layer over a cached prefix: the mask is causal aligned to the bottom right;
        # as a CausalBias the fused (memory-efficient) kernel applies it without [n, c + n]
        from torch.nn.attention.bias import causal_lower_right

        o = _sdpa(query, keys[None], values[None], causal_lower_right(n, c + n), False, scale)
        out[seq.start : seq.end] = o[0].transpose(0, 1)
        return
    o = _sdpa(query, keys[None], values[None], mask, mask is None, scale)
    out[seq.start : seq.end] = o[0].transpose(0, 1)  # [n, H, D]


def _prefill_one_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    plan: AttentionPlan,
    i: int,
    seq: SeqView,
    scale: float,
    out: torch.Tensor,
) -> None:
    """`_prefill_one` with the Triton flash kernel: no mask, no KV-head repeat, no concat.

    The previous keys are read where they live (the slot's prefix, or its ring as it was
    before this step); the new ones straight from the step's projections. The ring's
    positions and write indices are built once per step and ring geometry."""
    from worker.device.kernels.prefill_attention import prefill_attention_triton

    c, s = seq.cached, seq.slot
    rows = slice(seq.start, seq.end)
    # [n, KVH, D] in the cache's dtype (the store copies these bytes), and as attention sees them
    if cache.k.dtype == torch.float8_e4m3fn and q.is_cuda:  # one launch for both, both ways
        from worker.device.kernels import prefill_attention as pa

        # widened to what the kernel's dots take: fp16 over a full layer (a first chunk too,
        # as the prefill graphs take it: session 47 found graphed and eager caches apart)
        wide = torch.float16 if pa._fp16_pays(q, cache.k, cache.window or 0) else q.dtype
        stored_k, stored_v, new_k, new_v = pa.round_kv_to_fp8(k[rows], v[rows], wide)
    else:
        stored_k, new_k = round_to_cache(k[rows], cache.k)
        stored_v, new_v = round_to_cache(v[rows], cache.v)
    k_prev = v_prev = prev_pos = None
    if cache.window is None:
        _store_full(cache, seq, stored_k.transpose(0, 1), stored_v.transpose(0, 1))
        if c:
            k_prev, v_prev = cache.k[s, :, :c], cache.v[s, :, :c]  # [KVH, c, D]
    else:
        prev_pos, _ = plan.ring_tables(i, cache.capacity)
        if c:
            k_prev, v_prev = cache.k[s], cache.v[s]  # [KVH, R, D], read before the writes
    prefill_attention_triton(
        q[rows], new_k, new_v, out[rows], cached=c, sm_scale=scale,
        window=cache.window or 0, k_prev=k_prev, v_prev=v_prev, prev_pos=prev_pos,
    )  # fmt: skip
    if cache.window is not None:
        _store_ring(cache, plan, i, seq, stored_k.transpose(0, 1), stored_v.transpose(0, 1))


def _store_full(cache: LayerCache, seq: SeqView, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
    """Write a prefill's new keys/values [KVH, n, D] at their positions of a full layer."""
    c, n, s = seq.cached, seq.new, seq.slot
    if c + n > cache.capacity:
        raise ValueError(f"slot {s}: {c + n} tokens exceed max_context {cache.capacity}")
    cache.k[s, :, c : c + n] = as_cache(new_k, cache.k)
    cache.v[s, :, c : c + n] = as_cache(new_v, cache.v)
    if cache.capture is not None:  # the shared-prefix cache's copy (worker/layers/kv.py)
        cache.capture.take(cache, s, new_k, new_v)


def _store_ring(
    cache: LayerCache,
    plan: AttentionPlan,
    i: int,
    seq: SeqView,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
) -> None:
    """Keep the last min(n, R) of a prefill's new keys/values [KVH, n, D] in a ring (earlier
    ones are past every later window), at the indices `plan.ring_tables` built."""
    _, index = plan.ring_tables(i, cache.capacity)
    kept = index.shape[0]
    index_copy(cache.k[seq.slot], 1, index, new_k[:, seq.new - kept :])
    index_copy(cache.v[seq.slot], 1, index, new_v[:, seq.new - kept :])
    if cache.capture is not None:  # every new position, the ones the ring drops included
        cache.capture.take(cache, seq.slot, new_k, new_v)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D], mask broadcastable to [B, 1, Lq, Lk] -> [B, H, Lq, D].

    Query head h reads KV head h // (H / KVH). The fused CUDA kernels need equal head counts, so
    a single-query step folds each head group into the query rows (no copy) and longer steps
    expand the KV heads. Keys and values from an fp8 cache widen to q's dtype here.
    """
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    batch, heads, q_len, dim = q.shape
    groups = heads // k.shape[1]
    if groups > 1 and q_len == 1:
        folded = q.view(batch, k.shape[1], groups, dim)  # [B, KVH, G, D]: G rows share a mask row
        o = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
        return o.reshape(batch, heads, 1, dim)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)  # [B, H, Lk, D]
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal and q_len > 1, scale=scale
    )
