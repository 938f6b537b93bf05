"""Resume planning: how much of a session's resident KV a new prompt can keep (pure).

A named session keeps its resident token ids between requests. A new prompt that starts
with (part of) those ids only needs its suffix prefilled. This module decides how many
resident tokens to keep and why; the engine applies the decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Reasons reported in `done.session_reset_reason`.
NEW = "new"  # the session held nothing
EXACT_PREFIX = "exact_prefix"  # every resident token is a prefix of the prompt
MISMATCH = "mismatch"  # the prompt diverges from the resident ids (or is a strict prefix)
DIRTY = "dirty"  # the session was dirty (failed or stop-trimmed turn): nothing kept
EQUAL = "equal"  # prompt == resident ids: the last token is re-fed to get logits
TRUNCATED = "truncated"  # the cache could keep fewer tokens than the common prefix

KeepableFn = Callable[[int, int], int]


@dataclass(frozen=True)
class ResumePlan:
    """Keep `resident[:keep]`, prefill `prompt[keep:]` (never empty)."""

    keep: int
    reason: str


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    limit = min(len(a), len(b))
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def plan_resume(
    resident: Sequence[int],
    prompt: Sequence[int],
    *,
    dirty: bool = False,
    warm_resume: bool = True,
    keepable_prefix: KeepableFn | None = None,
) -> ResumePlan:
    """Decide how much of `resident` to keep for `prompt` (which must not be empty).

    Invariants of the result: `0 <= keep < len(prompt)` (at least one prompt token is
    fed, so there are logits to sample from) and `resident[:keep] == prompt[:keep]`.
    `keepable_prefix(cached_len, common_len)` is the KV cache's limit (ring buffers);
    `warm_resume=False` keeps nothing, for comparison runs.
    """
    if not prompt:
        raise ValueError("plan_resume needs a non-empty prompt")
    if dirty:
        return ResumePlan(0, DIRTY)
    if not resident:
        return ResumePlan(0, NEW)
    common = common_prefix_len(resident, prompt)
    if common == len(prompt) == len(resident):
        reason = EQUAL
    elif common == len(resident):
        reason = EXACT_PREFIX
    else:
        reason = MISMATCH
    wanted = min(common, len(prompt) - 1)  # always re-feed at least the last prompt token
    keep = wanted
    if not warm_resume:
        keep = 0
    elif keepable_prefix is not None and keep > 0:
        keep = max(0, min(keep, keepable_prefix(len(resident), keep)))
    if keep < wanted:
        reason = TRUNCATED
    return ResumePlan(keep, reason)
