"""Remembered assistant turns kept on disk (`serve --session-dir`, supervisor/openai/
turn_files.py): a new server on the same directory splices the turns of a restored session
as their exact ids; forgetting a session deletes its file; damaged lines are skipped; the file
is compacted; a directory that cannot be written only logs."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.openai.sessions import TurnStore
from supervisor.openai.turn_files import TurnFiles


def store(directory: Path, max_turns: int = 4) -> TurnStore:
    return TurnStore(max_turns=max_turns, files=TurnFiles(directory, max_turns))


def test_turns_survive_a_restart(tmp_path: Path) -> None:
    first = store(tmp_path)
    first.remember("chat", "fp1", [1, 2, 3])
    first.remember("chat", "fp2", [4, 5])
    first.remember("", "scratch", [9])  # the scratch session is not saved
    first.remember("other", "fp1", [7])
    again = store(tmp_path)
    assert again.lookup("chat", "fp1") == (1, 2, 3) and again.lookup("chat", "fp2") == (4, 5)
    assert again.lookup("other", "fp1") == (7,) and again.lookup("", "scratch") is None
    assert len(list(tmp_path.iterdir())) == 2
    again.forget("chat")
    assert store(tmp_path).lookup("chat", "fp1") is None
    assert len(list(tmp_path.iterdir())) == 1


def test_a_remembered_turn_keeps_the_saved_ones(tmp_path: Path) -> None:
    store(tmp_path).remember("chat", "fp1", [1])
    second = store(tmp_path)  # restarted: remembers a new turn before any lookup
    second.remember("chat", "fp2", [2])
    third = store(tmp_path)
    assert third.lookup("chat", "fp1") == (1,) and third.lookup("chat", "fp2") == (2,)


def test_damaged_lines_are_skipped_and_the_file_is_compacted(tmp_path: Path) -> None:
    first = store(tmp_path, max_turns=2)
    for i in range(5):
        first.remember("chat", f"fp{i}", [i])
    path = first.files.path_for("chat") if first.files else None
    assert path is not None and len(path.read_bytes().splitlines()) <= 4
    with path.open("ab") as f:
        f.write(b'{"s": "chat", "f": "fp9", "ids": [1, 2')  # a write cut short
    again = store(tmp_path, max_turns=2)
    assert again.lookup("chat", "fp4") == (4,) and again.lookup("chat", "fp3") == (3,)
    assert again.lookup("chat", "fp0") is None and again.lookup("chat", "fp9") is None


def test_an_unwritable_directory_only_logs(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    broken = store(blocker / "turns")
    broken.remember("chat", "fp", [1])  # no raise
    assert broken.lookup("chat", "fp") == (1,)  # memory still works
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o500)
        try:
            s = store(ro)
            s.remember("chat", "fp", [1])
            assert s.lookup("chat", "fp") == (1,)
        finally:
            os.chmod(ro, 0o700)
