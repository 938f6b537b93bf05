"""Routing choices: which worker gets a request. Pure functions over plain data.

Invariants the supervisor keeps and these functions rely on:
- a named session lives on at most one worker (its *placement*); every request naming it
  goes there, whatever the load;
- a new named session, and every request on the scratch session, goes to the least-loaded
  worker that can take it (ready first, then starting/restarting ones; never a failed one);
- a worker's queue (requests sent to it and not yet answered, plus those held while it
  restarts) never exceeds `max_queue`: beyond it the answer is `overloaded`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from protocol.errors import NO_NAMED_SESSIONS


class WorkerState(str, Enum):
    STARTING = "starting"  # spawned (or restarting), ready line not yet seen
    READY = "ready"
    FAILED = "failed"  # given up after repeated fast failures, or stopped


@dataclass(frozen=True)
class WorkerLoad:
    """What routing needs to know about one worker, at one instant."""

    index: int
    state: WorkerState
    queued: int  # requests sent or held, not yet answered (the bounded queue)
    named_sessions: int  # named sessions placed on this worker
    max_named_sessions: int
    max_queue: int


@dataclass(frozen=True)
class Route:
    """A routing decision: a worker index, or an error code with a message."""

    worker: int | None
    error_code: str | None = None
    error: str | None = None
    new_placement: bool = False  # the session was not placed before; place it on `worker`


def _least_loaded(candidates: Sequence[WorkerLoad]) -> WorkerLoad | None:
    ready = [w for w in candidates if w.state is WorkerState.READY]
    pool = ready or [w for w in candidates if w.state is WorkerState.STARTING]
    if not pool:
        return None
    return min(pool, key=lambda w: (w.queued, w.named_sessions, w.index))


def choose_worker(loads: Sequence[WorkerLoad], *, needs_session_slot: bool) -> Route:
    """Least-loaded worker with room in its queue (and a free named-session slot if asked)."""
    alive = [w for w in loads if w.state is not WorkerState.FAILED]
    if not alive:
        return Route(None, "unavailable", "no worker is running")
    if needs_session_slot:
        if all(w.max_named_sessions == 0 for w in alive):
            return Route(None, "capacity_exhausted", NO_NAMED_SESSIONS)
        alive = [w for w in alive if w.named_sessions < w.max_named_sessions]
        if not alive:
            return Route(None, "capacity_exhausted", "every worker's named sessions are in use")
    with_room = [w for w in alive if w.queued < w.max_queue]
    best = _least_loaded(with_room)
    if best is None:
        return Route(None, "overloaded", "every worker's queue is full; retry later")
    return Route(best.index)


def route_request(
    op: str,
    session_id: str,
    placements: Mapping[str, int],
    loads: Sequence[WorkerLoad],
) -> Route:
    """Choose the worker for one request.

    `op` is the request's op ("generate", "open", "close", "reset", "tokenize", ...);
    `session_id` is "" for the scratch session or for ops that name no session.
    """
    by_index = {w.index: w for w in loads}
    placed = placements.get(session_id) if session_id else None
    if placed is not None:
        worker = by_index[placed]
        if worker.state is WorkerState.FAILED:
            # The worker is gone for good: the session moves (its mirror rebuilds it).
            return _place(loads)
        if op in ("generate",) and worker.queued >= worker.max_queue:
            return Route(None, "overloaded", f"worker {placed}'s queue is full; retry later")
        return Route(placed)
    if session_id and op in ("generate", "open"):
        return _place(loads)
    if op in ("generate",):
        return choose_worker(loads, needs_session_slot=False)
    # Control ops (unplaced close/reset, tokenize, info, ...) never count against the queue.
    alive = [w for w in loads if w.state is not WorkerState.FAILED]
    best = _least_loaded(alive)
    if best is None:
        return Route(None, "unavailable", "no worker is running")
    return Route(best.index)


def _place(loads: Sequence[WorkerLoad]) -> Route:
    route = choose_worker(loads, needs_session_slot=True)
    if route.worker is None:
        return route
    return Route(route.worker, new_placement=True)


def restart_delay(consecutive_fast_failures: int, base_s: float = 0.5, cap_s: float = 8.0) -> float:
    """Backoff before restarting a worker: base, 2*base, 4*base, ... capped."""
    if consecutive_fast_failures <= 0:
        return 0.0
    return min(cap_s, base_s * (2 ** (consecutive_fast_failures - 1)))


def should_give_up(consecutive_fast_failures: int, max_fast_failures: int) -> bool:
    """True once a worker has failed fast (soon after starting) too many times in a row."""
    return consecutive_fast_failures >= max_fast_failures
