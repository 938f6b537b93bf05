"""The direct path's routing choice (supervisor/ray/directory.py; pure, no Ray): sessions to
the ring owner among the live replicas, a saved session to the replica that holds it, the rest
to the least loaded; a replica whose connection broke is routed around until Serve's controller
lists its replacement."""

from __future__ import annotations

from supervisor.ray.affinity import session_digest
from supervisor.ray.directory import Directory, Endpoint, endpoint_from, split_address
from supervisor.ray.ring import HashRing


def endpoint(rank: int, replica_id: str, saved: frozenset[str] = frozenset()) -> Endpoint:
    return Endpoint(f"rank-{rank}", replica_id, f"127.0.0.1:{9000 + rank}", "", saved)


def sessions_of(ring: HashRing, name: str, count: int = 3) -> list[str]:
    return [s for s in (f"s{i}" for i in range(200)) if ring.owner(s) == name][:count]


def test_sessions_follow_the_ring_of_live_replicas() -> None:
    directory = Directory()
    assert directory.pick("a") is None and directory.pick(None) is None
    directory.update([endpoint(0, "x0"), endpoint(1, "x1")])
    ring = HashRing(["rank-0", "rank-1"])
    for name in ("rank-0", "rank-1"):
        for session in sessions_of(ring, name):
            picked = directory.pick(session)
            assert picked is not None and picked.name == name


def test_a_broken_replica_is_routed_around_until_replaced() -> None:
    directory = Directory()
    directory.update([endpoint(0, "x0"), endpoint(1, "x1")])
    ring = HashRing(["rank-0", "rank-1"])
    moved = sessions_of(ring, "rank-0")
    directory.mark_down("x0")
    assert [e.name for e in directory.live] == ["rank-1"]
    assert all(directory.pick(s).name == "rank-1" for s in moved)  # type: ignore[union-attr]
    directory.update([endpoint(0, "x0"), endpoint(1, "x1")])  # the controller has not noticed
    assert all(directory.pick(s).name == "rank-1" for s in moved)  # type: ignore[union-attr]
    directory.update([endpoint(0, "y0"), endpoint(1, "x1")])  # Ray's replacement, same rank
    for session in moved:
        picked = directory.pick(session)
        assert picked is not None and (picked.name, picked.replica_id) == ("rank-0", "y0")


def test_a_down_mark_expires_while_the_replica_is_still_listed() -> None:
    from supervisor.ray.directory import DOWN_S

    directory = Directory()
    directory.update([endpoint(0, "x0")])
    directory.mark_down("x0", now=100.0)
    assert directory.pick(None, now=100.0 + DOWN_S / 2) is None
    picked = directory.pick(None, now=100.0 + DOWN_S + 0.1)  # tried again
    assert picked is not None and picked.replica_id == "x0"


def test_saved_sessions_go_to_their_holder_first() -> None:
    ring = HashRing(["rank-0", "rank-1", "rank-2"])
    session = sessions_of(ring, "rank-2", 1)[0]
    directory = Directory()
    held = frozenset({session_digest(session)})
    directory.update([endpoint(0, "x0", held), endpoint(1, "x1"), endpoint(2, "x2")])
    assert directory.pick(session).name == "rank-0"  # type: ignore[union-attr]
    directory.mark_down("x0")
    assert directory.pick(session).name == "rank-2"  # type: ignore[union-attr]


def test_anonymous_requests_go_to_the_least_loaded() -> None:
    directory = Directory()
    zero, one = endpoint(0, "x0"), endpoint(1, "x1")
    directory.update([zero, one])
    directory.started(zero)
    assert directory.pick(None) == one
    directory.started(one)
    directory.started(one)
    assert directory.pick(None) == zero
    directory.finished(one)
    directory.finished(one)
    assert directory.pick(None) == one
    assert directory.in_flight == {"x0": 1}


def test_endpoints_from_replica_metadata() -> None:
    assert endpoint_from("rank-0", "x", {"rank": 0}) is None  # not published yet
    found = endpoint_from(
        "rank-0", "x", {"jsonl": "10.0.0.5:4100", "http": "10.0.0.5:4101", "sessions": ["ab"]}
    )
    assert found == Endpoint("rank-0", "x", "10.0.0.5:4100", "10.0.0.5:4101", frozenset({"ab"}))
    assert found.jsonl_address == ("10.0.0.5", 4100)
    assert split_address("[::1]:80") == ("::1", 80)
