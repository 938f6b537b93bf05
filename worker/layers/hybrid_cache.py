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

The shared-prefix cache (worker/engine/prefix_cache.py) keeps the full layers' KV of prompt
blocks in the KV pool (``make_pool``: rows, as ``KVCache``) and DeltaNet states at some block
ends in a pool of states here (``pool_conv`` [states, conv_dim, K - 1], ``pool_recurrent``
[states, Hv, Dk, Dv] per layer). It asks for states with ``set_state_captures``: the next
forward over the slot writes each ``StateCapture`` at its token count, before the step (the
live state), inside its prefill (read out of the chunked pass at a multiple of ``free_split``
rows into the step, else the sequence split there, as for a snapshot) or after it. A
step replayed from a prefill graph takes one snapshot inside its rows, into a slot entry: the
slot's own pending snapshot first, else one pool state through an entry (copied to its row
after the step); the others are left unwritten. ``pool_state_to_slot`` puts a pool state into
a slot's live state.

Decode ahead (worker/device/graphed_lm.py launches a batch's next decode step before the
engine asks for it): that step advances its slots' DeltaNet states in place. So, on the stream
that runs it and before it, ``back_up_ahead`` copies those slots' live states (every DeltaNet
layer's: they are one tensor per kind, ``[layers, slots, ...]``, so a slot's is one strided
copy) into a backup of ``ahead_rows`` rows. Until ``keep_ahead`` (the engine asked for exactly
that step: its ``begin_step`` / ``end_step`` count the token) or ``restore_ahead`` (a miss: the
backups go back), those slots' device state is one token past ``live_len``. Every method here
that reads or replaces a slot's state first settles such a slot (``settle``, the wrapper's
drop: wait for the step, restore), so a snapshot, a pool state, an export or a rollback never
sees the step launched ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.layers.kv import DEFAULT_RING_SLACK, KVCache, LayerCache
from worker.layers.slot_state import SlotState, to_host
from worker.models.config import DeltaNetSpec, LayerSpec
from worker.models.step import StepInput

DEFAULT_SNAPSHOTS = 4


@dataclass
class StateCapture:
    """The DeltaNet state of ``slot`` after ``tokens`` tokens into pool state ``row`` (every
    DeltaNet layer's), written by the next forward over the slot that reaches ``tokens``
    (``HybridCache.set_state_captures``); ``written`` once it was."""

    slot: int
    tokens: int
    row: int
    written: bool = False


@dataclass(frozen=True)
class SnapshotTarget:
    """Where the state after ``tokens`` tokens of a slot goes during a prefill step: a slot
    snapshot ``entry`` and/or a pool state ``row`` (-1: none)."""

    tokens: int
    entry: int
    row: int


@dataclass
class DeltaNetLayerCache:
    """The DeltaNet state of one layer for all slots, its snapshots and its prefix-pool states."""

    conv: torch.Tensor  # [slots, conv_dim, K - 1] model dtype
    recurrent: torch.Tensor  # [slots, Hv, Dk, Dv] float32
    snap_conv: torch.Tensor  # [slots, snapshots, conv_dim, K - 1]
    snap_recurrent: torch.Tensor  # [slots, snapshots, Hv, Dk, Dv]
    # this step's snapshots taken inside a chunk: slot -> targets (set by HybridCache)
    captures: dict[int, list[SnapshotTarget]] = field(default_factory=dict)
    # a prefill reads a state this many rows (or a multiple) into a sequence's step from inside
    # its pass, without a split (worker/layers/deltanet.py ``prefill_states``); 0: it splits
    free_split: int = 0
    pool_conv: torch.Tensor | None = None  # [states, conv_dim, K - 1] (HybridCache.make_pool)
    pool_recurrent: torch.Tensor | None = None  # [states, Hv, Dk, Dv] float32

    def split_points(self, slot: int, cached: int, new: int) -> list[int]:
        """Rows of a prefill of ``new`` tokens after ``cached`` after which a snapshot is taken
        (sorted, each in (0, new))."""
        rows = {t.tokens - cached for t in self.captures.get(slot, ())}
        return sorted(r for r in rows if 0 < r < new)

    def save_snapshot(
        self, slot: int, tokens: int, conv: torch.Tensor, recurrent: torch.Tensor
    ) -> None:
        """The layer's state after ``tokens`` tokens (mid-chunk) into its targets."""
        for target in self.captures.get(slot, ()):
            if target.tokens != tokens:
                continue
            into = [] if target.entry < 0 else self.snapshot(slot, target.entry)
            into += [] if target.row < 0 else self.pool_row(target.row)
            if into:
                torch._foreach_copy_(into, [conv, recurrent] * (len(into) // 2))

    def live(self, slot: int) -> list[torch.Tensor]:
        """The slot's live state (conv, recurrent), views to copy from or into."""
        return [self.conv[slot], self.recurrent[slot]]

    def snapshot(self, slot: int, entry: int) -> list[torch.Tensor]:
        return [self.snap_conv[slot, entry], self.snap_recurrent[slot, entry]]

    def pool_row(self, row: int) -> list[torch.Tensor]:
        assert self.pool_conv is not None and self.pool_recurrent is not None
        return [self.pool_conv[row], self.pool_recurrent[row]]

    def nbytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._tensors())

    def state_bytes(self) -> int:
        """Bytes of one state (conv and recurrent): a pool row."""
        return sum(t[0].numel() * t.element_size() for t in (self.conv, self.recurrent))

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
        free_split: int = 0,
        kv_dtype: torch.dtype | None = None,  # the attention layers' (default: dtype)
    ) -> None:
        if snapshots < 0:
            raise ValueError(f"snapshots must be >= 0, got {snapshots}")
        self.kv = KVCache(
            layer_specs, None, num_slots, max_context, device, kv_dtype or dtype, ring_slack
        )
        self.num_slots, self.max_context = num_slots, max_context
        self.ring_slack = ring_slack
        self.lookahead = 0
        self.snapshots = snapshots
        d = deltanet
        conv_dim = 2 * d.num_key_heads * d.key_head_dim + d.num_value_heads * d.value_head_dim
        conv_shape = (conv_dim, d.conv_kernel - 1)
        state_shape = (d.num_value_heads, d.key_head_dim, d.value_head_dim)
        self.layers: list[LayerCache | DeltaNetLayerCache] = []
        self._captures: dict[int, list[SnapshotTarget]] = {}  # shared by every DeltaNet layer
        linear = sum(spec.kind == "linear" for spec in layer_specs)
        # every DeltaNet layer's live state in one tensor per kind (layer i's: a view [i]), so
        # one slot's whole state is one strided copy (decode ahead's backup)
        self.all_conv = torch.zeros((linear, num_slots, *conv_shape), device=device, dtype=dtype)
        self.all_recurrent = torch.zeros(
            (linear, num_slots, *state_shape), device=device, dtype=torch.float32
        )
        for spec, kv_layer in zip(layer_specs, self.kv.layers, strict=True):
            if spec.kind != "linear":
                self.layers.append(kv_layer)
                continue

            def zeros(*shape: int, dt: torch.dtype) -> torch.Tensor:
                return torch.zeros(shape, device=device, dtype=dt)

            i = len(self.deltanet_layers)
            self.layers.append(
                DeltaNetLayerCache(
                    conv=self.all_conv[i],
                    recurrent=self.all_recurrent[i],
                    snap_conv=zeros(num_slots, snapshots, *conv_shape, dt=dtype),
                    snap_recurrent=zeros(num_slots, snapshots, *state_shape, dt=torch.float32),
                    captures=self._captures,
                    free_split=free_split,
                )
            )
        self.live_len = [0] * num_slots  # tokens the DeltaNet state of each slot describes
        # token count held by each snapshot entry of each slot (0: empty)
        self.snapshot_lens = [[0] * snapshots for _ in range(num_slots)]
        self._pending: list[set[int]] = [set() for _ in range(num_slots)]  # snapshot_at, later
        self._end_of_step: list[tuple[int, int]] = []  # (slot, entry) to copy after the step
        self._step_lens: list[tuple[int, int]] = []  # (slot, tokens after the step)
        # the prefix cache's states (set_state_captures), and this step's share of them
        self._state_captures: list[StateCapture] = []
        self._states_inside: list[StateCapture] = []  # taken inside the step
        self._states_after: list[StateCapture] = []  # copied from the live state after it
        self._entry_to_pool: list[tuple[int, int, int]] = []  # (slot, entry, row) after it
        self._planning = False  # inside begin_step: entries handed out are reserved
        self._reserved: list[tuple[int, int]] = []  # (slot, entry) reserved by the last step
        self.pool_states = 0
        # decode ahead (module doc): backups [rows, layers, ...] of the live states of the slots
        # whose device state runs one step past live_len (`_ahead_slots`, row by row)
        self.ahead_rows = 0
        self._backup_conv: torch.Tensor | None = None
        self._backup_recurrent: torch.Tensor | None = None
        self._ahead_slots: tuple[int, ...] = ()
        self.settle: Callable[[], None] | None = None  # the wrapper's drop (waits, restores)

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def free_split(self) -> int:
        """``DeltaNetLayerCache.free_split`` (the same in every layer)."""
        layers = self.deltanet_layers
        return layers[0].free_split if layers else 0

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
        self._settle(slot)
        self._pending[slot].clear()
        lens = self.snapshot_lens[slot]
        if keep != self.live_len[slot] and keep > 0:
            if keep not in lens:
                raise ValueError(f"slot {slot}: no state at {keep} tokens to resume from")
            entry = lens.index(keep)
            self._copy(("live", slot), ("snapshot", slot, entry))
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
            self._settle(slot)
            entry = self._free_entry(slot)
            self._copy(("snapshot", slot, entry), ("live", slot))
            lens[entry] = tokens
        else:
            self._pending[slot].add(tokens)

    def _free_entry(self, slot: int) -> int:
        """An entry for a new snapshot: an empty one, else the oldest; -1 (reserved until the
        step ends) while a step is planned, so that one step never gets an entry twice."""
        lens = self.snapshot_lens[slot]
        entry = min(range(len(lens)), key=lambda e: (lens[e] < 0, lens[e]))
        lens[entry] = -1 if self._planning else 0
        if self._planning:
            self._reserved.append((slot, entry))
        return entry

    # -- the step (called by the model around its forward) -------------------------------------

    def begin_step(self, step: StepInput, graphed: bool = False) -> None:
        """Check each sequence continues its slot's live state; plan this step's snapshots.
        ``graphed``: the step is replayed from a prefill graph, which takes at most one snapshot
        inside its rows, into a slot entry (module doc)."""
        self._captures.clear()
        self._end_of_step.clear()
        self._step_lens.clear()  # a step that failed left its slots at -1
        self._states_inside.clear()
        self._states_after.clear()
        self._entry_to_pool.clear()
        self._release_reserved()  # a failed step's
        self._settle(*step.slots)
        for slot, cached, new in zip(step.slots, step.cached_lens, step.new_lens, strict=True):
            if cached != 0 and cached != self.live_len[slot]:
                raise ValueError(
                    f"slot {slot}: the recurrent state holds {self.live_len[slot]} tokens, the "
                    f"step continues at {cached} (truncate to a snapshot first)"
                )
            self._planning = True
            try:
                self._plan_states(slot, cached, new, graphed)
            finally:
                self._planning = False
            self._step_lens.append((slot, cached + new))
            self.live_len[slot] = -1  # unknown until end_step: a failed step leaves no state

    def _release_reserved(self) -> None:
        for slot, entry in self._reserved:
            if self.snapshot_lens[slot][entry] < 0:
                self.snapshot_lens[slot][entry] = 0
        self._reserved.clear()

    def _plan_states(self, slot: int, cached: int, new: int, graphed: bool) -> None:
        """The slot's pending snapshots and pool states this step passes: before it (the live
        state, copied now), inside it (targets of the split prefill) or at its end."""
        targets: list[SnapshotTarget] = []
        pending = self._pending[slot]
        for tokens in sorted(pending):
            if tokens <= cached:
                pending.discard(tokens)  # passed (a re-prefill from 0 went elsewhere)
            elif tokens < cached + new and not (graphed and targets):
                pending.discard(tokens)
                targets.append(SnapshotTarget(tokens, self._free_entry(slot), -1))
            elif tokens == cached + new:
                pending.discard(tokens)
                self._end_of_step.append((slot, self._free_entry(slot)))
        for capture in self._state_captures:
            if capture.slot != slot or capture.written:
                continue
            if capture.tokens == cached and cached == self.live_len[slot] and cached > 0:
                self._live_to_pool(slot, capture.row)
                capture.written = True
            elif cached < capture.tokens < cached + new:
                if not graphed:
                    targets.append(SnapshotTarget(capture.tokens, -1, capture.row))
                elif not targets and self.snapshots:  # through a slot entry, then to the row
                    entry = self._free_entry(slot)
                    targets.append(SnapshotTarget(capture.tokens, entry, -1))
                    self._entry_to_pool.append((slot, entry, capture.row))
                else:
                    continue  # the graph's one snapshot is taken: this state is not written
                self._states_inside.append(capture)
            elif capture.tokens == cached + new:
                self._states_after.append(capture)
        if targets:
            self._captures[slot] = targets

    def step_snapshot(self, slot: int, cached: int) -> tuple[int, int]:
        """(rows into this step, entry) of the snapshot the step begun by ``begin_step`` takes
        inside its chunk for ``slot`` (which continues from ``cached``), or (0, 0): what a
        captured prefill writes (worker/device/prefill_graphs.py)."""
        targets = self._captures.get(slot)
        if not targets:
            return 0, 0
        (target,) = targets  # a graphed step plans one (begin_step)
        return target.tokens - cached, target.entry

    def end_step(self) -> None:
        """The forward succeeded: the slots hold their new lengths, the snapshots are valid."""
        for slot, tokens in self._step_lens:
            self.live_len[slot] = tokens
        for slot, targets in self._captures.items():
            for target in targets:
                if target.entry >= 0:
                    self.snapshot_lens[slot][target.entry] = target.tokens
        for slot, entry in self._end_of_step:
            self._copy(("snapshot", slot, entry), ("live", slot))
            self.snapshot_lens[slot][entry] = self.live_len[slot]
        for slot, entry, row in self._entry_to_pool:
            self._copy(("pool_row", row), ("snapshot", slot, entry))
        for capture in self._states_after:
            self._live_to_pool(capture.slot, capture.row)
        for capture in self._states_inside + self._states_after:
            capture.written = True
        self._release_reserved()  # an entry a target never filled (none normally)
        self._captures.clear()
        self._end_of_step.clear()
        self._step_lens.clear()
        self._states_inside.clear()
        self._states_after.clear()
        self._entry_to_pool.clear()

    # -- the shared-prefix pool (worker/engine/prefix_cache.py) ----------------------------------

    @property
    def state_bytes(self) -> int:
        """Bytes of one pool state: every DeltaNet layer's conv and recurrent state."""
        return sum(layer.state_bytes() for layer in self.deltanet_layers)

    def make_pool(self, rows: int, states: int) -> None:
        """The full layers' pool of ``rows`` positions (``KVCache.make_pool``) and a pool of
        ``states`` DeltaNet states."""
        self.kv.make_pool(rows)
        self.pool_states = states
        for layer in self.deltanet_layers:
            layer.pool_conv = torch.empty(
                (states, *layer.conv.shape[1:]), device=layer.conv.device, dtype=layer.conv.dtype
            )
            layer.pool_recurrent = torch.empty(
                (states, *layer.recurrent.shape[1:]),
                device=layer.recurrent.device,
                dtype=layer.recurrent.dtype,
            )

    def set_state_captures(self, captures: Sequence[StateCapture]) -> None:
        """The states the next forwards write into the pool (module doc); [] clears them."""
        self._state_captures = list(captures)

    def pool_state_to_slot(self, slot: int, row: int, tokens: int) -> None:
        """Make pool state ``row`` (the state after ``tokens`` tokens of the slot's resident
        ids: the caller put their KV there) the slot's live state. Snapshots at or before
        ``tokens`` stay (they describe a prefix of the same ids); a pending one at ``tokens``
        is taken now, earlier ones can no longer be."""
        self._settle(slot)
        for layer in self.deltanet_layers:
            assert layer.pool_conv is not None and layer.pool_recurrent is not None
            layer.conv[slot] = layer.pool_conv[row]
            layer.recurrent[slot] = layer.pool_recurrent[row]
        self.live_len[slot] = tokens
        pending = self._pending[slot]
        at_tokens = tokens in pending
        pending.difference_update({n for n in pending if n <= tokens})
        if at_tokens:
            self.snapshot_at(slot, tokens)

    def _live_to_pool(self, slot: int, row: int) -> None:
        self._copy(("pool_row", row), ("live", slot))

    def _copy(self, into: tuple[Any, ...], source: tuple[Any, ...]) -> None:
        """Every DeltaNet layer's ``source`` state into its ``into`` state, in one call; each
        is (a ``DeltaNetLayerCache`` view method: live / snapshot / pool_row, its arguments).
        60 single copies cost ~1 ms of host time on the H200's host (a warm turn's
        end-of-turn snapshot sat in its time to first token)."""
        layers = self.deltanet_layers
        dst = [t for layer in layers for t in getattr(layer, into[0])(*into[1:])]
        src = [t for layer in layers for t in getattr(layer, source[0])(*source[1:])]
        if dst:
            torch._foreach_copy_(dst, src)

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
        self._settle(slot)
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
            "snapshot_lens": [max(n, 0) for n in self.snapshot_lens[slot]],
            "pending": sorted(self._pending[slot]),
        }
        return SlotState(tokens, tensors, meta, held)

    def import_slot(self, slot: int, state: SlotState) -> None:
        self._settle(slot)
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
        self._settle(slot)
        self.live_len[slot] = 0
        self.snapshot_lens[slot] = [0] * self.snapshots
        self._pending[slot].clear()

    # -- decode ahead (worker/device/graphed_lm.py; module doc) ----------------------------------

    def reserve_ahead(self, rows: int) -> None:
        """Backups for steps launched ahead over at most ``rows`` slots (0: none)."""
        self.ahead_rows = rows
        self._ahead_slots = ()
        if rows <= 0:
            self._backup_conv = self._backup_recurrent = None
            return
        conv, recurrent = self.all_conv, self.all_recurrent
        shape = (rows, conv.shape[0])
        self._backup_conv = torch.empty(
            (*shape, *conv.shape[2:]), device=conv.device, dtype=conv.dtype
        )
        self._backup_recurrent = torch.empty(
            (*shape, *recurrent.shape[2:]), device=recurrent.device, dtype=recurrent.dtype
        )

    @property
    def ahead_slots(self) -> tuple[int, ...]:
        """The slots whose device state a step launched ahead advanced (backed up)."""
        return self._ahead_slots

    def back_up_ahead(self, slots: Sequence[int]) -> None:
        """Queue (current stream: the one that runs the step launched ahead, before it) the
        copy of ``slots``' live DeltaNet states into the backup."""
        assert self._backup_conv is not None and self._backup_recurrent is not None
        if self._ahead_slots:
            raise RuntimeError(f"slots {self._ahead_slots} still run ahead")
        if len(slots) > self.ahead_rows:
            raise ValueError(f"{len(slots)} rows ahead, the backup holds {self.ahead_rows}")
        for row, slot in enumerate(slots):
            self._backup_conv[row].copy_(self.all_conv[:, slot])
            self._backup_recurrent[row].copy_(self.all_recurrent[:, slot])
        self._ahead_slots = tuple(slots)

    def keep_ahead(self) -> None:
        """The step launched ahead is the engine's next step (its begin_step / end_step count
        the token): the backup is not needed any more."""
        self._ahead_slots = ()

    def restore_ahead(self) -> None:
        """A miss: the backed-up states back into their slots (current stream, after the step
        launched ahead: the caller waited for it)."""
        assert self._backup_conv is not None and self._backup_recurrent is not None
        for row, slot in enumerate(self._ahead_slots):
            self.all_conv[:, slot].copy_(self._backup_conv[row])
            self.all_recurrent[:, slot].copy_(self._backup_recurrent[row])
        self._ahead_slots = ()

    def reads_state_before(self, step: StepInput) -> bool:
        """Whether ``step`` wants a slot's live state as it was before the step (a prefix-pool
        state at its first token): a step launched ahead over it cannot be used."""
        return any(
            capture.slot == slot and capture.tokens == cached and not capture.written
            for capture in self._state_captures
            for slot, cached in zip(step.slots, step.cached_lens, strict=True)
        )

    def _settle(self, *slots: int) -> None:
        """No step launched ahead may still advance ``slots``' state: drop it (the wrapper
        waits for it, then ``restore_ahead``)."""
        if not self._ahead_slots or not set(slots) & set(self._ahead_slots):
            return
        if self.settle is not None:
            self.settle()
        if self._ahead_slots:  # no wrapper (or it kept them): put the states back here
            self.restore_ahead()
