"""Where each live replica listens, as a front end knows it, and which one a request goes to
(pure: no Ray, no I/O).

Ray Serve's controller knows the running replicas (it starts, health-checks and replaces
them) and pushes every change to the request routers of the processes that hold a handle on
them; `router.SessionAffinityRouter` hands each list to `Directory.update` (from Serve's
thread). A front end also marks a replica down the moment its connection to it breaks, before
the controller notices: that replica takes no new requests until the controller lists a
replacement (a new replica id) or drops it, or for `DOWN_S` (then it is tried again: a
replica that is alive after all, say a connection reset on the way, is not lost for good).

The choice is the session router's: a named session goes to the live replica whose
--session-dir held it, else to its owner on the consistent-hash ring of ranks; anything else to
the replica with the fewest requests in flight from this front end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .affinity import session_owner
from .ring import HashRing

DOWN_S = 5.0  # how long a replica whose connection broke is routed around, at most
PUBLISHED: list[Directory] = []
"""The directories of this process's direct front ends: every session router of the process
hands them the replica list Serve's controller pushed (router.publish_to)."""


@dataclass(frozen=True)
class Endpoint:
    """One running replica: its ring name (`rank-R`), its Serve replica id, its direct ports."""

    name: str
    replica_id: str
    jsonl: str  # "host:port" of its JSONL port
    http: str  # "host:port" of its OpenAI app ("" when it serves none)
    saved: frozenset[str] = frozenset()  # digests of the sessions its --session-dir held
    secret: str = ""  # what its ports want to hear (endpoints.py)

    @property
    def jsonl_address(self) -> tuple[str, int]:
        return split_address(self.jsonl)

    @property
    def http_address(self) -> tuple[str, int]:
        return split_address(self.http)


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def endpoint_from(name: str, replica_id: str, metadata: Mapping[str, Any]) -> Endpoint | None:
    """The endpoint a replica published in its metadata; None until it has published one."""
    jsonl = metadata.get("jsonl")
    if not isinstance(jsonl, str) or not jsonl:
        return None
    http = metadata.get("http")
    saved = metadata.get("sessions")
    secret = metadata.get("secret")
    return Endpoint(
        name=name,
        replica_id=replica_id,
        jsonl=jsonl,
        http=http if isinstance(http, str) else "",
        saved=frozenset(saved) if isinstance(saved, list) else frozenset(),
        secret=secret if isinstance(secret, str) else "",
    )


@dataclass(frozen=True)
class _View:
    """The routable replicas at one moment, and the ring over them."""

    by_name: dict[str, Endpoint] = field(default_factory=dict)
    ring: HashRing = field(default_factory=lambda: HashRing(()))
    saved: dict[str, str] = field(default_factory=dict)  # session digest -> ring name


class Directory:
    """The live replicas (updated from any thread) and the routing choice (on the caller's)."""

    def __init__(self) -> None:
        self._listed: tuple[Endpoint, ...] = ()
        self._down: dict[str, float] = {}  # replica id -> when its connection broke
        self._view = _View()
        self._lock = threading.Lock()
        self.in_flight: dict[str, int] = {}  # replica id -> requests this front end has there

    def update(self, endpoints: Iterable[Endpoint]) -> None:
        """The controller's current list (replicas that have not published endpoints yet are
        left out by the caller)."""
        with self._lock:
            self._listed = tuple(sorted(endpoints, key=lambda e: e.name))
            listed_ids = {e.replica_id for e in self._listed}
            # a replica gone from the list needs no mark any more
            self._down = {r: t for r, t in self._down.items() if r in listed_ids}
            self._rebuild()

    def mark_down(self, replica_id: str, now: float | None = None) -> None:
        """The connection to this replica broke: route around it until it is replaced (or
        for `DOWN_S`)."""
        with self._lock:
            self._down[replica_id] = time.monotonic() if now is None else now
            self._rebuild()

    def _expire(self, now: float) -> None:
        if any(now - since > DOWN_S for since in self._down.values()):
            with self._lock:
                self._down = {r: t for r, t in self._down.items() if now - t <= DOWN_S}
                self._rebuild()

    def _rebuild(self) -> None:
        by_name = {e.name: e for e in self._listed if e.replica_id not in self._down}
        saved = {digest: e.name for e in by_name.values() for digest in e.saved}
        self._view = _View(by_name, HashRing(by_name), saved)

    @property
    def live(self) -> list[Endpoint]:
        return list(self._view.by_name.values())

    def pick(self, session: str | None, now: float | None = None) -> Endpoint | None:
        """The replica for a request naming `session` (None: least loaded); None when no
        replica is live."""
        if self._down:
            self._expire(time.monotonic() if now is None else now)
        view = self._view
        if not view.by_name:
            return None
        if session:
            owner = session_owner(session, view.saved, view.ring)
            if owner is not None:
                return view.by_name[owner]
        load = self.in_flight
        return min(view.by_name.values(), key=lambda e: load.get(e.replica_id, 0))

    def started(self, endpoint: Endpoint) -> None:
        self.in_flight[endpoint.replica_id] = self.in_flight.get(endpoint.replica_id, 0) + 1

    def finished(self, endpoint: Endpoint) -> None:
        left = self.in_flight.get(endpoint.replica_id, 1) - 1
        if left > 0:
            self.in_flight[endpoint.replica_id] = left
        else:
            self.in_flight.pop(endpoint.replica_id, None)
