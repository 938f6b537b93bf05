"""The KV cache: per-slot tensors preallocated once, one pair per decoder layer.

Full-attention layers keep every position: k, v [slots, kv_heads, max_context, head_dim], position
p at index p.

Sliding-window layers (window W: a query at position q sees keys in (q - W, q]) keep a ring of
R = min(W + ring_slack, max_context) entries: k, v [slots, kv_heads, R, head_dim], position p at
index p % R. With N tokens cached, the ring holds positions [N - R, N) (those >= 0); a query needs
at most the W - 1 positions before it, so R >= W always suffices. The slack lets a resume drop a
few tokens (see ``keepable_prefix``).

Linear (Gated DeltaNet) layers keep no KV here: a zero-capacity entry keeps the layer indices;
their state lives in ``worker.layers.hybrid_cache.HybridCache``.

With the shared-prefix cache on (worker/engine/prefix_cache.py), every attention layer also
has a pool of rows, one position each ([kv_heads, rows, head_dim]), that blocks of prompts are
copied to and from (``slot_to_pool``, ``pool_to_slot``, and ``PoolCapture`` during a prefill).

K=V layers (gemma4 full layers, no v_proj) still store K and V separately: K is the k-normed,
rotated projection and V the weightless-normed, unrotated one, so the cached tensors differ.

The cache's dtype is the model's, or fp8 (e4m3, no scale: ``--kv-cache-dtype fp8``), which
halves a token's bytes. Writes round into it (``as_cache``: saturating at +-448, the format's
largest finite value); reads widen to the step's dtype (worker/layers/attention.py, the Triton
kernels). With no scale the format keeps ~2 significant digits of each value and nothing below
2^-9: enough for keys and values that a norm keeps near 1 (Gemma's q/k/v norms, Qwen3.5's
q/k norms); BENCHMARKS.md has what it does to the default model's tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.layers.slot_state import SlotState, to_host
from worker.models.config import LayerSpec

DEFAULT_RING_SLACK = 16
# the KV cache dtypes `--kv-cache-dtype` offers besides the model's own ("auto")
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn}
# a prefill's capture into the prefix pool (`PoolCapture`) copies a slice where its rows are
# one run; TOKENPIPE_CAPTURE_RUNS=0: an indexed copy always (the A/B of session 44)
CAPTURE_RUNS = os.environ.get("TOKENPIPE_CAPTURE_RUNS", "1") != "0"
FP8_MAX = 448.0  # e4m3's largest finite value


def kv_cache_dtype(name: str | None) -> torch.dtype | None:
    """`--kv-cache-dtype`'s value -> the cache dtype, None for the model's own (auto)."""
    if name in (None, "auto"):
        return None
    if name not in KV_CACHE_DTYPES:
        known = ", ".join(["auto", *KV_CACHE_DTYPES])
        raise ValueError(f"unknown --kv-cache-dtype {name!r}; known: {known}")
    return KV_CACHE_DTYPES[name]


def as_cache(t: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``t`` in the cache's dtype (itself when it already is): fp8 saturates at +-448."""
    if t.dtype == cache.dtype:
        return t
    if cache.dtype == torch.float8_e4m3fn:
        t = t.clamp(-FP8_MAX, FP8_MAX)
    return t.to(cache.dtype)


def as_cached(t: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``t`` as the cache would give it back (itself for a cache of its dtype): a prefill's
    new keys and values, so that attention sees every key as the cache holds it, however the
    prompt was split into steps (a warm resume equals a cold prefill with an fp8 cache too)."""
    return round_to_cache(t, cache)[1]


def round_to_cache(t: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``t`` in the cache's dtype: what a store copies, `as_cache`; that widened back to
    ``t``'s dtype: what attention sees, `as_cached`), rounded once; both ``t`` itself for a
    cache of its dtype."""
    stored = as_cache(t, cache)
    return stored, stored.to(t.dtype)


def _as_stored(dest: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest, src) to copy between: ``src`` in dest's dtype first (`as_cache`); for an fp8
    cache both as their bytes (torch's CPU copy kernels have no fp8 index_copy_)."""
    src = as_cache(src, dest)
    if dest.dtype == torch.float8_e4m3fn:
        return dest.view(torch.uint8), src.view(torch.uint8)
    return dest, src


def slice_copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)``, as the cache stores it (`_as_stored`)."""
    dest, src = _as_stored(dest, src)
    dest.copy_(src)


def index_copy(dest: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.index_copy_(dim, index, src)``, as the cache stores it (`_as_stored`)."""
    dest, src = _as_stored(dest, src)
    dest.index_copy_(dim, index, src)


@dataclass
class LayerCache:
    """The cache of one decoder layer for all slots."""

    k: torch.Tensor  # [slots, kv_heads, capacity, head_dim]
    v: torch.Tensor  # [slots, kv_heads, capacity, head_dim]
    window: int | None  # None: full attention; else the sliding window W
    # the shared-prefix pool [kv_heads, rows, head_dim] (KVCache.make_pool) and the capture
    # the next prefill fills (KVCache.set_capture)
    pool_k: torch.Tensor | None = None
    pool_v: torch.Tensor | None = None
    capture: PoolCapture | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def keepable_prefix_for(rings: Sequence[tuple[int, int]], cached_len: int, common_len: int) -> int:
    """How many of the first ``common_len`` cached tokens stay usable (pure).

    ``rings`` lists (ring size R, window W) of every sliding layer. Full layers keep any prefix.
    Keeping prefix L of N = cached_len tokens needs positions [L - W + 1, L) intact in every ring;
    a ring of size R holds [N - R, N), so L must be 0, or N <= R, or L >= N - R + W - 1.
    """
    keep = max(0, min(common_len, cached_len))
    for ring_size, window in rings:
        if keep == 0:
            break
        needs_history = window > 1  # a window of 1 sees only the token itself
        if needs_history and cached_len > ring_size and keep < cached_len - ring_size + window - 1:
            keep = 0
    return keep


class KVCache:
    """All layers' caches; the model's ``make_kv_cache`` builds it."""

    def __init__(
        self,
        layer_specs: Sequence[LayerSpec],
        window: int | None,
        num_slots: int,
        max_context: int,
        device: torch.device | str,
        dtype: torch.dtype,
        ring_slack: int = DEFAULT_RING_SLACK,
    ) -> None:
        if num_slots < 1 or max_context < 1:
            raise ValueError(
                f"need num_slots >= 1 and max_context >= 1, got {num_slots}, {max_context}"
            )
        if ring_slack < 0:
            raise ValueError(f"ring_slack must be >= 0, got {ring_slack}")
        self.num_slots = num_slots
        self.max_context = max_context
        self.ring_slack = ring_slack
        self.lookahead = 0  # steps a decode path may write past a slot's tokens
        self.layers: list[LayerCache] = []
        for spec in layer_specs:
            sliding = spec.kind == "sliding"
            assert not sliding or window is not None, "sliding layers need a window"
            capacity = min(window + ring_slack, max_context) if sliding and window else max_context
            if spec.kind == "linear":  # Gated DeltaNet: no KV (worker/layers/hybrid_cache.py)
                capacity = 0
            shape = (num_slots, spec.num_kv_heads, capacity, spec.head_dim)
            k = torch.zeros(shape, device=device, dtype=dtype)
            v = torch.zeros(shape, device=device, dtype=dtype)
            self.layers.append(LayerCache(k, v, window if sliding else None))

    @property
    def bytes_per_slot(self) -> int:
        total = 0
        for layer in self.layers:
            total += (layer.k[0].numel() + layer.v[0].numel()) * layer.k.element_size()
        return total

    @property
    def rings(self) -> list[tuple[int, int]]:
        """(ring size, window) of each distinct sliding-layer geometry."""
        return sorted(
            {(layer.capacity, layer.window) for layer in self.layers if layer.window is not None}
        )

    def keepable_prefix(self, cached_len: int, common_len: int) -> int:
        """Tokens of a common prefix this cache can keep when a slot holding ``cached_len``
        tokens is truncated and continued (pure; 0 means re-prefill from scratch).

        ``lookahead`` (set by a decode path that may write one step past a slot's tokens, see
        worker/device/decode_graphs.py) counts as that many more cached tokens."""
        rings = [(size - self.lookahead, window) for size, window in self.rings]
        return keepable_prefix_for(rings, cached_len, common_len)

    # -- one slot off the device and back (worker/engine/tiers.py) ------------------------------

    def geometry(self) -> list[list[Any]]:
        """Each layer's [kind, kv_heads, capacity, head_dim, dtype]: two caches whose geometry
        is equal can exchange slot states."""
        return [
            [
                "linear" if layer.capacity == 0 else "full" if layer.window is None else "sliding",
                layer.k.shape[1],
                layer.capacity,
                layer.k.shape[3],
                str(layer.k.dtype).removeprefix("torch."),
            ]
            for layer in self.layers
        ]

    def slot_views(self, slot: int, tokens: int) -> dict[str, torch.Tensor]:
        """The entries describing the slot's first ``tokens`` tokens (device views): a full
        layer's positions [0, tokens), a sliding layer's ring indices [0, min(tokens, R)) (ring
        index = position % R, so this is the ring exactly as the slot holds it)."""
        views: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if layer.capacity == 0:
                continue
            n = min(tokens, layer.capacity)
            views[f"k{i}"] = layer.k[slot, :, :n]
            views[f"v{i}"] = layer.v[slot, :, :n]
        return views

    def export_slot(self, slot: int, tokens: int, buffer: Any = None) -> SlotState:
        """``slot_views`` copied to the host, into ``buffer`` (a held ``HostBuffer``, which the
        state then holds) when it fits, else into pageable memory."""
        tensors, held = to_host(self.slot_views(slot, tokens), buffer)
        return SlotState(tokens, tensors, {}, held)

    def import_slot(self, slot: int, state: SlotState) -> None:
        """Put an exported state into ``slot`` (any slot of a cache of the same geometry)."""
        for i, layer in enumerate(self.layers):
            if layer.capacity == 0:
                continue
            k, v = state.tensors[f"k{i}"], state.tensors[f"v{i}"]
            n = k.shape[1]
            if n != min(state.tokens, layer.capacity) or k.shape != v.shape:
                raise ValueError(f"layer {i}: a slot state of {n} entries for {state.tokens}")
            layer.k[slot, :, :n].copy_(k, non_blocking=True)
            layer.v[slot, :, :n].copy_(v, non_blocking=True)

    # -- the shared-prefix pool (worker/engine/prefix_cache.py) ----------------------------------

    @property
    def pool_row_bytes(self) -> int:
        """Bytes of one pool row: one position's keys and values in every attention layer."""
        return sum(
            2 * layer.k.shape[1] * layer.k.shape[3] * layer.k.element_size()
            for layer in self.layers
            if layer.capacity
        )

    def make_pool(self, rows: int) -> None:
        """Give every attention layer a pool of ``rows`` positions ([kv_heads, rows, head_dim]
        per K and V), where the prefix cache keeps shared blocks."""
        for layer in self.layers:
            if layer.capacity:
                shape = (layer.k.shape[1], rows, layer.k.shape[3])
                layer.pool_k = torch.empty(shape, device=layer.k.device, dtype=layer.k.dtype)
                layer.pool_v = torch.empty(shape, device=layer.k.device, dtype=layer.k.dtype)

    def set_capture(self, capture: PoolCapture | None) -> None:
        """The next forward's prefill of ``capture.slot`` also writes its keys and values to
        the pool (worker/layers/attention.py); None: no capture."""
        for layer in self.layers:
            layer.capture = capture if layer.capacity else None

    @property
    def ring_kept(self) -> int | None:
        """Positions every ring of a slot surely still holds after a step (the last ones), less
        the decode lookahead; None without sliding layers."""
        sizes = [size - self.lookahead for size, _ in self.rings]
        return min(sizes) if sizes else None

    def slot_to_pool(
        self, slot: int, start: int, end: int, rows: torch.Tensor, sliding_start: int
    ) -> None:
        """Copy positions [start, end) of the slot into pool ``rows`` ([end - start]): every
        position of a full layer, a sliding layer's from ``sliding_start`` on (its ring still
        holds them)."""
        for layer in self.layers:
            if not layer.capacity:
                continue
            if layer.window is None:
                index_copy(layer.pool_k, 1, rows, layer.k[slot, :, start:end])
                index_copy(layer.pool_v, 1, rows, layer.v[slot, :, start:end])
                continue
            first = max(start, sliding_start)
            if first >= end:
                continue
            index = _ring_index(first, end, layer.capacity, layer.k.device)
            kept = rows[first - start :]
            index_copy(layer.pool_k, 1, kept, layer.k[slot].index_select(1, index))
            index_copy(layer.pool_v, 1, kept, layer.v[slot].index_select(1, index))

    def pool_to_slot(
        self,
        slot: int,
        full: tuple[int, int, torch.Tensor],
        sliding: tuple[int, int, torch.Tensor],
    ) -> None:
        """Write pool rows into the slot: ``full`` = (start, end, rows) positions of the full
        layers, ``sliding`` = (start, end, rows) positions of the sliding layers, each ring
        taking the last ones it can hold (at position % R)."""
        for layer in self.layers:
            if not layer.capacity:
                continue
            if layer.window is None:
                start, end, rows = full
                if end > start:
                    layer.k[slot, :, start:end] = layer.pool_k.index_select(1, rows)
                    layer.v[slot, :, start:end] = layer.pool_v.index_select(1, rows)
                continue
            start, end, rows = sliding
            first = max(start, end - layer.capacity)
            if first >= end:
                continue
            index = _ring_index(first, end, layer.capacity, layer.k.device)
            kept = rows[first - start :]
            index_copy(layer.k[slot], 1, index, layer.pool_k.index_select(1, kept))
            index_copy(layer.v[slot], 1, index, layer.pool_v.index_select(1, kept))


def run_start(rows: Sequence[int]) -> int | None:
    """The first of ``rows`` when they are one run (row, row + 1, ...); None otherwise."""
    if not rows or list(rows) != list(range(rows[0], rows[0] + len(rows))):
        return None
    return rows[0]


@dataclass
class PoolCapture:
    """A prefill step's keys and values of ``slot``'s new tokens [first, first + len(rows))
    (indices into the step's new tokens), copied to pool ``rows`` as each attention layer stores
    them: the positions a ring drops during the step are kept this way. ``written`` tells the
    caller whether the forward took it (a prefill replayed from a CUDA graph does not)."""

    slot: int
    first: int
    rows: torch.Tensor  # [m] int64 on the cache's device
    written: bool = False
    # the first of ``rows`` when they are one run (row, row + 1, ...), as a fresh pool gives a
    # prompt's blocks: the copy is then a slice's, not an indexed one (`take`); None: not one run
    run_start: int | None = None

    def take(self, cache: LayerCache, slot: int, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """new_k, new_v [kv_heads, n, head_dim]: the step's new keys/values of ``slot``."""
        if slot != self.slot or cache.pool_k is None or cache.pool_v is None:
            return
        end = self.first + self.rows.shape[0]
        if self.run_start is None or not CAPTURE_RUNS:
            index_copy(cache.pool_k, 1, self.rows, new_k[:, self.first : end])
            index_copy(cache.pool_v, 1, self.rows, new_v[:, self.first : end])
        else:
            rows = slice(self.run_start, self.run_start + self.rows.shape[0])
            slice_copy(cache.pool_k[:, rows], new_k[:, self.first : end])
            slice_copy(cache.pool_v[:, rows], new_v[:, self.first : end])
        self.written = True


def _ring_index(start: int, end: int, ring: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, end, device=device) % ring
