"""Pure tests of the resume plan (worker/engine/resume.py)."""

from __future__ import annotations

import pytest

from worker.engine.resume import (
    DIRTY,
    EQUAL,
    EXACT_PREFIX,
    MISMATCH,
    NEW,
    TRUNCATED,
    common_prefix_len,
    plan_resume,
)


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_new_session_keeps_nothing() -> None:
    plan = plan_resume([], [1, 2, 3])
    assert (plan.keep, plan.reason) == (0, NEW)


def test_exact_prefix_keeps_all_resident() -> None:
    plan = plan_resume([1, 2, 3], [1, 2, 3, 4, 5])
    assert (plan.keep, plan.reason) == (3, EXACT_PREFIX)


def test_mismatch_keeps_common_prefix() -> None:
    plan = plan_resume([1, 2, 3, 9], [1, 2, 3, 4, 5])
    assert (plan.keep, plan.reason) == (3, MISMATCH)


def test_equal_prompt_refeeds_last_token() -> None:
    plan = plan_resume([1, 2, 3], [1, 2, 3])
    assert (plan.keep, plan.reason) == (2, EQUAL)
    single = plan_resume([7], [7])
    assert (single.keep, single.reason) == (0, EQUAL)


def test_prompt_shorter_than_resident() -> None:
    plan = plan_resume([1, 2, 3, 4], [1, 2, 3])
    assert (plan.keep, plan.reason) == (2, MISMATCH)


def test_dirty_keeps_nothing() -> None:
    plan = plan_resume([1, 2, 3], [1, 2, 3, 4], dirty=True)
    assert (plan.keep, plan.reason) == (0, DIRTY)


def test_keepable_prefix_truncates() -> None:
    plan = plan_resume([1, 2, 3, 4], [1, 2, 3, 4, 5], keepable_prefix=lambda cached, common: 2)
    assert (plan.keep, plan.reason) == (2, TRUNCATED)
    # a cache that can keep everything changes nothing
    full = plan_resume([1, 2, 3, 4], [1, 2, 3, 4, 5], keepable_prefix=lambda c, n: n)
    assert (full.keep, full.reason) == (4, EXACT_PREFIX)


def test_no_warm_resume() -> None:
    plan = plan_resume([1, 2, 3], [1, 2, 3, 4], warm_resume=False)
    assert (plan.keep, plan.reason) == (0, TRUNCATED)
    assert plan_resume([5], [1, 2], warm_resume=False).reason == MISMATCH


def test_empty_prompt_rejected() -> None:
    with pytest.raises(ValueError):
        plan_resume([1], [])


def test_invariants_random() -> None:
    import random

    rng = random.Random(0)
    for _ in range(500):
        resident = [rng.randrange(3) for _ in range(rng.randrange(6))]
        prompt = [rng.randrange(3) for _ in range(1 + rng.randrange(6))]
        plan = plan_resume(resident, prompt, keepable_prefix=lambda c, n: n - (n % 2))
        assert 0 <= plan.keep < len(prompt)
        assert resident[: plan.keep] == prompt[: plan.keep]
