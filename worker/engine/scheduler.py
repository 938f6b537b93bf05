"""The step plan (pure: plain data in, a frozen plan out; no torch, no I/O).

Two decisions are made before every engine step:

1. `plan_admission`: which queued items start now. Rules, in queue order:
   - items without a request id form one lane, served strictly one at a time in arrival
     order (the seed protocol): the first such item starts only when no id-less
     generate is running, and later id-less items wait behind it;
   - work on one named session is serialised in arrival order: an item for a session
     starts only when that session has nothing running and nothing earlier still queued
     (a second generate on a busy session waits; it is never refused or interleaved);
   - an item that needs a KV slot (an anonymous generate, or the first use of a named
     session while there is room for one) waits while no slot is free; anonymous items
     keep their order among themselves.
2. `plan_step`: what one forward pass computes: every running sequence that is decoding
   feeds its one pending token, plus at most one prefill chunk (the oldest sequence
   still prefilling, at most `prefill_chunk` tokens), so a long prompt delays the
   decoders by one chunk at most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedItem:
    """A request waiting to start."""

    key: int  # the engine's handle
    session: str | None  # named session, or None for the anonymous (scratch) kind
    in_order_lane: bool  # True when the request had no id (seed one-at-a-time order)
    is_generate: bool  # generates run for many steps; other ops finish when started
    needs_slot: bool  # starting it takes a free KV slot


@dataclass(frozen=True)
class RunningItem:
    """A generate in flight."""

    key: int
    session: str | None
    in_order_lane: bool
    prefill_remaining: int  # prompt tokens not yet fed; 0 = decoding


@dataclass(frozen=True)
class PrefillChunk:
    key: int
    length: int


@dataclass(frozen=True)
class StepPlan:
    """One forward pass: `decode` sequences feed one token each, plus `prefill`."""

    decode: tuple[int, ...]
    prefill: PrefillChunk | None

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


def plan_admission(
    queue: Sequence[QueuedItem], running: Sequence[RunningItem], free_slots: int
) -> tuple[int, ...]:
    """Keys of the queued items to start now, in queue order (see the module docstring)."""
    busy_sessions = {r.session for r in running if r.session is not None}
    lane_blocked = any(r.in_order_lane for r in running)
    anon_blocked = False  # an earlier anonymous generate waits for a slot
    admitted: list[int] = []
    for item in queue:
        blocked = item.in_order_lane and lane_blocked
        if item.session is not None:
            blocked = blocked or item.session in busy_sessions
            busy_sessions.add(item.session)  # later items for it queue behind this one
        if not blocked and item.needs_slot:
            waits_for_slot = free_slots <= 0 or (item.session is None and anon_blocked)
            if waits_for_slot:
                blocked = True
                anon_blocked = anon_blocked or item.session is None
        if item.in_order_lane and (blocked or item.is_generate):
            lane_blocked = True  # later id-less items wait for this one to finish
        if blocked:
            continue
        if item.needs_slot:
            free_slots -= 1
        admitted.append(item.key)
    return tuple(admitted)


def plan_step(running: Sequence[RunningItem], prefill_chunk: int) -> StepPlan:
    """The next forward pass over `running` (in arrival order)."""
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    decode = tuple(r.key for r in running if r.prefill_remaining == 0)
    prefill = None
    for r in running:
        if r.prefill_remaining > 0:
            prefill = PrefillChunk(r.key, min(r.prefill_remaining, prefill_chunk))
            break
    return StepPlan(decode, prefill)
