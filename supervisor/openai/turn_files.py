"""Remembered assistant turns on disk, next to the saved sessions (`--session-dir`).

A session resumed after a restart is warm only if its prompt starts with the ids the worker
saved. The server splices each assistant turn it generated back as its exact ids (sessions.py);
without those ids after a restart it would re-encode the turn's text, which can tokenize
differently, and the worker's reuse would stop at the first assistant turn. So each named
session's remembered turns are kept in a file of their own:

    <dir>/<sha256(session)[:32]>.turns.jsonl    one {"s": session, "f": fingerprint, "ids": [...]}
                                                 per line, oldest first

Lines are appended as turns are remembered (no fsync: a lost line costs warmth, never
correctness) and the file is rewritten from memory once it holds twice the turns kept. Reading
skips any line that is not a whole record of this session (a write cut short by a crash).
Deleted when the session is closed, reset or evicted. No file I/O ever raises into a request:
a failure logs once and the store carries on in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("tokenpipe.serve")

SUFFIX = ".turns.jsonl"


class TurnFiles:
    """One directory of per-session turn files."""

    def __init__(self, directory: str | Path, max_turns: int) -> None:
        self.directory = Path(directory)
        self.max_turns = max_turns
        self._lines: dict[str, int] = {}  # session -> lines in its file (as far as known)
        self._failed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._fail(f"cannot create {self.directory}: {exc}")

    def path_for(self, session: str) -> Path:
        return self.directory / (hashlib.sha256(session.encode()).hexdigest()[:32] + SUFFIX)

    def _fail(self, message: str) -> None:
        if not self._failed:
            log.warning("remembered turns are not saved: %s", message)
        self._failed = True

    def load(self, session: str) -> list[tuple[str, tuple[int, ...]]]:
        """(fingerprint, ids) of the session's saved turns, oldest first (the last
        `max_turns`)."""
        try:
            raw = self.path_for(session).read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("cannot read the turns of session %r: %s", session, exc)
            return []
        turns: dict[str, tuple[int, ...]] = {}
        lines = 0
        for line in raw.splitlines():
            lines += 1
            try:
                record = json.loads(line)
                if record["s"] != session or not isinstance(record["f"], str):
                    continue
                ids = tuple(int(i) for i in record["ids"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash, or not ours
            turns.pop(record["f"], None)
            turns[record["f"]] = ids
        self._lines[session] = lines
        return list(turns.items())[-self.max_turns :]

    def append(
        self,
        session: str,
        fingerprint: str,
        ids: Iterable[int],
        current: Iterable[tuple[str, tuple[int, ...]]],
    ) -> None:
        """Add one turn; `current` (the session's turns in memory, this one included) is
        written instead when the file has grown to twice the turns kept."""
        if self._failed:
            return
        path = self.path_for(session)
        try:
            lines = self._lines.get(session, 0)
            if lines + 1 > 2 * self.max_turns:
                records = [self._record(session, f, i) for f, i in current]
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_bytes(b"".join(records))
                os.replace(tmp, path)
                self._lines[session] = len(records)
                return
            with path.open("ab") as f:
                f.write(self._record(session, fingerprint, ids))
            self._lines[session] = lines + 1
        except OSError as exc:
            self._fail(f"cannot write {path}: {exc}")

    def delete(self, session: str) -> None:
        self._lines.pop(session, None)
        try:
            self.path_for(session).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot delete the turns of session %r: %s", session, exc)

    @staticmethod
    def _record(session: str, fingerprint: str, ids: Iterable[int]) -> bytes:
        record = {"s": session, "f": fingerprint, "ids": list(ids)}
        return json.dumps(record, separators=(",", ":")).encode() + b"\n"
