"""Pure tests of the step plan (worker/engine/scheduler.py); no torch."""

from __future__ import annotations

import pytest

from worker.engine.scheduler import (
    PrefillChunk,
    QueuedItem,
    RunningItem,
    StepPlan,
    plan_admission,
    plan_step,
)


def gen(key: int, session: str | None = None, lane: bool = False, slot: bool = True) -> QueuedItem:
    return QueuedItem(key, session, lane, True, slot)


def op(key: int, session: str | None = None, lane: bool = True) -> QueuedItem:
    return QueuedItem(key, session, lane, False, False)


def run(key: int, session: str | None = None, lane: bool = False, left: int = 0) -> RunningItem:
    return RunningItem(key, session, lane, left)


def test_plan_step_decodes_all_and_one_prefill_chunk() -> None:
    plan = plan_step([run(1), run(2, left=1000), run(3), run(4, left=5)], prefill_chunk=256)
    assert plan == StepPlan(decode=(1, 3), prefill=PrefillChunk(2, 256))
    last = plan_step([run(2, left=100)], prefill_chunk=256)
    assert last.prefill == PrefillChunk(2, 100) and last.decode == ()
    assert plan_step([], 8).empty
    with pytest.raises(ValueError):
        plan_step([], 0)


def test_in_order_lane_one_at_a_time() -> None:
    queue = [gen(1, lane=True), gen(2, lane=True), op(3)]
    assert plan_admission(queue, [], free_slots=4) == (1,)
    # while 1 runs, nothing else of the lane starts
    assert plan_admission(queue[1:], [run(1, lane=True)], free_slots=3) == ()
    # ops of the lane before a generate run at once, in order
    assert plan_admission([op(5), op(6), gen(7, lane=True), op(8)], [], 4) == (5, 6, 7)


def test_id_requests_run_together() -> None:
    queue = [gen(1), gen(2), gen(3, session="a", slot=True)]
    assert plan_admission(queue, [run(0, lane=True)], free_slots=3) == (1, 2, 3)


def test_slots_limit_anonymous_in_order() -> None:
    queue = [gen(1), gen(2), gen(3, session="s", slot=False)]
    # one slot: only 1 starts; 2 waits; the existing session "s" needs no slot
    assert plan_admission(queue, [], free_slots=1) == (1, 3)


def test_same_session_serialised() -> None:
    queue = [
        gen(1, session="a", slot=False),
        gen(2, session="a", slot=False),
        gen(3, "b", slot=False),
    ]
    assert plan_admission(queue, [], 2) == (1, 3)
    assert plan_admission(queue[1:], [run(1, session="a")], 2) == (3,)
    # a session op queues behind the session's running generate
    assert plan_admission([op(9, session="a", lane=False)], [run(1, session="a")], 2) == ()


def test_lane_item_blocked_by_session_blocks_lane() -> None:
    queue = [gen(1, session="a", lane=True, slot=False), op(2)]
    assert plan_admission(queue, [run(0, session="a")], 2) == ()


def test_waiting_lane_item_keeps_session_order() -> None:
    # an id-less generate on "a" waits for the lane; a later id'd one on "a" waits behind it
    queue = [gen(1, session="a", lane=True, slot=False), gen(2, session="a", slot=False)]
    assert plan_admission(queue, [run(0, lane=True)], 2) == ()
