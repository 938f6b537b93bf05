"""One --session-dir for several workers (supervisor/session_dirs.py): each worker gets its own
directory; files no worker would read are gathered into the workers' directories before they
start; the flag is lifted out of the pass-through worker flags. Pure and file-level: the
end-to-end restart is in test_session_dir_restart.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from supervisor.config import SupervisorConfig, plan_specs
from supervisor.mirror import SessionMirror
from supervisor.session_dirs import (
    SessionFile,
    plan_moves,
    prepare_root,
    split_session_dir,
    worker_session_dir,
)


def name_of(session: str) -> str:
    # the worker's naming (worker/engine/session_store.py, SessionStore.path_for)
    return hashlib.sha256(session.encode()).hexdigest()[:32] + ".tpsession"


def test_file_naming_matches_the_worker_store(tmp_path: Path) -> None:
    from supervisor.session_dirs import SESSION_FILE
    from worker.engine.session_store import SessionStore

    store = SessionStore(tmp_path, "fp", print)
    try:
        path = store.path_for("chat-1")
        assert path.name == name_of("chat-1") and SESSION_FILE.match(path.name)
    finally:
        store.close()


def test_split_session_dir() -> None:
    assert split_session_dir(["--threads", "1"]) == (None, ("--threads", "1"))
    assert split_session_dir(["--session-dir", "/s", "--threads", "1"]) == (
        "/s",
        ("--threads", "1"),
    )
    assert split_session_dir(["--session-dir=/s", "--dtype=float32"]) == (
        "/s",
        ("--dtype=float32",),
    )


def test_each_worker_gets_its_own_directory() -> None:
    config = SupervisorConfig(workers=2, session_dir="/data/s", worker_command=("w",))
    argvs = [spec.argv for spec in plan_specs(config)]
    assert [a[a.index("--session-dir") + 1] for a in argvs] == [
        "/data/s/worker-0",
        "/data/s/worker-1",
    ]
    assert all(a.count("--session-dir") == 1 for a in argvs)
    # the same flag among the pass-through worker flags means the same
    passed = SupervisorConfig(
        workers=2, worker_args=("--session-dir", "/data/s", "--threads", "1"), worker_command=("w",)
    )
    for spec in plan_specs(passed):
        argv = spec.argv
        assert argv.count("--session-dir") == 1 and argv[-2:] == argvs[spec.index][-2:]
        assert "--threads" in argv
    assert all(
        "--session-dir" not in spec.argv
        for spec in plan_specs(SupervisorConfig(workers=2, worker_command=("w",)))
    )


def test_plan_moves_gathers_orphans() -> None:
    root = Path("/r")
    a, b, c = name_of("a"), name_of("b"), name_of("c")
    files = [
        SessionFile(root / "worker-0" / a, 0, 10.0),
        SessionFile(root / a, None, 5.0),  # older than worker-0's copy: deleted
        SessionFile(root / b, None, 7.0),  # a single worker's old layout: moved
        SessionFile(root / "worker-3" / c, 3, 8.0),  # the worker count went down: moved
        SessionFile(root / "worker-1" / c, 1, 2.0),  # ... over this older copy
    ]
    moves = dict(plan_moves(files, workers=2))
    assert moves[root / a] is None
    assert moves[root / b] == worker_session_dir(root, int(b[:32], 16) % 2) / b
    assert moves[root / "worker-3" / c] == root / "worker-1" / c
    assert len(moves) == 3
    assert plan_moves(files[:1], workers=2) == []


def test_prepare_root_moves_files(tmp_path: Path) -> None:
    legacy = tmp_path / name_of("old")
    legacy.write_bytes(b"x")
    (tmp_path / "worker-5").mkdir()
    gone_worker = tmp_path / "worker-5" / name_of("w5")
    gone_worker.write_bytes(b"y")
    (tmp_path / "notes.txt").write_text("left alone")
    kept = tmp_path / "worker-0" / name_of("kept")
    kept.parent.mkdir()
    kept.write_bytes(b"z")
    assert prepare_root(tmp_path, 2) == []
    found = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.tpsession"))
    assert len(found) == 3 and all(f.startswith(("worker-0/", "worker-1/")) for f in found)
    assert (tmp_path / "notes.txt").exists() and kept.read_bytes() == b"z"
    assert prepare_root(tmp_path / "new" / "dir", 1) == [] and (tmp_path / "new" / "dir").is_dir()


def test_prepare_root_reports_instead_of_raising(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot create"):
        prepare_root(blocker / "sessions", 2)
    if os.geteuid() != 0:  # root ignores permissions
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro" / name_of("s")).write_bytes(b"")
        os.chmod(tmp_path / "ro", 0o500)
        try:
            assert prepare_root(tmp_path / "ro", 1)
        finally:
            os.chmod(tmp_path / "ro", 0o700)


def test_mirror_forgets_ids_it_never_saw() -> None:
    mirror = SessionMirror()
    mirror.apply("s", 0, [1, 2, 3])
    mirror.apply("s", 2, [9])
    assert mirror.resident("s") == [1, 2, 9]
    # a session restored from disk: the worker keeps 40 ids this mirror never saw
    mirror.apply("r", 40, [7])
    assert mirror.resident("r") == [] and "r" not in mirror
    mirror.apply("r", 0, [5])  # a full report makes it known again
    assert mirror.resident("r") == [5]


@pytest.mark.parametrize("session_dir", [None, "/data/s"])
def test_stopping_workers_wait_for_their_saves_with_a_session_dir(session_dir: str | None) -> None:
    """With --session-dir a stopping worker writes its sessions before it exits (1.5 GB each
    for a long Gemma 4 31B session): the supervisor waits long for it, else 5 s."""
    import asyncio

    from supervisor.core import SESSION_SAVE_GRACE_S, Supervisor
    from supervisor.state import WorkerSlot

    grants: list[float] = []

    class Process:
        async def stop(self, timeout: float = 5.0) -> None:
            grants.append(timeout)

    config = SupervisorConfig(workers=2, session_dir=session_dir, worker_command=("w",))
    supervisor = Supervisor(config)
    for spec in plan_specs(config):
        slot = WorkerSlot(spec)
        slot.process = Process()  # type: ignore[assignment]
        supervisor.state.slots.append(slot)
    asyncio.run(supervisor._stop_workers())
    assert grants == [5.0 if session_dir is None else SESSION_SAVE_GRACE_S] * 2
    assert SESSION_SAVE_GRACE_S >= 60
