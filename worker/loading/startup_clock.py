"""The worker's start-up steps on one clock: each step's time on stderr as it ends, and the
totals for the `ready` log line.

    clock = StartupClock(log)
    with clock.step("load"):
        ...
    log(f"ready ... ({clock.summary()})")
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def process_age_seconds() -> float | None:
    """Seconds since this process was spawned (interpreter start and imports included), from
    /proc (both figures count from boot in clock ticks; psutil's create_time rounds the boot
    time to whole seconds). None where /proc is missing."""
    try:
        with open("/proc/uptime") as uptime_file:
            uptime = float(uptime_file.read().split()[0])
        with open("/proc/self/stat") as stat_file:
            fields = stat_file.read().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Named steps timed in order; `steps` holds (name, seconds) of each finished one."""

    def __init__(
        self,
        log: Callable[[str], None],
        now: Callable[[], float] = time.perf_counter,
        process_age: Callable[[], float | None] = process_age_seconds,
    ) -> None:
        self._log = log
        self._now = now
        self._process_age = process_age
        self._started = now()
        self.steps: list[tuple[str, float]] = []

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the body; log `<name> in <s>s` when it ends (not when it raises)."""
        started = self._now()
        yield
        seconds = self._now() - started
        self.steps.append((name, seconds))
        self._log(f"{name} in {seconds:.1f}s")

    def summary(self) -> str:
        """`12.3s since spawn, 10.1s of start-up: load 2.0s, cuda setup 3.1s, ...`"""
        parts = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.steps)
        text = f"{self._now() - self._started:.1f}s of start-up: {parts}"
        age = self._process_age()
        return text if age is None else f"{age:.1f}s since spawn, {text}"
