"""One `--session-dir` shared by several workers: a directory of its own for each.

A worker saves its named sessions in the directory it is given (worker/engine/session_store.py:
one `<32 hex>.tpsession` file per session, named by a digest of the session id) and restores
them when it starts. Two workers on one directory would both restore every session and
overwrite each other's files, so the supervisor gives worker `i` the subdirectory
`worker-<i>` of the root. A worker index is stable across restarts (and across supervisor
restarts with the same worker count), so a restarted worker finds its own files, and its
ready line's `restored_sessions` tells the router where each session lives.

Files no worker would read (a root that a single worker used directly, or `worker-<k>` with
`k` at or above the worker count after the count went down) are moved, before any worker
starts, into the directory of the worker `int(digest) % workers`: a session is never left
behind on disk. When a session's file is in two places, the newer copy wins.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

SESSION_FILE = re.compile(r"^[0-9a-f]{32}\.tpsession$")
"""A session file's name (SessionStore.path_for: sha256(session id)[:32] + SUFFIX)."""
WORKER_DIR = re.compile(r"^worker-([0-9]+)$")
SESSION_DIR_FLAG = "--session-dir"


def worker_session_dir(root: str | Path, index: int) -> Path:
    return Path(root) / f"worker-{index}"


def split_session_dir(worker_args: Sequence[str]) -> tuple[str | None, tuple[str, ...]]:
    """(the `--session-dir` value among pass-through worker flags, the other flags): the
    supervisor owns that flag, since each worker gets a directory of its own."""
    root: str | None = None
    rest: list[str] = []
    args = list(worker_args)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == SESSION_DIR_FLAG and i + 1 < len(args):
            root = args[i + 1]
            i += 2
            continue
        if arg.startswith(SESSION_DIR_FLAG + "="):
            root = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return root, tuple(rest)


@dataclass(frozen=True)
class SessionFile:
    """A session file found under the root: where it is and who reads it there."""

    path: Path
    owner: int | None  # the worker whose directory holds it; None: no worker reads it
    mtime: float


def plan_moves(files: Iterable[SessionFile], workers: int) -> list[tuple[Path, Path | None]]:
    """Pure: (source, destination) for every file no worker reads; destination None means
    delete (an older copy of a session some worker already holds). Destinations are
    `worker-<digest % workers>/<same name>` under the root (the parent of `worker-*`)."""
    held: dict[str, SessionFile] = {}  # name -> the copy a worker reads (the newest if two)
    orphans: list[SessionFile] = []
    for found in files:
        if found.owner is not None and found.owner < workers:
            held[found.path.name] = found
        else:
            orphans.append(found)
    moves: list[tuple[Path, Path | None]] = []
    for orphan in sorted(orphans, key=lambda f: -f.mtime):  # newest first: it stays
        name = orphan.path.name
        current = held.get(name)
        if current is not None and current.mtime >= orphan.mtime:
            moves.append((orphan.path, None))
            continue
        root = orphan.path.parent if orphan.owner is None else orphan.path.parent.parent
        if current is not None:
            target = current.path  # an older copy in place: replaced by the orphan
        else:
            target = worker_session_dir(root, int(name[:32], 16) % workers) / name
        moves.append((orphan.path, target))
        held[name] = SessionFile(target, int(target.parent.name.split("-")[1]), orphan.mtime)
    return moves


def scan(root: Path) -> list[SessionFile]:
    """Every session file directly in `root` or in one of its `worker-<i>` directories."""
    found: list[SessionFile] = []
    if not root.is_dir():
        return found
    places: list[tuple[Path, int | None]] = [(root, None)]
    for child in root.iterdir():
        match = WORKER_DIR.match(child.name)
        if match and child.is_dir():
            places.append((child, int(match.group(1))))
    for directory, owner in places:
        for path in directory.iterdir():
            if SESSION_FILE.match(path.name):
                try:
                    mtime = path.stat().st_mtime
                except OSError:
                    continue
                found.append(SessionFile(path, owner, mtime))
    return found


def prepare_root(root: str | Path, workers: int) -> list[str]:
    """Before the workers start: create the root, gather the files no worker would read into
    the workers' directories. A root that cannot be created is a start-up error (ValueError,
    before any worker loads its model); any other problem is returned as one log line (a
    file that cannot be moved stays where it is, and its session is rebuilt the slow way)."""
    problems: list[str] = []
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--session-dir {root}: cannot create it: {exc}") from exc
    try:
        moves = plan_moves(scan(root), workers)
    except OSError as exc:
        return [f"--session-dir {root}: cannot list it: {exc}"]
    for source, target in moves:
        try:
            if target is None:
                source.unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(source, target)
        except OSError as exc:
            problems.append(f"--session-dir: cannot move {source} to {target}: {exc}")
    return problems
