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

K=V layers (gemma4 full layers, no v_proj) still store K and V separately: K is the k-normed,
rotated projection and V the weightless-normed, unrotated one, so the cached tensors differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.layers.slot_state import SlotState, to_host
from worker.models.config import LayerSpec

DEFAULT_RING_SLACK = 16


@dataclass
class LayerCache:
    """The cache of one decoder layer for all slots."""

    k: torch.Tensor  # [slots, kv_heads, capacity, head_dim]
    v: torch.Tensor  # [slots, kv_heads, capacity, head_dim]
    window: int | None  # None: full attention; else the sliding window W

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

    def export_slot(self, slot: int, tokens: int) -> SlotState:
        """The entries describing the slot's first ``tokens`` tokens, copied to the host: a full
        layer's positions [0, tokens), a sliding layer's ring indices [0, min(tokens, R)) (ring
        index = position % R, so this is the ring exactly as the slot holds it)."""
        views: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if layer.capacity == 0:
                continue
            n = min(tokens, layer.capacity)
            views[f"k{i}"] = layer.k[slot, :, :n]
            views[f"v{i}"] = layer.v[slot, :, :n]
        return SlotState(tokens, to_host(views), {})

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

    # -- spans of positions (worker/engine/prefix_cache.py) -------------------------------------

    @property
    def min_ring(self) -> int | None:
        """The smallest sliding ring (less the decode lookahead), None without sliding layers."""
        sizes = [size - self.lookahead for size, _ in self.rings]
        return min(sizes) if sizes else None

    def read_span(
        self, slot: int, start: int, end: int, sliding: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Copies of positions [start, end) of the slot, per layer ([kv_heads, end - start,
        head_dim] each): the full layers, or with ``sliding`` the sliding layers (the caller
        checked the ring still holds them); None for the others."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer in self.layers:
            if layer.capacity == 0 or (layer.window is not None) != sliding:
                out.append(None)
            elif layer.window is None:
                out.append(
                    (layer.k[slot, :, start:end].clone(), layer.v[slot, :, start:end].clone())
                )
            else:
                index = _ring_index(start, end, layer.capacity, layer.k.device)
                out.append(
                    (layer.k[slot].index_select(1, index), layer.v[slot].index_select(1, index))
                )
        return out

    def write_span(
        self,
        slot: int,
        start: int,
        end: int,
        span: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
        sliding: bool,
        offset: int = 0,
    ) -> None:
        """Write positions [start, end) of the slot from a span read at ``offset`` (its first
        position). The full layers at their index, or with ``sliding`` the sliding layers at
        position % R (only the last R positions of the range)."""
        for layer, kv in zip(self.layers, span, strict=True):
            if layer.capacity == 0 or (layer.window is not None) != sliding:
                continue
            if kv is None:
                raise ValueError("a span without this layer's entries")
            k, v = kv
            if layer.window is None:
                layer.k[slot, :, start:end] = k[:, start - offset : end - offset]
                layer.v[slot, :, start:end] = v[:, start - offset : end - offset]
                continue
            first = max(start, end - layer.capacity)
            index = _ring_index(first, end, layer.capacity, layer.k.device)
            layer.k[slot].index_copy_(1, index, k[:, first - offset : end - offset])
            layer.v[slot].index_copy_(1, index, v[:, first - offset : end - offset])


def _ring_index(start: int, end: int, ring: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, end, device=device) % ring
