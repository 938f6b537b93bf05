"""Where an idle named session's cache lives when it is not in a device slot.

Three tiers: a device slot (the engine's KV pool), host memory (``HostTier``: an LRU of
``SlotState`` copies under ``--host-cache-gb``, pinned on CUDA) and disk (``SessionStore``,
``--session-dir``). A session moves down when its slot is needed (``offload``) and back up
on its next turn (``take``). The newest copy of a session is always the highest one that
holds it: only a device slot changes a cache, an offload puts the slot's state in host
memory, and host memory overflows to disk by writing its newest copy.

Every copy carries the resident ids it describes (``version``: the session's change counter),
so a session never resumes from a copy of other tokens. No copy anywhere: the session's
resident ids are cleared and its next turn prefills from scratch (slow, never wrong).

Host copies live in the buffers of ``pool`` (``HostPool``, pinned once at start; a copy that
finds none free goes to pageable memory). Each holder of a state releases it once: the host
tier for the entries it drops, the disk writer for the writes it was given, and whoever
``take``s a state after its copy to the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from worker.engine.host_pool import HostBuffer, HostPool
from worker.engine.session_store import SessionStore, StoredSession
from worker.layers.slot_state import SlotState, to_host


@dataclass
class HostEntry:
    state: SlotState
    resident_ids: list[int]
    version: int  # the session's change counter when it was exported


class HostTier:
    """Slot states in host memory, least recently used first, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self.entries: OrderedDict[str, HostEntry] = OrderedDict()
        self.nbytes = 0

    def put(self, name: str, entry: HostEntry) -> list[tuple[str, HostEntry]]:
        """Keep ``entry`` (newest); return the entries pushed out (oldest first), which may
        include ``entry`` itself when it alone is over the budget. The caller owns those."""
        replaced = self.pop(name)
        if replaced is not None:
            replaced.state.release()
        self.entries[name] = entry
        self.nbytes += entry.state.nbytes
        out: list[tuple[str, HostEntry]] = []
        while self.nbytes > self.budget_bytes and self.entries:
            old_name, old = self.entries.popitem(last=False)
            self.nbytes -= old.state.nbytes
            out.append((old_name, old))
        return out

    def pop(self, name: str) -> HostEntry | None:
        entry = self.entries.pop(name, None)
        if entry is not None:
            self.nbytes -= entry.state.nbytes
        return entry

    def __contains__(self, name: str) -> bool:
        return name in self.entries


class SessionTiers:
    """Host memory and (optionally) disk for the engine's named sessions."""

    def __init__(
        self, host_budget_bytes: int, store: SessionStore | None, pool: HostPool | None = None
    ) -> None:
        self.host = HostTier(host_budget_bytes)
        self.store = store
        self.pool = pool
        self.offloads = 0
        self.reloads = 0
        self.dropped = 0  # caches lost for want of room (their sessions re-prefill)
        self._lost: list[str] = []  # dropped, not yet reported (take_lost)
        self.pinned_later = 0  # host copies moved from pageable memory into the pool at idle

    def buffer(
        self, nbytes: int, evict: bool, keep: Collection[str | None] = ()
    ) -> HostBuffer | None:
        """A pool buffer for a copy of ``nbytes`` (held once), or None: pageable memory. With
        ``evict``, an exhausted pool first pushes the least recently used host copy (not one of
        ``keep``: sessions about to come back) out: its
        buffer is free at once when it is on disk already or dropped (no --session-dir:
        ``take_lost`` names it); one still to be written frees its buffer only once written,
        so this copy goes to pageable memory (never waiting for the disk)."""
        if self.pool is None or nbytes > self.pool.buffer_bytes:
            return None
        buffer = self.pool.take(nbytes, count_miss=False)
        if buffer is None and evict:
            # the oldest host copy whose buffer only the tier holds (its buffer is free at once
            # when it is on disk already or dropped), else the oldest with a buffer
            pooled = [(n, e.state.buffer) for n, e in self.host.entries.items() if n not in keep]
            pooled = [(n, b) for n, b in pooled if b is not None]
            alone = [n for n, b in pooled if b.holders == 1]
            name = alone[0] if alone else pooled[0][0] if pooled else None
            if name is not None:
                old = self.host.pop(name)
                assert old is not None
                self._push_out(name, old)
                buffer = self.pool.take(nbytes, count_miss=False)
        if buffer is None and evict and self.store is not None and self.store.drop_a_prefetch():
            # a restored session's read-back (still on disk)
            buffer = self.pool.take(nbytes, count_miss=False)
        if buffer is None:
            self.pool.miss()
        return buffer

    def offload(
        self, name: str, state: SlotState, resident_ids: list[int], version: int
    ) -> list[str]:
        """A session's slot state (the caller's hold on it passes to the tier) moves to host
        memory. Returns the sessions whose caches are now nowhere (host memory full and no
        usable disk): their resident ids must be cleared."""
        self.offloads += 1
        for old_name, old in self.host.put(name, HostEntry(state, list(resident_ids), version)):
            self._push_out(old_name, old)
        return self.take_lost()

    def pin_one(self) -> bool:
        """Idle time: move the newest host copy in pageable memory (made when the pool was
        exhausted) into a free pool buffer, so that its session resumes at DMA speed. False
        when there is none or no buffer is free."""
        if self.pool is None:
            return False
        for name in reversed(self.host.entries):
            entry = self.host.entries[name]
            if entry.state.buffer is not None or entry.state.nbytes > self.pool.buffer_bytes:
                continue
            buffer = self.pool.take(0, count_miss=False)  # idle work: not a miss
            if buffer is None:
                return False
            tensors, held = to_host(entry.state.tensors, buffer)
            if held is None:  # does not fit the layout: leave it
                buffer.release()
                continue
            entry.state = SlotState(entry.state.tokens, tensors, entry.state.meta, held)
            self.pinned_later += 1
            return True
        return False

    def buffers_coming_back(self) -> bool:
        """A host copy waits in pageable memory for a buffer that a write or a device copy
        still holds (``pin_one`` will find it free soon)."""
        if self.pool is None:
            return False
        states = [e.state for e in self.host.entries.values()]
        pageable = any(s.buffer is None and s.nbytes <= self.pool.buffer_bytes for s in states)
        held = sum(1 for s in states if s.buffer is not None)  # for as long as they stay
        if self.store is not None:
            held += self.store.prefetched_buffers()
        return pageable and self.pool.free == 0 and len(self.pool.buffers) > held

    def take_lost(self) -> list[str]:
        """The sessions whose caches were dropped since the last call."""
        lost, self._lost = self._lost, []
        return lost

    def _push_out(self, name: str, old: HostEntry) -> None:
        """A host copy leaves host memory: to disk if it is not there yet, else dropped."""
        if self.store is not None and self.store.has_version(name, old.version):
            old.state.release()  # already on disk as it is
        elif self.store is not None and self.store.writable:
            self.store.write(name, old.state, old.resident_ids, old.version)  # the writer's now
        else:
            old.state.release()
            self.dropped += 1
            self._lost.append(name)

    def take(self, name: str) -> tuple[SlotState, list[int]] | None:
        """The newest copy of ``name``'s cache and the ids it holds, out of its tier (a disk
        copy stays on disk), or None (none, or a file that failed its checks: logged). The
        caller holds the state: ``release`` it after its copy to the device."""
        entry = self.host.pop(name)
        if entry is not None:
            self.reloads += 1
            return entry.state, entry.resident_ids
        if self.store is None:
            return None
        stored: StoredSession | None = self.store.read(name)
        if stored is None:
            return None
        self.reloads += 1
        return stored.state, stored.resident_ids

    def where(self, name: str) -> str | None:
        if name in self.host:
            return "host"
        if self.store is not None and self.store.holds(name):
            return "disk"
        return None

    def forget(self, name: str, delete_file: bool) -> None:
        """Drop every copy (reset: the host one; close: the file too)."""
        entry = self.host.pop(name)
        if entry is not None:
            entry.state.release()
        if delete_file and self.store is not None:
            self.store.delete(name)

    def stats(self) -> dict[str, int]:
        return {
            "host_sessions": len(self.host.entries),
            "host_bytes": self.host.nbytes,
            "host_budget_bytes": self.host.budget_bytes,
            "offloads": self.offloads,
            "reloads": self.reloads,
            "dropped_caches": self.dropped,
            "host_pinned_later": self.pinned_later,
            **(self.pool.stats() if self.pool is not None else {}),
        }
