"""Sessions and the slot pool.

A session owns one KV slot and the ids resident in it. Invariant: `resident_ids` is
exactly what the slot's KV holds, in order (position of the next token ==
len(resident_ids)). A dirty session (a failed step, a stop-trimmed turn, a cancelled or
failed prefill) is emptied by its next request.

Slots: `max_sessions` in all; named sessions may own at most `max_sessions - 1`, so one
slot is always left for anonymous (scratch) requests. An anonymous request borrows a
free slot for its duration and starts from an empty cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Session:
    """One KV slot and its resident ids. `name` is None for an anonymous (scratch) one."""

    slot: int
    name: str | None
    resident_ids: list[int] = field(default_factory=list)
    dirty: bool = False

    def clear(self) -> None:
        self.resident_ids.clear()
        self.dirty = False


class SessionPool:
    """Named sessions and free slots. Pure bookkeeping, no tensors."""

    def __init__(self, max_sessions: int) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.named: dict[str, Session] = {}
        self._free: list[int] = list(range(max_sessions - 1, -1, -1))  # pop() -> lowest slot

    @property
    def max_named(self) -> int:
        return self.max_sessions - 1  # one slot always left for anonymous requests

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def can_create_named(self) -> bool:
        """Whether one more named session is allowed at all (a slot may still be busy)."""
        return len(self.named) < self.max_named

    def get(self, name: str) -> Session | None:
        return self.named.get(name)

    def open_named(self, name: str) -> Session:
        """The named session, created on a free slot if new (caller checked capacity)."""
        session = self.named.get(name)
        if session is None:
            if not self.can_create_named() or not self._free:
                raise RuntimeError("no slot for a new named session")
            session = Session(slot=self._free.pop(), name=name)
            self.named[name] = session
        return session

    def close_named(self, name: str) -> bool:
        """Free a named session's slot; False if there was none (idempotent)."""
        session = self.named.pop(name, None)
        if session is None:
            return False
        session.clear()
        self._free.append(session.slot)
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
        self._free.append(session.slot)
