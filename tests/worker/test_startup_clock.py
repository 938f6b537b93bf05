"""The start-up clock: each step logged with its time as it ends, the ready line's totals."""

from __future__ import annotations

import pytest

from worker.loading.startup_clock import StartupClock


def test_steps_are_logged_in_order_and_summed_in_the_summary() -> None:
    ticks = iter([0.0, 1.0, 3.5, 4.0, 4.25, 10.0])
    lines: list[str] = []
    clock = StartupClock(lines.append, now=lambda: next(ticks), process_age=lambda: 12.0)
    with clock.step("loaded"):
        pass
    with clock.step("KV cache"):
        pass
    assert lines == ["loaded in 2.5s", "KV cache in 0.2s"]
    assert clock.steps == [("loaded", 2.5), ("KV cache", 0.25)]
    assert clock.summary() == "12.0s since spawn, 10.0s of start-up: loaded 2.5s, KV cache 0.2s"


def test_a_failed_step_is_not_logged_as_done() -> None:
    lines: list[str] = []
    clock = StartupClock(lines.append, process_age=lambda: None)
    with pytest.raises(RuntimeError), clock.step("loaded"):
        raise RuntimeError("no weights")
    assert lines == [] and clock.steps == []
    assert clock.summary().endswith("of start-up: ")
