"""Shared prompt prefixes: the KV of full blocks of prompts, reused by any later prompt that
starts with the same blocks.

Block b of a prompt is its tokens [b * B, (b + 1) * B). Its key is a chained hash: blake2b of
the previous block's key and the block's ids, so a key names the block's ids *and* every id
before it (hence its position). The entry also keeps its ids and parent key, compared on a
hit, so a hash collision can never hand out another prompt's KV.

An entry holds the block's KV in every full layer and, in the sliding layers, its last
min(B, R) positions (its *tail*; R: the largest ring) when the slot's rings still held them
when the block was copied (a prefill chunk longer than a ring overwrites the start of the
chunk). A session reusing L tokens (L a block end) needs full-layer KV for [0, L) and, for its
rings to be exactly what a prefill would have left, sliding-layer KV for [L - R, L): the tail
of the last block, and when R > B whole earlier blocks. ``plan`` cuts L back to the last
block end where that holds and says ``truncated`` when it had to.

Entries are read only; a session copies them into its own slot (the fixed-slot KV layout has
no shared pages), which costs a device copy of the reused KV instead of a prefill. A session
that diverges inside a block reuses the blocks before it and prefills from there, so a shared
block is never written. Eviction is LRU by block; a hit touches a chain from its last block
to its first, so a chain's descendants go before it.

Block size: 256 tokens (``DEFAULT_BLOCK``). Agents' prompts share a long system prompt and
tools (1-20k tokens) and diverge at the first user message; a block is reused whole or not
at all, so a block loses on average half a block of the shared part (128 tokens: under 2% of
an 8k prefix, ~10% of pi's 1,375). Smaller blocks cost more per-block work on the step path
(one copy per layer and block, a hash and a dict entry): 16-token blocks would make an 8k
prefix 512 blocks x 120 copies on Gemma 4 31B. 256 keeps that at 32 blocks and also divides
every prefill chunk (512 CPU, 2048 CUDA), so chunk ends fall on block ends.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_BLOCK = 256
_ROOT = b"tokenpipe-prefix-root"

Span = list[tuple[torch.Tensor, torch.Tensor] | None]


def block_keys(ids: Sequence[int], block: int) -> list[bytes]:
    """The chained key of each full block of ``ids``."""
    keys: list[bytes] = []
    parent = _ROOT
    for start in range(0, len(ids) - block + 1, block):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b",".join(str(i).encode() for i in ids[start : start + block]))
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass
class Block:
    ids: tuple[int, ...]
    parent: bytes
    full: Span  # per layer: (k, v) [kv_heads, B, head_dim] for full layers, else None
    sliding: Span | None  # sliding layers' tail [kv_heads, tail, head_dim]; None: ring lost it
    nbytes: int


@dataclass(frozen=True)
class PrefixPlan:
    """Reuse ``tokens`` prompt tokens from ``keys`` (the blocks covering them)."""

    tokens: int
    keys: tuple[bytes, ...]
    truncated: bool  # the chain went further, but a sliding ring could not be rebuilt there


def _span_bytes(span: Span | None) -> int:
    if span is None:
        return 0
    return sum(k.numel() * k.element_size() * 2 for kv in span if kv is not None for k in kv[:1])


class PrefixCache:
    """Blocks on the engine's device under ``budget_bytes``, least recently used first."""

    def __init__(self, kv: Any, budget_bytes: int, block: int = DEFAULT_BLOCK) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.kv = kv
        self.block = block
        self.budget_bytes = budget_bytes
        rings = [size for size, _ in kv.rings]
        self.ring = max(rings) if rings else None  # None: no sliding layers
        # positions [cached - ring_kept, cached) are still in every ring of a slot
        self.ring_kept = min(rings) - kv.lookahead if rings else 0
        self.tail = min(block, self.ring) if self.ring is not None else 0
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.nbytes = 0
        self.hits = 0  # blocks reused
        self.hit_tokens = 0
        self.inserts = 0
        self.evictions = 0
        self.truncations = 0

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
        while tokens > 0 and not self._rings_covered(chain, tokens):
            tokens -= self.block
        used = tokens // self.block
        return PrefixPlan(tokens, tuple(chain[:used]), truncated=tokens < reach)

    def _rings_covered(self, chain: Sequence[bytes], tokens: int) -> bool:
        if self.ring is None:
            return True
        first = max(0, tokens - self.ring) // self.block
        last = tokens // self.block - 1
        return all(self.blocks[chain[b]].sliding is not None for b in range(first, last + 1))

    def apply(self, plan: PrefixPlan, slot: int, keep: int) -> None:
        """Copy the plan's blocks into ``slot``, which already holds ``keep`` tokens of the
        same prompt: full layers [keep, tokens), sliding rings [tokens - R, tokens)."""
        tokens, block = plan.tokens, self.block
        ring_start = 0 if self.ring is None else max(0, tokens - self.ring)
        for b, key in enumerate(plan.keys):
            entry = self.blocks[key]
            start, end = b * block, min((b + 1) * block, tokens)
            if end > keep:
                self.kv.write_span(slot, max(start, keep), end, entry.full, False, offset=start)
            if self.ring is not None and end > ring_start:
                assert entry.sliding is not None
                self.kv.write_span(
                    slot, max(start, ring_start), end, entry.sliding, True, offset=end - self.tail
                )
        for key in reversed(plan.keys):
            self.blocks.move_to_end(key)
        self.hits += len(plan.keys)
        self.hit_tokens += tokens - keep

    # -- insertion -----------------------------------------------------------------------------

    def insert(
        self, prompt: Sequence[int], keys: Sequence[bytes], slot: int, first: int, cached: int
    ) -> int:
        """Copy blocks ``first``.. of ``prompt`` that the slot now holds (``cached`` tokens)
        into the cache; returns the next block to consider. A block already cached is touched
        (and gains its sliding part if it lacked it and the ring still holds it)."""
        b = first
        parent = keys[b - 1] if b > 0 else _ROOT
        while b < len(keys) and (b + 1) * self.block <= cached:
            start, end = b * self.block, (b + 1) * self.block
            has_tail = self.ring is not None and end - self.tail >= cached - self.ring_kept
            entry = self.blocks.get(keys[b])
            if entry is None:
                full = self.kv.read_span(slot, start, end, False)
                sliding = self.kv.read_span(slot, end - self.tail, end, True) if has_tail else None
                nbytes = _span_bytes(full) + _span_bytes(sliding)
                ids = tuple(prompt[start:end])
                self.blocks[keys[b]] = Block(ids, parent, full, sliding, nbytes)
                self.nbytes += nbytes
                self.inserts += 1
            else:
                if entry.sliding is None and has_tail:
                    entry.sliding = self.kv.read_span(slot, end - self.tail, end, True)
                    extra = _span_bytes(entry.sliding)
                    entry.nbytes += extra
                    self.nbytes += extra
            parent = keys[b]
            b += 1
        for key in reversed(keys[:b]):
            if key in self.blocks:
                self.blocks.move_to_end(key)
        self._evict()
        return b

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self.blocks:
            _, entry = self.blocks.popitem(last=False)
            self.nbytes -= entry.nbytes
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        return {
            "block_tokens": self.block,
            "blocks": len(self.blocks),
            "bytes": self.nbytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "hit_tokens": self.hit_tokens,
            "inserts": self.inserts,
            "evictions": self.evictions,
            "truncated": self.truncations,
        }
