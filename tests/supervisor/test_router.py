"""Routing choices and planning, without processes."""

from __future__ import annotations

import pytest

from supervisor.pool import detect_gpus, plan_devices, worker_specs
from supervisor.router import (
    WorkerLoad,
    WorkerState,
    choose_worker,
    restart_delay,
    route_request,
    should_give_up,
)

R, S, F = WorkerState.READY, WorkerState.STARTING, WorkerState.FAILED


def load(
    index: int,
    queued: int = 0,
    named: int = 0,
    state: WorkerState = R,
    max_named: int = 3,
    max_queue: int = 4,
) -> WorkerLoad:
    return WorkerLoad(index, state, queued, named, max_named, max_queue)


def test_least_loaded_wins_and_ties_go_to_lowest_index() -> None:
    assert choose_worker([load(0, 2), load(1, 1), load(2, 1)], needs_session_slot=False).worker == 1
    assert (
        choose_worker([load(0, 1, named=2), load(1, 1, named=1)], needs_session_slot=False).worker
        == 1
    )


def test_ready_workers_are_preferred_over_starting_ones() -> None:
    assert choose_worker([load(0, 0, state=S), load(1, 3)], needs_session_slot=False).worker == 1
    assert (
        choose_worker([load(0, 0, state=S), load(1, 0, state=F)], needs_session_slot=False).worker
        == 0
    )


def test_full_queues_answer_overloaded() -> None:
    route = choose_worker([load(0, 4), load(1, 4)], needs_session_slot=False)
    assert route.worker is None and route.error_code == "overloaded"


def test_new_session_needs_a_free_named_slot() -> None:
    route = choose_worker([load(0, 0, named=3), load(1, 3, named=1)], needs_session_slot=True)
    assert route.worker == 1
    route = choose_worker([load(0, named=3), load(1, named=3)], needs_session_slot=True)
    assert route.error_code == "capacity_exhausted"


def test_workers_without_named_sessions_say_so() -> None:
    """--max-sessions 1: nothing to close, so not "in use" but what to start with."""
    route = choose_worker([load(0, max_named=0), load(1, max_named=0)], needs_session_slot=True)
    assert route.error_code == "capacity_exhausted" and "--max-sessions 2" in route.error
    route = choose_worker([load(0, max_named=0), load(1, named=3)], needs_session_slot=True)
    assert "in use" in route.error


def test_no_live_worker_is_unavailable() -> None:
    assert choose_worker([load(0, state=F)], needs_session_slot=False).error_code == "unavailable"


def test_session_affinity_ignores_load() -> None:
    loads = [load(0, 3), load(1, 0)]
    assert route_request("generate", "s", {"s": 0}, loads).worker == 0
    assert route_request("close", "s", {"s": 0}, loads).worker == 0
    assert route_request("reset", "s", {"s": 0}, loads).worker == 0


def test_new_session_is_placed_on_least_loaded() -> None:
    route = route_request("open", "t", {"s": 0}, [load(0, 1, named=1), load(1, 0)])
    assert route.worker == 1 and route.new_placement
    route = route_request("generate", "t", {}, [load(0, 1), load(1, 0)])
    assert route.worker == 1 and route.new_placement


def test_session_on_failed_worker_moves() -> None:
    route = route_request("generate", "s", {"s": 0}, [load(0, state=F), load(1)])
    assert route.worker == 1 and route.new_placement


def test_placed_session_with_full_queue_is_overloaded_not_moved() -> None:
    route = route_request("generate", "s", {"s": 0}, [load(0, 4), load(1, 0)])
    assert route.worker is None and route.error_code == "overloaded"


def test_control_ops_ignore_the_queue_bound() -> None:
    assert route_request("tokenize", "", {}, [load(0, 4)]).worker == 0


def test_backoff_grows_and_caps() -> None:
    delays = [restart_delay(n, 0.5, 4.0) for n in range(6)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert not should_give_up(2, 3) and should_give_up(3, 3)


def test_plan_devices() -> None:
    assert plan_devices("all", None, ["0", "1"]) == ["0", "1"]
    assert plan_devices("all", None, []) == [None]
    assert plan_devices("none", None, ["0"]) == [None]
    assert plan_devices("1", None, ["4", "5"]) == ["5"]
    assert plan_devices("all", 3, ["0"]) == [None, None, None]
    with pytest.raises(ValueError):
        plan_devices("2", None, ["0"])
    with pytest.raises(ValueError):
        plan_devices("gpu", None, ["0"])


def test_detect_gpus_reads_cuda_visible_devices() -> None:
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_worker_specs_pin_one_gpu_each() -> None:
    specs = worker_specs(["w"], ["--model", "m"], ["3", None])
    assert specs[0].env == {"CUDA_VISIBLE_DEVICES": "3"} and specs[0].argv[-2:] == (
        "--device",
        "cuda",
    )
    assert specs[1].env == {} and specs[1].argv == ("w", "--model", "m", "--device", "cpu")


def test_worker_stderr_is_prefixed_and_progress_redraws_are_relayed() -> None:
    from supervisor.pool import WorkerProcess, WorkerSpec

    out: list[bytes] = []
    proc = WorkerProcess(WorkerSpec(3, ("w",)), lambda lines: None, lambda p: None, out.append)
    proc._on_stderr(b"loading\nhalf a li")
    assert out == [b"[worker 3] loading\n"]
    proc._on_stderr(b"ne\n\rbar 1/3\rbar 2/3")
    assert out[1] == b"[worker 3] half a line\n\r[worker 3] bar 1/3"
    assert list(proc.stderr_tail) == ["loading", "half a line"]
