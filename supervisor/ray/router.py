"""Ray Serve's request routing for tokenpipe replicas: a request that names a session goes to
the replica that holds it, every other request to the least-loaded replica.

It runs inside each caller (the HTTP ingress, the JSONL front end): Ray Serve hands it the
live replicas and the pending call, whose `session_key` keyword is the session to stick to.
A replica's ring name is its Serve rank (`record_replica_metadata` in replica.py), not its
replica id: Ray gives a replacement the rank of the replica it replaces, so after a crash the
sessions come back to the same arc of the ring, and the other replicas keep theirs.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .affinity import SESSION_KEY
from .ring import HashRing

__all__ = ["SESSION_KEY", "SessionAffinityRouter", "ring_name"]


def ring_name(replica: RunningReplica) -> str:
    """The stable name of a replica on the ring: its rank when it reported one."""
    rank = replica.replica_metadata.get("rank")
    return f"rank-{rank}" if rank is not None else replica.replica_id.unique_id


class SessionAffinityRouter(RequestRouter):
    """Consistent hashing for named sessions; least ongoing requests for the rest."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._ring = HashRing(())
        self._by_name: dict[str, RunningReplica] = {}

    def _ring_for(self, candidates: list[RunningReplica]) -> HashRing:
        names = {ring_name(r): r for r in candidates}
        if names.keys() != self._ring.nodes:
            self._ring = HashRing(names)
        self._by_name = names
        return self._ring

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get(SESSION_KEY) if pending_request is not None else None
        if key:
            owner = self._ring_for(candidate_replicas).owner(key)
            if owner is not None:
                return [[self._by_name[owner]]]
        # One rank of every replica: the base class takes the lowest queue length.
        return [candidate_replicas]
