"""Sessions and the slot pool.

A session's cache holds exactly its resident ids, in order (position of the next token ==
len(resident_ids)), wherever that cache is: in a device slot (``slot``), or, for an idle named
session when slots are short, in host memory or on disk (worker/engine/tiers.py). A dirty
session (a failed step, a stop-trimmed turn, a cancelled or failed prefill) is emptied by its
next request.

Counts: ``max_sessions`` sessions in all, named ones at most ``max_sessions - 1`` (one is
always left for anonymous, scratch, requests); ``max_resident`` device slots (default
``max_sessions``, then every named session keeps its slot). A named session takes a slot on
its first generate and keeps it until it is closed or, with ``max_resident < max_sessions``,
its slot is given to another session while it is idle. An anonymous request borrows a free
slot for its duration and starts from an empty cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Session:
    """A cache and its resident ids. ``name`` is None for an anonymous (scratch) one;
    ``slot`` is None while a named session's cache is off the device (or empty)."""

    slot: int | None
    name: str | None
    resident_ids: list[int] = field(default_factory=list)
    dirty: bool = False
    last_used: int = 0  # the engine's clock when a request last started or ended on it

    def clear(self) -> None:
        self.resident_ids.clear()
        self.dirty = False

    @property
    def version(self) -> int:
        """Names the cache's contents: a cache is a function of its ids (when not dirty)."""
        return hash(tuple(self.resident_ids))


class SessionPool:
    """Named sessions and free slots. Pure bookkeeping, no tensors."""

    def __init__(self, max_sessions: int, max_resident: int | None = None) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        resident = max_sessions if max_resident is None else max_resident
        if not 1 <= resident <= max_sessions:
            raise ValueError(f"max_resident must be in [1, {max_sessions}], got {resident}")
        self.max_sessions = max_sessions
        self.max_resident = resident
        self.named: dict[str, Session] = {}
        self._free: list[int] = list(range(resident - 1, -1, -1))  # pop() -> lowest slot

    @property
    def max_named(self) -> int:
        return self.max_sessions - 1  # one always left for anonymous requests

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def tiered(self) -> bool:
        """Whether idle named sessions give their slots up (fewer slots than sessions)."""
        return self.max_resident < self.max_sessions

    def can_create_named(self) -> bool:
        """Whether one more named session is allowed at all (a slot may still be busy)."""
        return len(self.named) < self.max_named

    def get(self, name: str) -> Session | None:
        return self.named.get(name)

    def open_named(self, name: str) -> Session:
        """The named session, created without a slot if new (caller checked capacity)."""
        session = self.named.get(name)
        if session is None:
            if not self.can_create_named():
                raise RuntimeError("no room for a new named session")
            session = Session(slot=None, name=name)
            self.named[name] = session
        return session

    def attach(self, session: Session) -> int:
        """Give ``session`` a free slot (caller made sure there is one)."""
        if session.slot is None:
            if not self._free:
                raise RuntimeError("no free slot")
            session.slot = self._free.pop()
        return session.slot

    def detach(self, session: Session) -> None:
        """Take a named session's slot back (its cache went elsewhere or was dropped)."""
        if session.slot is not None:
            self._free.append(session.slot)
            session.slot = None

    def close_named(self, name: str) -> bool:
        """Forget a named session, freeing its slot; False if there was none (idempotent)."""
        session = self.named.pop(name, None)
        if session is None:
            return False
        session.clear()
        self.detach(session)
        return True

    def borrow(self) -> Session:
        """An empty anonymous session on a free slot (caller checked `free_slots`)."""
        if not self._free:
            raise RuntimeError("no free slot")
        return Session(slot=self._free.pop(), name=None)

    def give_back(self, session: Session) -> None:
        """Return an anonymous session's slot."""
        if session.name is not None:
            raise ValueError("named sessions are freed with close_named")
        session.clear()
        self.detach(session)
