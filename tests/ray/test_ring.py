"""The consistent-hash ring (supervisor/ray/ring.py): pure, no Ray needed."""

from __future__ import annotations

from collections import Counter

from supervisor.ray.ring import HashRing

KEYS = [f"session-{i}" for i in range(4000)]


def owners(ring: HashRing) -> dict[str, str | None]:
    return {key: ring.owner(key) for key in KEYS}


def test_empty_ring_has_no_owner() -> None:
    assert HashRing(()).owner("anything") is None


def test_owner_is_stable_and_order_free() -> None:
    a = HashRing(["rank-0", "rank-1", "rank-2"])
    b = HashRing(["rank-2", "rank-0", "rank-1", "rank-0"])
    assert owners(a) == owners(b)
    assert a.nodes == {"rank-0", "rank-1", "rank-2"}


def test_load_is_spread_evenly() -> None:
    counts = Counter(owners(HashRing([f"rank-{i}" for i in range(4)])).values())
    assert set(counts) == {f"rank-{i}" for i in range(4)}
    assert max(counts.values()) < 1.25 * len(KEYS) / 4


def test_adding_a_replica_moves_only_its_share() -> None:
    before = owners(HashRing([f"rank-{i}" for i in range(3)]))
    after = owners(HashRing([f"rank-{i}" for i in range(4)]))
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == "rank-3" for key in moved)  # only onto the new replica
    assert 0.15 * len(KEYS) < len(moved) < 0.35 * len(KEYS)  # about 1/4, not a reshuffle


def test_removing_a_replica_moves_only_its_sessions() -> None:
    before = owners(HashRing([f"rank-{i}" for i in range(4)]))
    after = owners(HashRing(["rank-0", "rank-1", "rank-3"]))
    for key in KEYS:
        if before[key] != "rank-2":
            assert after[key] == before[key]
        else:
            assert after[key] != "rank-2"


def test_a_session_saved_by_a_replica_goes_back_to_it() -> None:
    from supervisor.ray.affinity import session_digest, session_owner

    ring = HashRing(["rank-0", "rank-1", "rank-2"])
    key = next(k for k in KEYS if ring.owner(k) == "rank-0")
    saved = {session_digest(key): "rank-2"}  # rank-2's --session-dir held it at its start
    assert session_owner(key, saved, ring) == "rank-2"
    assert session_owner(key, {}, ring) == "rank-0"
    other = next(k for k in KEYS if k != key)
    assert session_owner(other, saved, ring) == ring.owner(other)
    # the holder is gone: the ring decides
    smaller = HashRing(["rank-0", "rank-1"])
    assert session_owner(key, saved, smaller) == smaller.owner(key)
