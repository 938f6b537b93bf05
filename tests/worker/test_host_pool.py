"""The tiers' host buffers (worker/engine/host_pool.py), on the CPU: buffers are taken and given
back by reference count, an exhausted pool pushes the least recently used host copy to disk (or
drops it), prefetched reads use the pool, and no buffer leaks over 1,000 random tier moves."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.engine.host_pool import HostPool, lay_out
from worker.engine.session_store import SessionStore
from worker.engine.tiers import SessionTiers
from worker.layers.slot_state import SlotState, to_host


def slot(tokens: int, fill: float) -> dict[str, torch.Tensor]:
    """A stand-in for a slot's views: two layers, the second a ring of 4 entries."""
    return {
        "k0": torch.full((2, tokens, 4), fill),
        "v0": torch.full((2, tokens, 4), -fill, dtype=torch.bfloat16),
        "k1": torch.full((1, min(tokens, 4), 8), fill + 0.5),
    }


BUFFER_BYTES = lay_out(slot(16, 0.0))[1]  # the largest state: 16 tokens


def export(tiers: SessionTiers, tokens: int, fill: float, evict: bool = True) -> SlotState:
    buffer = tiers.buffer(0, evict)
    tensors, held = to_host(slot(tokens, fill), buffer)
    if buffer is not None and held is not buffer:
        buffer.release()
    return SlotState(tokens, tensors, {}, held)


def in_use(pool: HostPool) -> int:
    return sum(b.holders for b in pool.buffers)


def test_take_retain_release() -> None:
    pool = HostPool(BUFFER_BYTES, 2, pinned=False)
    a, b = pool.take(BUFFER_BYTES), pool.take(1)
    assert a is not None and b is not None and a is not b and pool.free == 0
    assert pool.take(1) is None and pool.misses == 1
    assert pool.take(BUFFER_BYTES + 1) is None  # never more than a buffer
    a.retain()
    a.release()
    assert pool.free == 0
    a.release()
    assert pool.free == 1
    with pytest.raises(RuntimeError):
        a.release()
    with pytest.raises(RuntimeError):
        a.retain()
    b.release()
    assert pool.take(1) is not None and pool.free == 1


def test_states_are_laid_into_the_buffer_and_equal_the_slot() -> None:
    pool = HostPool(BUFFER_BYTES, 1, pinned=False)
    tiers = SessionTiers(1 << 20, None, pool)
    state = export(tiers, 16, 2.0)
    assert state.buffer is pool.buffers[0] and pool.free == 0
    for name, t in slot(16, 2.0).items():
        got = state.tensors[name]
        assert torch.equal(got, t) and got.dtype == t.dtype
        assert got.untyped_storage().data_ptr() == pool.buffers[0].data.data_ptr()
        assert (got.data_ptr() - pool.buffers[0].data.data_ptr()) % 256 == 0
    # a state larger than a buffer goes to pageable memory and the buffer stays free
    big = {"k0": torch.ones(BUFFER_BYTES)}
    buffer = pool.take(0)
    assert buffer is None  # the one buffer is held by ``state``
    state.release()
    buffer = pool.take(0)
    tensors, held = to_host(big, buffer)
    assert held is None and torch.equal(tensors["k0"], big["k0"])


def test_exhausted_pool_pushes_the_oldest_copy_to_disk(tmp_path: Path) -> None:
    pool = HostPool(BUFFER_BYTES, 2, pinned=False)
    store = SessionStore(tmp_path, "fp", print)
    tiers = SessionTiers(1 << 30, store, pool)
    for i, name in enumerate(["a", "b"]):
        assert not tiers.offload(name, export(tiers, 8, float(i)), list(range(8)), 1)
    assert pool.free == 0
    c = export(tiers, 8, 9.0)  # "a" goes to disk (its buffer back once spilled or written)
    assert not tiers.offload("c", c, list(range(8)), 1)
    assert tiers.where("a") == "disk" and tiers.where("b") == tiers.where("c") == "host"
    store.flush()
    assert in_use(pool) == 1 + (c.buffer is not None)  # "b", and "c" if it found one
    got = tiers.take("a")
    assert got is not None and torch.equal(got[0].tensors["k0"], slot(8, 0.0)["k0"])
    got[0].release()
    for name in ("b", "c"):
        taken = tiers.take(name)
        assert taken is not None
        taken[0].release()
    assert pool.free == 2
    store.close()


def test_exhausted_pool_without_disk_drops_the_oldest() -> None:
    pool = HostPool(BUFFER_BYTES, 1, pinned=False)
    tiers = SessionTiers(1 << 30, None, pool)
    assert not tiers.offload("a", export(tiers, 8, 1.0), list(range(8)), 1)
    b = export(tiers, 8, 2.0)
    assert b.buffer is not None and pool.misses == 0  # "a" was dropped for it: not a miss
    assert tiers.offload("b", b, list(range(8)), 1) == ["a"] and tiers.dropped == 1
    assert tiers.where("a") is None and pool.free == 0
    tiers.forget("b", delete_file=False)
    assert pool.free == 1


def test_idle_save_without_a_free_buffer_is_pageable_and_evicts_nothing(tmp_path: Path) -> None:
    pool = HostPool(BUFFER_BYTES, 1, pinned=False)
    store = SessionStore(tmp_path, "fp", print)
    tiers = SessionTiers(1 << 30, store, pool)
    tiers.offload("a", export(tiers, 8, 1.0), list(range(8)), 1)
    save = export(tiers, 8, 2.0, evict=False)
    assert save.buffer is None and tiers.where("a") == "host" and pool.misses == 1  # pageable
    store.write("b", save, list(range(8)), 1)
    store.close()
    assert in_use(pool) == 1


def test_prefetch_reads_into_the_pool_and_gives_buffers_back(tmp_path: Path) -> None:
    first = SessionStore(tmp_path, "fp", print)
    for i, name in enumerate(["a", "b", "c"]):
        first.write(name, SlotState(8, slot(8, float(i)), {}), list(range(8)), 1)
    first.close()
    pool = HostPool(BUFFER_BYTES, 2, pinned=False)
    store = SessionStore(tmp_path, "fp", print, buffers=pool.take)
    names = [name for name, _ids, _mtime in store.scan()]
    store.prefetch(names, 1 << 30)
    reads = {name: store.read(name) for name in ("a", "b", "c")}
    # two prefetched into the pool, the third read into pageable memory (no buffer left)
    held = [r.state for r in reads.values() if r is not None and r.state.buffer is not None]
    assert len(held) == 2 and pool.free == 0
    for i, name in enumerate(["a", "b", "c"]):
        got = reads[name]
        assert got is not None and torch.equal(got.state.tensors["k1"], slot(8, float(i))["k1"])
        got.state.release()
    assert pool.free == 2
    store.close()
    # a write drops a prefetched copy and gives its buffer back
    again = SessionStore(tmp_path, "fp", print, buffers=pool.take)
    again.scan()
    again.prefetch(["a"], 1 << 30)
    deadline = time.monotonic() + 10
    while again.prefetched < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert again.prefetched == 1 and pool.free == 1
    again.write("a", SlotState(8, slot(8, 5.0), {}), list(range(8)), 2)
    again.close()
    assert pool.free == 2


def test_no_buffer_leaks_over_1000_random_moves(tmp_path: Path) -> None:
    """Offloads, reloads, idle saves (some taken back by an offload), closes and resets in a
    random order; every copy read back equals what was put there, and at the end every buffer
    is held exactly by the host copies still there."""
    rng = random.Random(16)
    pool = HostPool(BUFFER_BYTES, 3, pinned=False)
    store = SessionStore(tmp_path, "fp", lambda _m: None, buffers=pool.take)
    tiers = SessionTiers(4 * BUFFER_BYTES, store, pool)
    device: dict[str, tuple[int, float]] = {}  # sessions "in a slot": (tokens, fill)
    version: dict[str, int] = {}
    elsewhere: dict[str, tuple[int, float]] = {}  # in host memory or on disk
    names = [f"s{i}" for i in range(8)]
    for move in range(1000):
        name = rng.choice(names)
        if name in device and rng.random() < 0.2:  # idle save, maybe taken by an offload
            tokens, fill = device[name]
            save = export(tiers, tokens, fill, evict=False)
            store.write(name, save, list(range(tokens)), version[name])
        if name in device:
            tokens, fill = device.pop(name)
            state = store.pending_state(name, version[name])
            if state is None:
                state = export(tiers, tokens, fill)
            for lost in tiers.offload(name, state, list(range(tokens)), version[name]):
                elsewhere.pop(lost, None)
            elsewhere[name] = (tokens, fill)
        elif name in elsewhere and rng.random() < 0.9:
            copy = tiers.take(name)
            tokens, fill = elsewhere.pop(name)
            assert copy is not None, (move, name)
            state, ids = copy
            assert ids == list(range(tokens)) and torch.equal(
                state.tensors["k0"], slot(tokens, fill)["k0"]
            ), (move, name)
            state.release()
            version[name] += 1
            device[name] = (min(16, tokens + rng.randint(0, 3)), float(move))
        elif name in elsewhere:
            tiers.forget(name, delete_file=rng.random() < 0.5)
            elsewhere.pop(name)
            device[name] = (rng.randint(1, 16), float(move))
            version[name] += 1
        else:
            device[name] = (rng.randint(1, 16), float(move))
            version[name] = version.get(name, 0) + 1
    store.flush()
    host_held = [e.state.buffer for e in tiers.host.entries.values() if e.state.buffer]
    assert in_use(pool) == len(host_held) and all(b.holders == 1 for b in host_held)
    store.close()
    assert tiers.offloads > 300 and tiers.reloads > 200


def test_a_write_gives_its_buffer_back_before_the_disk_is_done(tmp_path: Path, monkeypatch) -> None:
    """The spill thread copies a queued write's pinned state to pageable memory and frees the
    buffer while the writer is still busy; ``pending_state`` then offers nothing."""
    pool = HostPool(BUFFER_BYTES, 2, pinned=False)
    store = SessionStore(tmp_path, "fp", print)
    tiers = SessionTiers(1 << 30, store, pool)
    gate = __import__("threading").Event()
    write_file = store._write_file
    monkeypatch.setattr(store, "_write_file", lambda item: gate.wait(10) and write_file(item))
    busy = SlotState(8, slot(8, 1.0), {})
    store.write("busy", busy, list(range(8)), 1)  # the writer waits on it
    store.write("a", export(tiers, 8, 2.0), list(range(8)), 1)
    deadline = time.monotonic() + 10
    while pool.free < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.free == 2 and store.pending_state("a", 1) is None
    gate.set()
    store.flush()
    assert pool.free == 2
    got = store.read("a")
    assert got is not None and torch.equal(got.state.tensors["v0"], slot(8, 2.0)["v0"])
    store.close()


def test_pageable_host_copies_move_into_the_pool_when_idle() -> None:
    pool = HostPool(BUFFER_BYTES, 1, pinned=False)
    tiers = SessionTiers(1 << 30, None, pool)
    held = pool.take(0)  # a write in progress, say
    assert held is not None
    state = export(tiers, 8, 3.0, evict=False)
    assert state.buffer is None
    tiers.offload("a", state, list(range(8)), 1)
    assert tiers.buffers_coming_back() and not tiers.pin_one()
    held.release()
    assert tiers.pin_one() and not tiers.buffers_coming_back() and pool.free == 0
    entry = tiers.host.entries["a"]
    assert entry.state.buffer is pool.buffers[0]
    assert torch.equal(entry.state.tensors["k1"], slot(8, 3.0)["k1"])
    assert not tiers.pin_one()
    assert pool.misses == 1  # the pageable export; idle re-pinning finding no buffer is not one


def test_other_threads_take_only_buffers_no_copy_still_reads() -> None:
    """The prefetch thread makes no CUDA call: it skips a buffer released with an event (a
    copy to the device that may still run); the engine thread waits for the event."""

    class Event:
        waited = False

        def synchronize(self) -> None:
            self.waited = True

    pool = HostPool(BUFFER_BYTES, 1, pinned=False)
    buffer = pool.take(0)
    assert buffer is not None
    event = Event()
    buffer.release(event)  # type: ignore[arg-type]
    assert pool.take(0, wait=False) is None
    assert pool.take(0) is buffer and event.waited and buffer.ready is None
    buffer.release()
    assert pool.take(0, wait=False) is buffer


def test_an_exhausted_pool_first_pushes_out_a_copy_only_the_tier_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = HostPool(BUFFER_BYTES, 2, pinned=False)
    store = SessionStore(tmp_path, "fp", print)
    hold = threading.Event()
    store._spiller.submit(hold.wait, 30)  # spills wait: "a"'s buffer stays shared
    write_file = store._write_file

    def held_write(item: Any) -> int:  # nor does the writer finish "a" before the eviction
        hold.wait(30)  # (CI once saw it done first: "a" was alone in its buffer and went)
        return write_file(item)

    monkeypatch.setattr(store, "_write_file", held_write)
    tiers = SessionTiers(1 << 30, store, pool)
    tiers.offload("a", export(tiers, 8, 1.0), list(range(8)), 1)
    shared = tiers.host.entries["a"].state
    shared.retain()  # the host tier and the writer hold it (as an idle save's copy)
    store.write("a", shared, list(range(8)), 1)
    tiers.offload("b", export(tiers, 8, 2.0), list(range(8)), 1)
    store.write("b", SlotState(8, slot(8, 2.0), {}), list(range(8)), 1)  # on disk as it is
    buffer = tiers.buffer(0, evict=True)  # "b" goes (the older "a" would free nothing yet)
    assert buffer is not None and tiers.where("a") == "host" and tiers.where("b") == "disk"
    buffer.release()
    hold.set()
    store.close()
    assert pool.free == 1  # "a"'s, held by the host tier alone now
