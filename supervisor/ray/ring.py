"""The consistent-hash ring that maps a session key to a replica (pure).

Each node (a replica's stable name, e.g. `rank-0`) owns `VNODES` points on a 64-bit circle;
a key belongs to the first point at or after its own hash. Adding a node takes over only the
arcs that end at its points (about 1/N of the keys); removing one hands only its own keys to
the next points. Hashes are blake2b, so every process (each front end, each restart) agrees.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable

VNODES = 160
"""Points per node: the load of N nodes stays within a few percent of 1/N each."""


def point(text: str) -> int:
    """The position of `text` on the circle: 64 bits of its blake2b digest."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """An immutable ring over `nodes` (names; order and duplicates do not matter)."""

    def __init__(self, nodes: Iterable[str], vnodes: int = VNODES) -> None:
        self.nodes = frozenset(nodes)
        ring = sorted((point(f"{node}#{i}"), node) for node in self.nodes for i in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [node for _, node in ring]

    def owner(self, key: str) -> str | None:
        """The node that holds `key`; None on an empty ring."""
        if not self._points:
            return None
        index = bisect.bisect_left(self._points, point(key))
        return self._owners[index % len(self._owners)]
