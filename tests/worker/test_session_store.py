"""Session files (worker/engine/session_store.py): round trip, and every bad file or bad
directory is a logged skip or a clear error, never a crash and never a wrong cache."""

from __future__ import annotations

import json
import os
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

from worker.engine.session_store import SessionStore
from worker.engine.tiers import SessionTiers
from worker.layers.slot_state import SlotState


def state(tokens: int = 5, fill: float = 1.0) -> SlotState:
    return SlotState(
        tokens,
        {
            "k0": torch.full((2, tokens, 4), fill),
            "v0": torch.arange(2 * tokens * 4, dtype=torch.bfloat16).reshape(2, tokens, 4),
        },
        {"snapshot_lens": [3, 0]},
    )


def store(path: Path, fingerprint: str = "model-a") -> tuple[SessionStore, list[str]]:
    logs: list[str] = []
    return SessionStore(path, fingerprint, logs.append), logs


def test_round_trip_and_restart(tmp_path: Path) -> None:
    s, _ = store(tmp_path)
    s.write("chat", state(), [1, 2, 3, 4, 5], version=7)
    assert s.holds("chat") and s.has_version("chat", 7)
    s.close()
    again, logs = store(tmp_path)
    assert again.scan()[0][:2] == ("chat", [1, 2, 3, 4, 5]) and not logs
    got = again.read("chat")
    assert got is not None and got.resident_ids == [1, 2, 3, 4, 5]
    for name, t in state().tensors.items():
        assert torch.equal(got.state.tensors[name], t) and got.state.tensors[name].dtype == t.dtype
    assert got.state.meta == {"snapshot_lens": [3, 0]} and got.state.tokens == 5


@pytest.mark.parametrize("damage", ["payload", "header", "truncated", "garbage", "empty"])
def test_bad_files_are_skipped_with_one_log_line(tmp_path: Path, damage: str) -> None:
    s, _ = store(tmp_path)
    s.write("chat", state(), [1, 2, 3, 4, 5], version=1)
    s.close()
    path = s.path_for("chat")
    raw = bytearray(path.read_bytes())
    if damage == "payload":
        raw[-3] ^= 0xFF
    elif damage == "header":
        raw[20] ^= 0x01
    elif damage == "truncated":
        raw = raw[:-10]
    elif damage == "garbage":
        raw = bytearray(os.urandom(300))
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    again, logs = store(tmp_path)
    found = again.scan()
    got = again.read("chat") if found else None
    assert got is None
    assert len(logs) == 1 and str(path) in logs[0], logs


def test_foreign_model_files_are_ignored(tmp_path: Path) -> None:
    s, _ = store(tmp_path, "model-a")
    s.write("chat", state(), [1, 2, 3, 4, 5], version=1)
    s.close()
    other, logs = store(tmp_path, "model-b")
    assert other.scan() == [] and other.read("chat") is None
    assert len(logs) == 1 and "another model" in logs[0]


def test_failed_write_keeps_the_previous_copy(tmp_path: Path, monkeypatch) -> None:
    s, logs = store(tmp_path)
    s.write("chat", state(fill=1.0), [1, 2, 3, 4, 5], version=1)
    s.flush()
    good = s.path_for("chat").read_bytes()

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    s.write("chat", state(fill=2.0), [1, 2, 3, 4, 6], version=2)
    s.flush()
    monkeypatch.undo()
    assert s.write_errors == 1 and "No space left" in logs[-1]
    assert s.path_for("chat").read_bytes() == good  # the old file, no temporary left
    assert [p.name for p in tmp_path.iterdir()] == [s.path_for("chat").name]
    assert not s.has_version("chat", 2)
    s.close()


def test_close_deletes_and_bad_directories(tmp_path: Path) -> None:
    s, _ = store(tmp_path)
    s.write("chat", state(), [1, 2, 3, 4, 5], version=1)
    s.delete("chat")
    s.flush()
    assert not s.holds("chat") and list(tmp_path.iterdir()) == []
    s.close()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--session-dir"):
        SessionStore(blocker / "sessions", "m", print)
    with pytest.raises(ValueError, match="not a directory|cannot create"):
        SessionStore(blocker, "m", print)


def test_read_only_directory_reads_but_does_not_write(tmp_path: Path, monkeypatch) -> None:
    s, _ = store(tmp_path)
    s.write("chat", state(), [1, 2, 3, 4, 5], version=1)
    s.close()
    monkeypatch.setattr(SessionStore, "_probe", lambda self: False)  # root ignores chmod
    ro, _ = store(tmp_path)
    assert not ro.writable and ro.scan()[0][0] == "chat" and ro.read("chat") is not None
    ro.write("other", state(), [1, 2, 3, 4, 5], version=1)  # a no-op, no crash
    ro.flush()
    assert not ro.holds("other")
    ro.close()


def test_host_tier_overflows_to_disk_then_drops(tmp_path: Path) -> None:
    one = state().nbytes
    s, _ = store(tmp_path)
    tiers = SessionTiers(int(one * 1.5), s)
    assert tiers.offload("a", state(fill=1.0), [1, 2, 3, 4, 5], 1) == []
    assert tiers.offload("b", state(fill=2.0), [1, 2, 3, 4, 6], 2) == []  # a -> disk
    assert tiers.where("a") == "disk" and tiers.where("b") == "host"
    got = tiers.take("a")
    assert got is not None and float(got[0].tensors["k0"][0, 0, 0]) == 1.0
    s.close()
    no_disk = SessionTiers(int(one * 1.5), None)
    no_disk.offload("a", state(), [1, 2, 3, 4, 5], 1)
    assert no_disk.offload("b", state(), [1, 2, 3, 4, 5], 1) == ["a"]  # a's cache is gone
    assert no_disk.take("a") is None and no_disk.dropped == 1


def test_prefetch_serves_reads_and_a_write_drops_it(tmp_path: Path) -> None:
    s, _ = store(tmp_path)
    s.write("a", state(fill=1.0), [1, 2, 3, 4, 5], version=1)
    s.write("b", state(fill=2.0), [1, 2, 3, 4, 6], version=1)
    s.close()
    again, logs = store(tmp_path)
    names = [name for name, _, _ in again.scan()]
    one_file = again.path_for("a").stat().st_size
    again.prefetch(names, budget_bytes=2 * one_file)
    for _ in range(1000):  # 10 s: a loaded box reads slowly
        if again.prefetched == 2:
            break
        time.sleep(0.01)
    assert again.prefetched == 2
    again.path_for("a").unlink()  # served from memory now
    got = again.read("a")
    assert got is not None and torch.equal(got.state.tensors["k0"], state(fill=1.0).tensors["k0"])
    again.write("b", state(fill=3.0), [1, 2, 3, 4, 7], version=2)  # newer than the prefetched
    got = again.read("b")
    assert got is not None and got.resident_ids == [1, 2, 3, 4, 7]
    again.close()
    assert not logs


def test_format_1_files_are_still_read(tmp_path: Path) -> None:
    s, _ = store(tmp_path)
    s.write("chat", state(), [1, 2, 3, 4, 5], version=1)
    s.close()
    path = s.path_for("chat")
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + length])
    payload = raw[16 + length + 4 :]
    header["format"] = 1
    header["payload_crc32"] = zlib.crc32(payload)
    for spec in header["tensors"]:
        del spec["crc32"]
    encoded = json.dumps(header).encode()
    path.write_bytes(
        raw[:8] + struct.pack("<Q", len(encoded)) + encoded
        + struct.pack("<I", zlib.crc32(encoded)) + payload
    )  # fmt: skip
    again, logs = store(tmp_path)
    assert again.scan() and not logs
    got = again.read("chat")
    assert got is not None and torch.equal(got.state.tensors["v0"], state().tensors["v0"])
    path.write_bytes(path.read_bytes()[:-1] + b"\xff")  # and its checksum still holds
    damaged, logs = store(tmp_path)
    assert damaged.scan() and damaged.read("chat") is None and "checksum" in logs[0]


def test_pending_state_is_the_copy_a_write_holds(tmp_path: Path, monkeypatch) -> None:
    s, _ = store(tmp_path)
    gate = threading.Event()
    write_file = SessionStore._write_file
    monkeypatch.setattr(
        SessionStore, "_write_file", lambda self, item: (gate.wait(5), write_file(self, item))[1]
    )
    saved = state(fill=4.0)
    s.write("chat", saved, [1, 2, 3, 4, 5], version=3)
    assert s.pending_state("chat", 3) is saved and s.pending_state("chat", 2) is None
    gate.set()
    s.flush()
    assert s.pending_state("chat", 3) is None  # on disk now: the copy is let go
    s.close()
