"""Shared prompt prefixes: the KV of full blocks of prompts, reused by any later prompt that
starts with the same blocks.

Block b of a prompt is its tokens [b * B, (b + 1) * B). Its key is a chained hash: blake2b of
the previous block's key and the block's ids, so a key names the block's ids *and* every id
before it (hence its position). The entry also keeps its ids and parent key, compared on a
hit, so a hash collision can never hand out another prompt's KV.

Storage is a pool of rows preallocated once under the budget (``KVCache.make_pool``: per
attention layer [kv_heads, rows, head_dim]); a block owns B consecutive rows, one per
position, in every layer, full and sliding alike. A session reusing L tokens (L a block end)
needs full-layer KV for [0, L) and, for its rings to be exactly what a prefill would have
left, sliding-layer KV for [L - R, L) (R: the largest ring). So the sliding rows of every
block are kept, not only of the last ones: any block end can be where a later prompt
diverges.

Filling the pool costs no extra pass: before a prefill step the engine asks ``begin`` for the
prompt's blocks that step completes; their positions inside the step are captured by the
attention layers as they store the step's keys (``PoolCapture``, worker/layers/kv.py: one
copy per layer, before a ring drops anything: a slice where the rows are one run, else
``index_copy_``), and their positions from earlier
steps (a block the previous turn left half done) are copied from the slot first. A step
replayed from a CUDA graph (a short prefill) captures nothing: ``finish`` copies its positions
from the slot, whose rings still hold them. A sliding position no ring held any more is
missing from its block (``Block.sliding_from``); ``plan`` cuts L back to the last block end
whose [L - R, L) is complete and says ``truncated`` when it had to.

Entries are read only; a session copies them into its own slot (the fixed-slot KV layout has
no shared pages): a device copy of the reused KV instead of a prefill. A session that diverges
inside a block reuses the blocks before it and prefills from there, so a shared block is never
written. Eviction is LRU by block; a hit or an insert touches a chain from its last block to
its first, so a chain's descendants go before it.

Block size: 256 tokens (``DEFAULT_BLOCK``). Agents' prompts share a long system prompt and
tools (1-20k tokens) and diverge at the first user message; a block is reused whole or not
at all, so a block loses on average half a block of the shared part (128 tokens: under 2% of
an 8k prefix, ~10% of pi's 1,375). The copies are per layer whatever the block size; a
smaller block costs host work per block (a hash, a dict entry, the ids compared on a hit).
256 divides every prefill chunk (512 CPU, 2048 CUDA), so chunk ends fall on block ends.

Memory: a pool row holds every layer's K and V of one position; on Gemma 4 31B that is
0.9 MB (the 50 sliding layers' 16 KV heads are 90% of it), 231 MB per block, so an 8k shared
prefix takes 7.2 GB.

A hybrid cache (qwen3_5_moe, worker/layers/hybrid_cache.py) keeps its full layers' KV here the
same way, and a block end can also hold the DeltaNet state (conv + recurrent, every linear
layer) after it (``Block.state``, a row of the cache's pool of states). The state cannot be
rebuilt from KV, so a reuse ends only at a block end that has one: ``plan`` cuts back to the
last such block end of the matched chain (``truncated`` when that is short of the chain). A
state is 61 MiB on the 35B-A3B shape against 5 MiB for a block's KV (10 full layers, 2 KV
heads of 256), so not every block end gets one. The prefill keeps states where they are free
or where later prompts are known to need them (``state_points``, ``_begin_states``):

- every prefill step's end that is a block end (chunks of 2048 or 512 are multiples of 256:
  a copy of the live state after the step, no split);
- the prompt's last block end before its final token: a prompt is reused up to its final
  token, so this is where an identical or longer prompt (a stateless client resending the
  conversation) and one diverging in the last block (an agent's new session sharing 7,936 of
  8,192 tokens) resume;
- the block end where the prompt left the cached chain (``PrefixPlan.matched``), a branch
  point: the next prompt sharing as much (the third session with the same system prompt)
  resumes there instead of at the chunk end below it.

A state inside a step comes out of the eager DeltaNet prefill's chunked pass when it sits a
multiple of 64 rows into the step (``DeltaNetLayerCache.free_split``: a prompt prefilled from 0
or from a block end), else the prefill splits there (any number, written straight into the
pool row); a step replayed from a prefill graph takes one snapshot inside
its rows, the slot's own rollback snapshot first, so a pool state there may be skipped (that
block end then has none). States are LRU too, on their own (a hit touches the state it used);
evicting a block frees its state, evicting a state leaves its block (usable as far as an
earlier state reaches). Budget: one state per ``BLOCKS_PER_STATE`` (4) blocks, the rest
blocks: per prompt the policy keeps len / 2048 + 1-2 states for len / 256 blocks (an 8k
prompt: 6 states, 32 blocks), and each further session sharing a prefix adds a block or two
and a state or two; so 4 blocks a state leaves room for both. The 8 GiB default on the 35B
shape: 100 states and 410 blocks (105k tokens of KV).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.layers.hybrid_cache import StateCapture
from worker.layers.kv import PoolCapture, run_start

DEFAULT_BLOCK = 256
BLOCKS_PER_STATE = 4  # a hybrid cache's budget: one DeltaNet state per 4 blocks (module doc)
_ROOT = b"tokenpipe-prefix-root"


def block_keys(ids: Sequence[int], block: int) -> list[bytes]:
    """The chained key of each full block of ``ids``."""
    keys: list[bytes] = []
    parent = _ROOT
    for start in range(0, len(ids) - block + 1, block):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", ids[start : start + block]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass
class Block:
    ids: tuple[int, ...]
    parent: bytes
    index: int  # pool rows [index * B, (index + 1) * B)
    start: int  # its first position
    sliding_from: int  # the sliding layers' rows hold positions [sliding_from, start + B)
    state: int | None = None  # a hybrid cache's pool state after the block (its end), if kept


@dataclass(frozen=True)
class PrefixPlan:
    """Reuse ``tokens`` prompt tokens from ``keys`` (the blocks covering them)."""

    tokens: int
    keys: tuple[bytes, ...]
    truncated: bool  # the chain went further, but a ring or a DeltaNet state was missing there
    matched: int = 0  # tokens of the cached chain the prompt starts with (before any cut)


@dataclass
class PendingBlocks:
    """Blocks ``begin`` gave pool rows for, inserted by ``finish`` once the step ran."""

    keys: list[bytes]
    blocks: list[Block]
    capture: PoolCapture | None  # positions [cap_start, cap_end) of the step
    cap_start: int
    cap_end: int
    next_block: int  # the prompt's next block to offer after this step
    # a hybrid cache's states this step writes: (the key of the block they end, the capture)
    states: list[tuple[bytes, StateCapture]] = field(default_factory=list)


class PrefixCache:
    """Blocks in a device pool of ``budget_bytes``, least recently used first."""

    def __init__(self, kv: Any, budget_bytes: int, block: int = DEFAULT_BLOCK) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        # a hybrid cache (qwen3_5_moe): the full layers' KV in its KVCache, DeltaNet states
        self.states: Any = kv if hasattr(kv, "state_bytes") else None
        self.kv = kv.kv if self.states is not None else kv
        self.block = block
        self.budget_bytes = budget_bytes
        self.block_bytes: int = self.kv.pool_row_bytes * block
        self.state_bytes: int = self.states.state_bytes if self.states is not None else 0
        self.capacity, self.state_capacity = self._capacities()
        if self.states is not None:
            self.states.make_pool(self.capacity * block, self.state_capacity)
        else:
            self.kv.make_pool(self.capacity * block)
        rings = [size for size, _ in self.kv.rings]
        self.ring = max(rings) if rings else None  # None: no sliding layers
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.state_lru: OrderedDict[bytes, int] = OrderedDict()  # block key -> its state row
        self.forget()

    def _capacities(self) -> tuple[int, int]:
        """(blocks, states) the budget holds: a hybrid cache's one state per
        ``BLOCKS_PER_STATE`` blocks, the rest of the budget blocks (none without a state)."""
        if not self.block_bytes:
            return 0, 0
        if self.states is None:
            return self.budget_bytes // self.block_bytes, 0
        states = self.budget_bytes // (self.state_bytes + BLOCKS_PER_STATE * self.block_bytes)
        if states == 0:
            return 0, 0
        return (self.budget_bytes - states * self.state_bytes) // self.block_bytes, states

    def forget(self) -> None:
        """Drop every block and state and zero the counters (the pool's memory stays)."""
        self.blocks.clear()
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() -> lowest index
        self.state_lru.clear()
        self._free_states = list(range(self.state_capacity - 1, -1, -1))
        self.hits = self.hit_tokens = 0  # blocks reused, their tokens
        self.inserts = self.evictions = self.truncations = 0
        self.state_inserts = self.state_evictions = 0

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes + len(self.state_lru) * self.state_bytes

    # -- lookup --------------------------------------------------------------------------------

    def plan(self, prompt: Sequence[int], keys: Sequence[bytes], limit: int) -> PrefixPlan:
        """How many of the first ``limit`` prompt tokens the cached blocks give (pure)."""
        chain: list[bytes] = []
        parent = _ROOT
        for b, key in enumerate(keys):
            entry = self.blocks.get(key)
            if entry is None or entry.parent != parent:
                break
            if entry.ids != tuple(prompt[b * self.block : (b + 1) * self.block]):
                break
            chain.append(key)
            parent = key
        reach = min(len(chain) * self.block, limit) // self.block * self.block
        tokens = reach
        while tokens > 0 and not self._resumable(chain, tokens):
            tokens -= self.block
        used = tokens // self.block
        return PrefixPlan(
            tokens, tuple(chain[:used]), truncated=tokens < reach, matched=len(chain) * self.block
        )

    def _resumable(self, chain: Sequence[bytes], tokens: int) -> bool:
        """Whether a slot can be rebuilt at ``tokens`` (a block end) from the chain's blocks:
        the rings' rows, a hybrid cache's state at that block end."""
        if self.states is not None and self.blocks[chain[tokens // self.block - 1]].state is None:
            return False
        return self._rings_covered(chain, tokens)

    def _rings_covered(self, chain: Sequence[bytes], tokens: int) -> bool:
        """Whether the blocks hold sliding rows for [tokens - R, tokens)."""
        if self.ring is None:
            return True
        low = max(0, tokens - self.ring)
        for b in range(low // self.block, tokens // self.block):
            entry = self.blocks[chain[b]]
            if entry.sliding_from > max(entry.start, low):
                return False
        return True

    def apply(self, plan: PrefixPlan, slot: int, keep: int) -> None:
        """Copy the plan's blocks into ``slot``, which already holds ``keep`` tokens of the
        same prompt: full layers [keep, tokens), sliding rings [tokens - R, tokens)."""
        tokens = plan.tokens
        low = tokens if self.ring is None else max(0, tokens - self.ring)
        full = (keep, tokens, self._rows(plan.keys, keep, tokens))
        sliding = (low, tokens, self._rows(plan.keys, low, tokens))
        self.kv.pool_to_slot(slot, full, sliding)
        if self.states is not None:  # the DeltaNet state at the reuse's end
            last = plan.keys[-1]
            row = self.blocks[last].state
            assert row is not None  # plan: no reuse ends at a block without one
            self.states.pool_state_to_slot(slot, row, tokens)
            self.state_lru.move_to_end(last)
        self._touch(plan.keys)
        self.hits += len(plan.keys)
        self.hit_tokens += tokens - keep

    def _rows(self, keys: Sequence[bytes], start: int, end: int) -> torch.Tensor:
        """Pool rows of positions [start, end) of the chain ``keys`` (on the pool's device)."""
        return self._index(
            [
                self.blocks[keys[p // self.block]].index * self.block + p % self.block
                for p in range(start, end)
            ]
        )

    def _index(self, rows: list[int]) -> torch.Tensor:
        device = self.kv.layers[0].k.device
        host = torch.tensor(rows, dtype=torch.int64)
        if device.type == "cuda":  # from pinned memory: no wait for the stream
            return host.pin_memory().to(device, non_blocking=True)
        return host

    def _touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    # -- insertion -----------------------------------------------------------------------------

    def state_points(self, prompt_len: int, plan: PrefixPlan) -> tuple[int, ...]:
        """Block ends of a prompt inside its prefill chunks where a hybrid cache keeps a state
        (module doc): the last one before the prompt's final token, and where the prompt
        leaves the cached chain (``plan.matched``). Empty for a plain KV cache."""
        if self.states is None:
            return ()
        last = (prompt_len - 1) // self.block * self.block
        points = {last, plan.matched if plan.matched < prompt_len // self.block * self.block else 0}
        return tuple(sorted(p for p in points if p > 0))

    def begin(
        self,
        prompt: Sequence[int],
        keys: Sequence[bytes],
        slot: int,
        next_block: int,
        cached: int,
        new: int,
        state_points: Sequence[int] = (),
    ) -> PendingBlocks | None:
        """Before a step that prefills ``new`` prompt tokens after the slot's ``cached``: pool
        rows for the prompt's blocks from ``next_block`` on that the step completes and the
        cache lacks, a capture of their positions inside the step (``kv.set_capture``), and
        their positions before it copied from the slot now; with a hybrid cache also state rows
        for the block ends of ``state_points`` and the step's end that the step passes
        (``set_state_captures``). None: nothing to add."""
        pending = self._begin_blocks(prompt, keys, slot, next_block, cached, new)
        if self.states is None:
            return pending
        states = self._begin_states(keys, slot, cached, new, state_points, pending)
        if not states:
            return pending
        if pending is None:
            pending = PendingBlocks([], [], None, 0, 0, next_block)
        pending.states = states
        self.states.set_state_captures([capture for _, capture in states])
        return pending

    def _begin_blocks(
        self,
        prompt: Sequence[int],
        keys: Sequence[bytes],
        slot: int,
        next_block: int,
        cached: int,
        new: int,
    ) -> PendingBlocks | None:
        block = self.block
        last = min(len(keys), (cached + new) // block)  # blocks the step completes
        b = next_block
        while b < last and keys[b] in self.blocks:
            b += 1
        if b >= last:
            return None
        self._touch(keys[:b])
        if b > 0 and keys[b - 1] not in self.blocks:
            return PendingBlocks([], [], None, 0, 0, last)  # its chain is gone: unreachable
        chain = set(keys[:last])
        pending = PendingBlocks([], [], None, 0, 0, last)
        parent = keys[b - 1] if b > 0 else _ROOT
        while b < last and keys[b] not in self.blocks:
            index = self._allocate(chain)
            if index is None:
                break
            start = b * block
            entry = Block(tuple(prompt[start : start + block]), parent, index, start, start)
            pending.keys.append(keys[b])
            pending.blocks.append(entry)
            parent = keys[b]
            b += 1
        if not pending.blocks:
            pending.next_block = b
            return pending
        pending.next_block = b
        first, end = pending.blocks[0].start, b * block
        if first < cached:  # positions earlier steps wrote: from the slot, as far as it holds
            reach, head_end = self._slot_reach(cached), min(cached, end)
            rows = self._block_rows(pending, first, head_end)
            self.kv.slot_to_pool(slot, first, head_end, rows, reach)
            for entry in pending.blocks:
                if entry.start < cached:
                    entry.sliding_from = min(max(entry.start, reach), entry.start + block)
        pending.cap_start, pending.cap_end = max(first, cached), end
        if pending.cap_end > pending.cap_start:
            rows = self._row_list(pending, pending.cap_start, pending.cap_end)
            pending.capture = PoolCapture(slot, pending.cap_start - cached, self._index(rows),
                                          run_start=run_start(rows))  # fmt: skip
            self.kv.set_capture(pending.capture)
        return pending

    def _begin_states(
        self,
        keys: Sequence[bytes],
        slot: int,
        cached: int,
        new: int,
        state_points: Sequence[int],
        pending: PendingBlocks | None,
    ) -> list[tuple[bytes, StateCapture]]:
        """State rows for the block ends this step passes (``state_points`` in [cached,
        cached + new], and the step's end) whose block is cached, or added by the step, and
        has no state yet."""
        end = cached + new
        adding = set(pending.keys) if pending is not None else set()
        out: list[tuple[bytes, StateCapture]] = []
        for point in sorted({end, *(p for p in state_points if cached <= p <= end)}):
            b = point // self.block - 1
            if point % self.block or point <= 0 or b >= len(keys):
                continue
            key = keys[b]
            entry = self.blocks.get(key)
            if key not in adding and (entry is None or entry.state is not None):
                continue
            row = self._allocate_state()
            if row is None:
                break
            out.append((key, StateCapture(slot, point, row)))
        return out

    def finish(self, pending: PendingBlocks, slot: int, cached: int, ok: bool) -> int:
        """After the step (``cached``: the slot's tokens now): insert the blocks ``begin``
        prepared (or give their rows back if the step failed) and the states it wrote.
        Returns the next block."""
        self.kv.set_capture(None)
        if self.states is not None:
            self.states.set_state_captures([])
        if not ok:
            self._free.extend(entry.index for entry in pending.blocks)
            self._free_states.extend(capture.row for _, capture in pending.states)
            return pending.next_block - len(pending.blocks)
        capture = pending.capture
        if capture is not None and not capture.written:  # a graph replay: copy from the slot
            reach = self._slot_reach(cached)
            self.kv.slot_to_pool(slot, pending.cap_start, pending.cap_end, capture.rows, reach)
            for entry in pending.blocks:
                if entry.start + self.block > pending.cap_start:
                    lowest = max(reach, entry.sliding_from)
                    entry.sliding_from = min(lowest, entry.start + self.block)
        for key, entry in zip(pending.keys, pending.blocks, strict=True):
            self.blocks[key] = entry
            self.inserts += 1
        self._touch(pending.keys)
        for key, state in pending.states:
            holder = self.blocks.get(key)
            if not state.written or holder is None or holder.state is not None:
                self._free_states.append(state.row)  # not taken (a graph's one snapshot)
                continue
            holder.state = state.row
            self.state_lru[key] = state.row
            self.state_inserts += 1
        return pending.next_block

    def _slot_reach(self, cached: int) -> int:
        """The first position every ring of a slot holding ``cached`` tokens surely has."""
        kept = self.kv.ring_kept
        return 0 if kept is None else max(0, cached - kept)

    def _block_rows(self, pending: PendingBlocks, start: int, end: int) -> torch.Tensor:
        return self._index(self._row_list(pending, start, end))

    def _row_list(self, pending: PendingBlocks, start: int, end: int) -> list[int]:
        """The pool rows of positions [start, end) of the pending blocks."""
        base = pending.blocks[0].start
        return [
            pending.blocks[(p - base) // self.block].index * self.block + p % self.block
            for p in range(start, end)
        ]

    def _allocate(self, keep: set[bytes]) -> int | None:
        """A free pool block, evicting the least recently used one outside ``keep``."""
        while not self._free:
            victim = next((k for k in self.blocks if k not in keep), None)
            if victim is None:
                return None
            evicted = self.blocks.pop(victim)
            self._free.append(evicted.index)
            if evicted.state is not None:
                self._free_states.append(self.state_lru.pop(victim))
            self.evictions += 1
        return self._free.pop()

    def _allocate_state(self) -> int | None:
        """A free state row, taken from the least recently used state if none is free."""
        if not self._free_states and self.state_lru:
            key, row = self.state_lru.popitem(last=False)
            self.blocks[key].state = None
            self._free_states.append(row)
            self.state_evictions += 1
        return self._free_states.pop() if self._free_states else None

    def stats(self) -> dict[str, int]:
        return {
            "block_tokens": self.block,
            "blocks": len(self.blocks),
            "capacity_blocks": self.capacity,
            "bytes": self.nbytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "hit_tokens": self.hit_tokens,
            "inserts": self.inserts,
            "evictions": self.evictions,
            "truncated": self.truncations,
            **(
                {
                    "states": len(self.state_lru),
                    "capacity_states": self.state_capacity,
                    "state_inserts": self.state_inserts,
                    "state_evictions": self.state_evictions,
                }
                if self.states is not None
                else {}
            ),
        }
