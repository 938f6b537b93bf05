"""Pure-torch references for the decode kernels (any device; no host sync).

KV pool layout these functions read (one tensor per layer and per K / V):

    cache[slot, kv_head, entry, head_dim]    entry in [0, capacity)

passed as any strided view with that dim order. The entry of absolute position `p` is
`p % capacity`: a full-attention layer has capacity >= the context so `entry == p`; a
ring-buffer (sliding-window) layer has capacity R >= window W and overwrites old entries.
Rope is applied before caching, so the order of entries within the ring does not matter.

`lens[b]` counts the tokens of sequence b that are in the cache, the current decode token
included (the query is at position `lens[b] - 1`). A row with `lens[b] == 0` is padding:
its output is zero and nothing of it is stored.
"""

from __future__ import annotations

import torch

from worker.layers.kv import as_cache


def entry_positions(lens: torch.Tensor, capacity: int) -> torch.Tensor:
    """Absolute position held by each cache entry, or a negative number when empty.

    lens: [B] int64 -> [B, capacity] int64. Entry j holds the latest position p < len
    with p % capacity == j.
    """
    j = torch.arange(capacity, device=lens.device)  # [R]
    last = (lens - 1).unsqueeze(1)  # [B, 1]
    # for j <= last: p = last - (last - j) % R  (>= 0); for j > last: empty
    return torch.where(j <= last, last - torch.remainder(last - j, capacity), -1)


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    *,
    sm_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One query token per sequence over its cached K/V.

    q: [B, Hq, D]; k_cache / v_cache: [S, Hkv, R, D] (Hq % Hkv == 0); slots, lens: [B]
    int64; window: sliding window W (a key at position p is seen by the query at position
    t when t - p < W), 0 = none. Returns [B, Hq, D] in q's dtype; math in float32.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    safe_slots = slots.clamp(min=0)
    k = k_cache[safe_slots].float()  # [B, Hkv, R, D]
    v = v_cache[safe_slots].float()
    qg = q.float().view(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bhrd->bhgr", qg, k) * sm_scale  # [B, Hkv, G, R]
    pos = entry_positions(lens, capacity)  # [B, R]
    valid = pos >= 0
    if window > 0:
        valid &= pos > (lens - 1 - window).unsqueeze(1)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    # rows with no valid entry (padding) would give NaN: softmax over zeros, then zero out
    any_valid = valid.any(dim=1)  # [B]
    scores = torch.where(any_valid[:, None, None, None], scores, 0.0)
    probs = torch.softmax(scores, dim=-1) * any_valid[:, None, None, None]
    out = torch.einsum("bhgr,bhrd->bhgd", probs, v)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def store_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Write one token per sequence into the pool, in place.

    k, v: [B, Hkv, D]; slots, positions: [B] int64. Entry `positions[b] % R` of slot
    `slots[b]` gets row b; rows with a negative slot (padding) write nothing.
    (Boolean selection syncs with the host: this is the CPU / test path.)
    """
    keep = slots >= 0
    slot = slots[keep]
    entry = torch.remainder(positions[keep], k_cache.shape[2])
    k_cache[slot, :, entry] = as_cache(k[keep], k_cache)
    v_cache[slot, :, entry] = as_cache(v[keep], v_cache)


def prefill_attention_slot_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: torch.Tensor,
    *,
    sm_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """`worker.device.kernels.prefill_attention.prefill_attention_slot` in torch (reads `meta` on
    the host: not capturable). q [N, Hq, D]; k_new, v_new [N, Hkv, D] with rows >= n padding;
    the pool [S, Hkv, R, D] as it was before the step; meta (slot, cached, n) -> [N, Hq, D],
    padding rows zero."""
    slot, cached, n = (int(x) for x in meta.tolist())
    capacity = k_cache.shape[2]
    prev_len = min(cached, capacity)
    held = entry_positions(torch.tensor([cached], device=q.device), capacity)[0, :prev_len]
    k_pos = torch.cat([held, torch.arange(cached, cached + n, device=q.device)])  # [P + n]
    keys = torch.cat([k_cache[slot, :, :prev_len].transpose(0, 1).float(), k_new[:n].float()])
    values = torch.cat([v_cache[slot, :, :prev_len].transpose(0, 1).float(), v_new[:n].float()])
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [P + n, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    q_pos = torch.arange(cached, cached + n, device=q.device)[:, None]  # [n, 1]
    allowed = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos)
    if window > 0:
        allowed &= k_pos[None, :] > q_pos - window
    scores = torch.einsum("nhd,khd->hnk", q[:n].float(), keys) * sm_scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.zeros_like(q)
    out[:n] = torch.einsum("hnk,khd->nhd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out
