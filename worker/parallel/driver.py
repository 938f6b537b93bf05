"""Rank 0 drives, the followers repeat: the engine runs once, on rank 0, against a model and a
cache that send every state change to the other ranks before making it locally.

The commands (gloo broadcasts of small tuples, in the order rank 0 makes them):

    ("kv", num_slots, max_context, kwargs)            make the KV cache
    ("step", ids, positions, slots, cached, new)      one forward (the StepInput as lists)
    ("call", method, args)                            a cache method that changes state
    ("export", slot, tokens)                          each rank's SlotState gathered to rank 0
    ("import", slot)                                  each rank's part scattered from rank 0
    ("stop",)                                          exit

All ranks run the same forward on the same inputs; the collectives inside it (row-parallel
all-reduces, the logits' all-gather) keep them in step, and rank 0 alone samples.

A slot leaving the device (host/disk tiers, ``--session-dir``) is every rank's part of it:
``export_slot`` gathers the ranks' ``SlotState`` into one whose tensors are named
``r<rank>.<name>`` (so the tiers and the session files take it unchanged) and ``import_slot``
splits it back. The prefix cache (``make_pool``) is not offered through the driver: it is off
in a group for now.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from worker.layers.slot_state import SlotState
from worker.models.step import StepInput
from worker.parallel.group import TensorParallelGroup

_MIRRORED = frozenset({"truncate", "snapshot_at", "clear_slot"})
# slot_views: no pinned pool in a group (its states are merged from the ranks, pageable)
_NOT_IN_A_GROUP = frozenset(
    {"make_pool", "slot_to_pool", "pool_to_slot", "set_capture", "slot_views"}
)


def merge_states(states: list[SlotState]) -> SlotState:
    """The ranks' parts of one slot as one state (tensors ``r<rank>.<name>``)."""
    tensors = {
        f"r{rank}.{name}": t for rank, s in enumerate(states) for name, t in s.tensors.items()
    }
    return SlotState(states[0].tokens, tensors, {"ranks": [s.meta for s in states]})


def split_state(state: SlotState, world: int) -> list[SlotState]:
    """merge_states undone; a state of another group size is a ValueError."""
    metas = state.meta.get("ranks")
    if not isinstance(metas, list) or len(metas) != world:
        raise ValueError(f"a slot state of {len(metas or [])} ranks for a group of {world}")
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for key, tensor in state.tensors.items():
        rank, _, name = key.partition(".")
        parts[int(rank[1:])][name] = tensor
    return [SlotState(state.tokens, parts[r], metas[r]) for r in range(world)]


class DriverCache:
    """Rank 0's view of the group's cache: its own, with state changes sent to the others."""

    def __init__(self, local: Any, group: TensorParallelGroup) -> None:
        self.local = local
        self.group = group

    def __getattr__(self, name: str) -> Any:
        if name in _NOT_IN_A_GROUP:
            raise AttributeError(name)
        attr = getattr(self.local, name)
        if name in _MIRRORED:
            return functools.partial(self._mirrored, name)
        return attr

    def geometry(self) -> list[list[Any]]:
        """Rank 0's layers and the group size: saved sessions load into the same group."""
        geometry: list[list[Any]] = self.local.geometry()
        return [*geometry, ["tensor_parallel", self.group.world]]

    def export_slot(self, slot: int, tokens: int, buffer: Any = None) -> SlotState:
        """The ranks' states merged (pageable: ``buffer`` is not used; the caller keeps it)."""
        try:
            self.group.send(("export", slot, tokens))
            return merge_states(self.group.gather(self.local.export_slot(slot, tokens)))
        except Exception as exc:  # noqa: BLE001 - the group is broken
            self.group.lost(exc)

    def import_slot(self, slot: int, state: SlotState) -> None:
        parts = split_state(state, self.group.world)  # a bad copy: ValueError, nothing sent
        try:
            self.group.send(("import", slot))
            mine = self.group.scatter(parts)
        except Exception as exc:  # noqa: BLE001 - the group is broken
            self.group.lost(exc)
        self.local.import_slot(slot, mine)

    def _mirrored(self, name: str, *args: Any) -> Any:
        try:
            self.group.send(("call", name, args))
        except Exception as exc:  # noqa: BLE001 - the group is broken
            self.group.lost(exc)
        return getattr(self.local, name)(*args)


class DriverModel:
    """Rank 0's model: the model contract, each call mirrored on the followers."""

    def __init__(self, local: Any, group: TensorParallelGroup) -> None:
        self.local = local
        self.group = group

    def __getattr__(self, name: str) -> Any:  # config, device, prepare_for_cpu, ...
        return getattr(self.local, name)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        params: Iterator[torch.nn.Parameter] = self.local.parameters()
        return params

    def make_kv_cache(self, num_slots: int, max_context: int, **kwargs: Any) -> Any:
        if kwargs.get("device") == "meta":  # sizes only: nothing to mirror
            return self.local.make_kv_cache(num_slots, max_context, **kwargs)
        self.group.send(("kv", num_slots, max_context, kwargs))
        return DriverCache(self.local.make_kv_cache(num_slots, max_context, **kwargs), self.group)

    def __call__(self, step: StepInput, kv: DriverCache) -> torch.Tensor:
        try:
            self.group.send(
                (
                    "step",
                    step.input_ids.tolist(),
                    step.positions.tolist(),
                    list(step.slots),
                    list(step.cached_lens),
                    list(step.new_lens),
                )
            )
            logits: torch.Tensor = self.local(step, kv.local)
        except Exception as exc:  # noqa: BLE001 - a rank that failed has left the group
            self.group.lost(exc)
        return logits

    def close(self) -> None:
        self.group.stop()


def follow(model: Any, group: TensorParallelGroup, device: torch.device) -> int:
    """A follower's life after loading: repeat rank 0's commands until ("stop",)."""
    if device.type == "cpu":
        model.prepare_for_cpu()  # as the engine does on rank 0
    kv: Any = None
    while True:
        try:
            command = group.receive()
            op = command[0]
            if op == "stop":
                return 0
            if op == "kv":
                _, num_slots, max_context, kwargs = command
                kv = model.make_kv_cache(num_slots, max_context, **kwargs)
            elif op == "step":
                _, ids, positions, slots, cached, new = command
                step = StepInput(
                    input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
                    positions=torch.tensor(positions, dtype=torch.int64, device=device),
                    slots=slots,
                    cached_lens=cached,
                    new_lens=new,
                )
                with torch.inference_mode():
                    model(step, kv)
            elif op == "export":
                group.gather(kv.export_slot(command[1], command[2]))
            elif op == "import":
                kv.import_slot(command[1], group.scatter(None))
            elif op == "call":
                _, name, args = command
                getattr(kv, name)(*args)
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as exc:  # noqa: BLE001 - out of step with rank 0: leave the group
            group.lost(exc)
