"""tokenpipe worker: one process, one device, one model, many sessions."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str) -> Path:
    """``$TOKENPIPE_CACHE/<name>`` (default ``~/.cache/tokenpipe/<name>``): what the worker
    keeps between starts (GGUF headers and tokenizers, built C kernels, tile picks, merged fla
    configs). Not created here."""
    base = os.environ.get("TOKENPIPE_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "tokenpipe"
    return root / name
