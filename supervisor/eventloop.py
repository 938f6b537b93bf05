"""The event loop `tokenpipe run` serves on: uvloop where it is installed, else asyncio's.

uvloop (libuv) reads a worker's pipe into one reused buffer and runs the loop in C; on the
2-core dev VM it halves what the supervisor adds per relayed token event (BENCHMARKS.md).
Without uvloop (not installed, or TOKENPIPE_EVENT_LOOP=asyncio) the standard loop runs the
same code: nothing in the supervisor depends on which loop it is.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV_VAR = "TOKENPIPE_EVENT_LOOP"  # "asyncio" forces the standard loop


def loop_name() -> str:
    """The loop `run` uses: uvloop when importable and not turned off, else asyncio."""
    if os.environ.get(ENV_VAR, "").strip().lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `loop_name()` names."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
