"""The session mirror: each named session's resident token ids, as its worker reports them.

Invariant: after every `done` of a named-session request (sent with `return_resident`),
`resident(s)` equals the ids in the worker's KV for `s`. A restarted worker gets the session
back by prefilling exactly those ids (`rebuild_request`), so a conversation continued after a
crash sees the same cache as one that never crashed.
"""

from __future__ import annotations

from typing import Any


class SessionMirror:
    def __init__(self) -> None:
        self._resident: dict[str, list[int]] = {}

    def resident(self, session_id: str) -> list[int]:
        return self._resident.get(session_id, [])

    def apply(self, session_id: str, keep: int, append: list[int]) -> None:
        """The worker's session is now `old[:keep] + append`. When the mirror holds fewer than
        `keep` ids (a session the worker restored from its --session-dir: its ids were never
        seen here), the ids are unknown: the mirror forgets them rather than keep a wrong
        list (a rebuild from it would replace the worker's good saved copy)."""
        old = self._resident.get(session_id, [])
        if keep > len(old):
            self._resident.pop(session_id, None)
            return
        self._resident[session_id] = old[:keep] + list(append)

    def clear(self, session_id: str) -> None:
        self._resident[session_id] = []

    def drop(self, session_id: str) -> None:
        self._resident.pop(session_id, None)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._resident


def rebuild_request(session_id: str, resident_ids: list[int]) -> dict[str, Any]:
    """A prefill-only generate that puts `resident_ids` back in a fresh worker's session."""
    return {
        "op": "generate",
        "session_id": session_id,
        "prompt_segments": [{"ids": resident_ids}],
        "max_new_tokens": 0,
        "add_prefix": False,
        "return_resident": True,
    }
