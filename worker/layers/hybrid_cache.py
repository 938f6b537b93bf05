"""The session state of a hybrid model (qwen3_5_moe): full layers' KV plus Gated DeltaNet state.

A slot holds, per full-attention layer, the KV of every position (``worker.layers.kv``) and,
per DeltaNet layer, a conv state [conv_dim, K - 1] (model dtype) and a recurrent state
[Hv, Dk, Dv] (float32). The KV can be truncated anywhere; the DeltaNet state describes exactly
``live_len[slot]`` tokens and cannot be rewound. So each slot also keeps ``snapshots`` copies of
the DeltaNet state (``snapshots`` entries, each tagged with the token count it describes); with
the KV prefix, which later tokens never overwrite, a snapshot at n tokens restores the whole
session state at n.

Invariant (kept by ``truncate``): every snapshot of a slot describes a prefix of the slot's
resident ids. A forward must continue a slot from ``live_len`` (or from 0): anything else raises
(``begin_step``), so a wrong state is never used.

Cost per snapshot (35B-A3B, 30 DeltaNet layers): recurrent 30 x 32 x 128 x 128 x 4 B = 60 MiB,
conv 30 x 8192 x 3 x 2 B (bf16) = 1.4 MiB, the same again for the live state; the default 4
snapshots make 307 MiB a session on top of the full layers' KV (20 KiB a token in bf16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.layers.kv import DEFAULT_RING_SLACK, KVCache, LayerCache
from worker.layers.slot_state import SlotState, to_host
from worker.models.config import DeltaNetSpec, LayerSpec
from worker.models.step import StepInput

DEFAULT_SNAPSHOTS = 4


@dataclass
class DeltaNetLayerCache:
    """The DeltaNet state of one layer for all slots, and its snapshots."""

    conv: torch.Tensor  # [slots, conv_dim, K - 1] model dtype
    recurrent: torch.Tensor  # [slots, Hv, Dk, Dv] float32
    snap_conv: torch.Tensor  # [slots, snapshots, conv_dim, K - 1]
    snap_recurrent: torch.Tensor  # [slots, snapshots, Hv, Dk, Dv]
    # this step's snapshots taken inside a chunk: slot -> token count (set by HybridCache)
    captures: dict[int, int] = field(default_factory=dict)
    capture_entry: dict[int, int] = field(default_factory=dict)  # slot -> snapshot entry

    def save_snapshot(self, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """The layer's state after ``captures[slot]`` tokens (mid-chunk) into its entry."""
        entry = self.capture_entry[slot]
        self.snap_conv[slot, entry] = conv
        self.snap_recurrent[slot, entry] = recurrent

    def copy_to_snapshot(self, slot: int, entry: int) -> None:
        self.snap_conv[slot, entry] = self.conv[slot]
        self.snap_recurrent[slot, entry] = self.recurrent[slot]

    def restore(self, slot: int, entry: int) -> None:
        self.conv[slot] = self.snap_conv[slot, entry]
        self.recurrent[slot] = self.snap_recurrent[slot, entry]

    def nbytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.conv, self.recurrent, self.snap_conv, self.snap_recurrent)


class HybridCache:
    """Per-layer caches (``layers[i]``: a ``LayerCache`` for a full layer, a
    ``DeltaNetLayerCache`` for a linear one) and the snapshot bookkeeping of every slot."""

    def __init__(
        self,
        layer_specs: Sequence[LayerSpec],
        deltanet: DeltaNetSpec,
        num_slots: int,
        max_context: int,
        device: torch.device | str,
        dtype: torch.dtype,
        snapshots: int = DEFAULT_SNAPSHOTS,
        ring_slack: int = DEFAULT_RING_SLACK,
    ) -> None:
        if snapshots < 0:
            raise ValueError(f"snapshots must be >= 0, got {snapshots}")
        self.kv = KVCache(layer_specs, None, num_slots, max_context, device, dtype, ring_slack)
        self.num_slots, self.max_context = num_slots, max_context
        self.ring_slack = ring_slack
        self.lookahead = 0
        self.snapshots = snapshots
        d = deltanet
        conv_dim = 2 * d.num_key_heads * d.key_head_dim + d.num_value_heads * d.value_head_dim
        conv_shape = (conv_dim, d.conv_kernel - 1)
        state_shape = (d.num_value_heads, d.key_head_dim, d.value_head_dim)
        self.layers: list[LayerCache | DeltaNetLayerCache] = []
        self._captures: dict[int, int] = {}  # shared by every DeltaNet layer
        self._capture_entry: dict[int, int] = {}
        for spec, kv_layer in zip(layer_specs, self.kv.layers, strict=True):
            if spec.kind != "linear":
                self.layers.append(kv_layer)
                continue

            def zeros(*shape: int, dt: torch.dtype) -> torch.Tensor:
                return torch.zeros(shape, device=device, dtype=dt)

            self.layers.append(
                DeltaNetLayerCache(
                    conv=zeros(num_slots, *conv_shape, dt=dtype),
                    recurrent=zeros(num_slots, *state_shape, dt=torch.float32),
                    snap_conv=zeros(num_slots, snapshots, *conv_shape, dt=dtype),
                    snap_recurrent=zeros(num_slots, snapshots, *state_shape, dt=torch.float32),
                    captures=self._captures,
                    capture_entry=self._capture_entry,
                )
            )
        self.live_len = [0] * num_slots  # tokens the DeltaNet state of each slot describes
        # token count held by each snapshot entry of each slot (0: empty)
        self.snapshot_lens = [[0] * snapshots for _ in range(num_slots)]
        self._pending: list[set[int]] = [set() for _ in range(num_slots)]  # snapshot_at, later
        self._end_of_step: list[tuple[int, int]] = []  # (slot, entry) to copy after the step
        self._step_lens: list[tuple[int, int]] = []  # (slot, tokens after the step)

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def deltanet_layers(self) -> list[DeltaNetLayerCache]:
        return [layer for layer in self.layers if isinstance(layer, DeltaNetLayerCache)]

    @property
    def bytes_per_slot(self) -> int:
        """KV, live DeltaNet state and its snapshots of one slot."""
        return self.kv.bytes_per_slot + sum(d.nbytes_per_slot() for d in self.deltanet_layers)

    @property
    def rings(self) -> list[tuple[int, int]]:
        return []

    # -- resume --------------------------------------------------------------------------------

    def keepable_prefix(self, cached_len: int, common_len: int) -> int:
        """Without knowing the slot: only an append-only resume keeps anything."""
        return common_len if 0 < common_len == cached_len else 0

    def resume_prefix(self, slot: int, cached_len: int, common_len: int) -> int:
        """Tokens of a common prefix slot ``slot`` can resume from (pure): all of them when the
        live state is there (append-only), else the newest snapshot at or before it, else 0."""
        if common_len == cached_len == self.live_len[slot]:
            return common_len
        held = [n for n in self.snapshot_lens[slot] if 0 < n <= min(common_len, cached_len)]
        return max(held, default=0)

    def truncate(self, slot: int, keep: int) -> None:
        """Make the slot describe its first ``keep`` tokens (``resume_prefix`` said it can):
        restore the snapshot at ``keep`` unless the live state is there; drop every snapshot and
        pending snapshot past ``keep``."""
        self._pending[slot].clear()
        lens = self.snapshot_lens[slot]
        if keep != self.live_len[slot] and keep > 0:
            if keep not in lens:
                raise ValueError(f"slot {slot}: no state at {keep} tokens to resume from")
            entry = lens.index(keep)
            for layer in self.deltanet_layers:
                layer.restore(slot, entry)
        self.live_len[slot] = keep
        for entry, n in enumerate(lens):
            if n > keep:
                lens[entry] = 0

    def snapshot_at(self, slot: int, tokens: int) -> None:
        """Keep the slot's state after ``tokens`` tokens: now if the live state is there, else
        when a forward reaches it. Evicts the snapshot with the fewest tokens."""
        lens = self.snapshot_lens[slot]
        if self.snapshots == 0 or tokens <= 0 or tokens in lens or tokens < self.live_len[slot]:
            return
        if tokens == self.live_len[slot]:
            entry = self._free_entry(slot)
            for layer in self.deltanet_layers:
                layer.copy_to_snapshot(slot, entry)
            lens[entry] = tokens
        else:
            self._pending[slot].add(tokens)

    def _free_entry(self, slot: int) -> int:
        lens = self.snapshot_lens[slot]
        entry = min(range(len(lens)), key=lambda e: lens[e])  # empty (0) first, else oldest
        lens[entry] = 0
        return entry

    # -- the step (called by the model around its forward) -------------------------------------

    def begin_step(self, step: StepInput) -> None:
        """Check each sequence continues its slot's live state; plan this step's snapshots."""
        self._captures.clear()
        self._capture_entry.clear()
        self._end_of_step.clear()
        self._step_lens.clear()  # a step that failed left its slots at -1
        for slot, cached, new in zip(step.slots, step.cached_lens, step.new_lens, strict=True):
            if cached != 0 and cached != self.live_len[slot]:
                raise ValueError(
                    f"slot {slot}: the recurrent state holds {self.live_len[slot]} tokens, the "
                    f"step continues at {cached} (truncate to a snapshot first)"
                )
            self._step_lens.append((slot, cached + new))
            self.live_len[slot] = -1  # unknown until end_step: a failed step leaves no state
            pending = self._pending[slot]
            for tokens in sorted(pending):
                if tokens <= cached:
                    pending.discard(tokens)  # passed (a re-prefill from 0 went elsewhere)
                elif tokens < cached + new and slot not in self._captures:
                    pending.discard(tokens)
                    self._captures[slot] = tokens
                    self._capture_entry[slot] = self._free_entry(slot)
                elif tokens == cached + new:
                    pending.discard(tokens)
                    self._end_of_step.append((slot, self._free_entry(slot)))

    def step_snapshot(self, slot: int, cached: int) -> tuple[int, int]:
        """(rows into this step, entry) of the snapshot the step begun by ``begin_step`` takes
        inside its chunk for ``slot`` (which continues from ``cached``), or (0, 0): what a
        captured prefill writes (worker/device/prefill_graphs.py)."""
        if slot not in self._captures:
            return 0, 0
        return self._captures[slot] - cached, self._capture_entry[slot]

    def end_step(self) -> None:
        """The forward succeeded: the slots hold their new lengths, the snapshots are valid."""
        for slot, tokens in self._step_lens:
            self.live_len[slot] = tokens
        for slot, tokens in self._captures.items():
            self.snapshot_lens[slot][self._capture_entry[slot]] = tokens
        for slot, entry in self._end_of_step:
            for layer in self.deltanet_layers:
                layer.copy_to_snapshot(slot, entry)
            self.snapshot_lens[slot][entry] = self.live_len[slot]
        self._captures.clear()
        self._end_of_step.clear()
        self._step_lens.clear()

    # -- one slot off the device and back (worker/engine/tiers.py) ------------------------------

    def geometry(self) -> list[list[Any]]:
        """The KV layers' geometry plus each DeltaNet layer's state shapes and snapshot count."""
        extra: list[list[Any]] = [
            ["deltanet", list(d.conv.shape[1:]), list(d.recurrent.shape[1:]), self.snapshots]
            for d in self.deltanet_layers
        ]
        return self.kv.geometry() + extra

    def slot_views(self, slot: int, tokens: int) -> dict[str, torch.Tensor]:
        """The KV entries of ``tokens`` tokens, the live DeltaNet state and every snapshot."""
        views = self.kv.slot_views(slot, tokens)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, DeltaNetLayerCache):
                views[f"conv{i}"] = layer.conv[slot]
                views[f"recurrent{i}"] = layer.recurrent[slot]
                views[f"snap_conv{i}"] = layer.snap_conv[slot]
                views[f"snap_recurrent{i}"] = layer.snap_recurrent[slot]
        return views

    def export_slot(self, slot: int, tokens: int, buffer: Any = None) -> SlotState:
        """``slot_views`` on the host (into ``buffer`` when it fits, as ``KVCache``'s) and the
        bookkeeping. Call between steps only."""
        if self.live_len[slot] != tokens:
            raise ValueError(
                f"slot {slot}: exporting {tokens} tokens, the state holds {self.live_len[slot]}"
            )
        tensors, held = to_host(self.slot_views(slot, tokens), buffer)
        meta = {
            "snapshot_lens": list(self.snapshot_lens[slot]),
            "pending": sorted(self._pending[slot]),
        }
        return SlotState(tokens, tensors, meta, held)

    def import_slot(self, slot: int, state: SlotState) -> None:
        self.kv.import_slot(slot, state)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, DeltaNetLayerCache):
                layer.conv[slot].copy_(state.tensors[f"conv{i}"])
                layer.recurrent[slot].copy_(state.tensors[f"recurrent{i}"])
                layer.snap_conv[slot].copy_(state.tensors[f"snap_conv{i}"])
                layer.snap_recurrent[slot].copy_(state.tensors[f"snap_recurrent{i}"])
        lens = [int(n) for n in state.meta["snapshot_lens"]]
        if len(lens) != self.snapshots:
            raise ValueError(
                f"{len(lens)} snapshots in a slot state, the cache keeps {self.snapshots}"
            )
        self.snapshot_lens[slot] = lens
        self._pending[slot] = {int(n) for n in state.meta.get("pending", [])}
        self.live_len[slot] = state.tokens

    def clear_slot(self, slot: int) -> None:
        """A slot given to a new session: nothing live, no snapshots."""
        self.live_len[slot] = 0
        self.snapshot_lens[slot] = [0] * self.snapshots
        self._pending[slot].clear()
