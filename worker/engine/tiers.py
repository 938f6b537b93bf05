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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from worker.engine.session_store import SessionStore, StoredSession
from worker.layers.slot_state import SlotState


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
        include ``entry`` itself when it alone is over the budget."""
        self.pop(name)
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

    def __init__(self, host_budget_bytes: int, store: SessionStore | None) -> None:
        self.host = HostTier(host_budget_bytes)
        self.store = store
        self.offloads = 0
        self.reloads = 0
        self.dropped = 0  # caches lost for want of room (their sessions re-prefill)

    def offload(
        self, name: str, state: SlotState, resident_ids: list[int], version: int
    ) -> list[str]:
        """A session's slot state moves to host memory. Returns the sessions whose caches are
        now nowhere (host memory full and no usable disk): their resident ids must be cleared."""
        self.offloads += 1
        lost: list[str] = []
        for old_name, old in self.host.put(name, HostEntry(state, list(resident_ids), version)):
            if self.store is not None and self.store.has_version(old_name, old.version):
                continue  # already on disk as it is
            if self.store is not None and self.store.writable:
                self.store.write(old_name, old.state, old.resident_ids, old.version)
                continue
            self.dropped += 1
            lost.append(old_name)
        return lost

    def take(self, name: str) -> tuple[SlotState, list[int]] | None:
        """The newest copy of ``name``'s cache and the ids it holds, out of its tier (a disk
        copy stays on disk), or None (none, or a file that failed its checks: logged)."""
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
        self.host.pop(name)
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
        }
