"""Ray Serve's request routing for tokenpipe replicas: a request that names a session goes to
the replica that holds it, every other request to the least-loaded replica.

Which replica holds a session: the one whose --session-dir held it when the replica started
(replica metadata lists those sessions' digests), else its owner on a consistent-hash ring.

It runs inside each caller (the HTTP ingress, the JSONL front end): Ray Serve hands it the
live replicas and the pending call, whose `session_key` keyword is the session to stick to.
A replica's ring name is its Serve rank (`record_replica_metadata` in replica.py), not its
replica id: Ray gives a replacement the rank of the replica it replaces, so after a crash the
sessions come back to the same arc of the ring, and the other replicas keep theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .affinity import SESSION_KEY, session_owner
from .directory import Directory, Endpoint, endpoint_from
from .ring import HashRing

__all__ = ["SESSION_KEY", "SessionAffinityRouter", "publish_to", "ring_name"]


def publish_to(directory: Directory) -> Callable[[], None]:
    """Keep `directory` up to date with the replicas the routers of this process see (a handle
    must have routed one call for its router to exist); the function that stops it."""
    from supervisor.ray import directory as registry

    registry.PUBLISHED.append(directory)
    return lambda: registry.PUBLISHED.remove(directory)


def endpoints(replicas: list[RunningReplica]) -> list[Endpoint]:
    found = (
        endpoint_from(ring_name(r), r.replica_id.unique_id, r.replica_metadata) for r in replicas
    )
    return [e for e in found if e is not None]


def ring_name(replica: RunningReplica) -> str:
    """The stable name of a replica on the ring: its rank when it reported one."""
    rank = replica.replica_metadata.get("rank")
    return f"rank-{rank}" if rank is not None else replica.replica_id.unique_id


def saved_sessions(replica: RunningReplica) -> frozenset[str]:
    """Digests of the sessions the replica's --session-dir held when it started."""
    listed = replica.replica_metadata.get("sessions")
    return frozenset(listed) if isinstance(listed, list) else frozenset()


class SessionAffinityRouter(RequestRouter):
    """Named sessions: to the live replica whose --session-dir held the session when it
    started, else by consistent hashing; least ongoing requests for the rest."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._ring = HashRing(())
        self._by_name: dict[str, RunningReplica] = {}
        self._saved: dict[str, str] = {}  # session digest -> ring name of its holder
        self._saved_from: frozenset[str] = frozenset()  # the replica ids `_saved` was made of

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Serve ships this class pickled by value (a copy of this module's globals): the
        # process's own directories are found through an import, at call time
        from supervisor.ray.directory import PUBLISHED

        if PUBLISHED:
            published = endpoints(replicas)
            for directory in list(PUBLISHED):
                directory.update(published)

    def _ring_for(self, candidates: list[RunningReplica]) -> HashRing:
        names = {ring_name(r): r for r in candidates}
        if names.keys() != self._ring.nodes:
            self._ring = HashRing(names)
        replicas = frozenset(r.replica_id.unique_id for r in candidates)
        if replicas != self._saved_from:  # a replica came, went or was replaced
            self._saved_from = replicas
            self._saved = {
                digest: name for name, r in names.items() for digest in saved_sessions(r)
            }
        self._by_name = names
        return self._ring

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = None
        if pending_request is not None:
            # a protocol call's keyword, or (HTTP from Serve's proxy) Ray's session header
            key = pending_request.kwargs.get(SESSION_KEY) or getattr(
                pending_request.metadata, "session_id", None
            )
        if key:
            owner = session_owner(key, self._saved, self._ring_for(candidate_replicas))
            if owner is not None:
                return [[self._by_name[owner]]]
        # One rank of every replica: the base class takes the lowest queue length.
        return [candidate_replicas]
