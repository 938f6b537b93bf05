"""Tiers on a hybrid cache (qwen3_5_moe: full-layer KV + DeltaNet state + snapshots): a
session whose cache went to host memory or disk and came back resumes, rolls back to its
snapshots, and continues exactly as one that never left its slot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_engine_qwen3_5_moe import gen, ids, make_engine, model, run  # noqa: F401


def conversation(engine: Any, names: list[str]) -> dict[str, list[list[int] | None]]:
    """Three turns per session (append, regenerate from the prompt snapshot, edit back to the
    turn-end snapshot), the sessions taking turns so that slots change hands between them."""
    out: dict[str, list[list[int] | None]] = {name: [] for name in names}
    prompts = {name: ids(20, 10 + i) for i, name in enumerate(names)}
    first: dict[str, list[int]] = {}
    for name in names:
        (done,) = run(engine, gen(prompts[name], name, n=6))
        first[name] = done.generated_token_ids or []
        out[name].append(done.generated_token_ids)
    for name in names:
        p2 = prompts[name] + first[name] + ids(5, 30)
        (done,) = run(engine, gen(p2, name, n=6))
        out[name].append(done.generated_token_ids)
        (again,) = run(engine, gen(p2, name, n=6))  # regenerate: the prompt snapshot
        assert again.reused_prompt_tokens == len(p2) - 1
        out[name].append(again.generated_token_ids)
    for name in names:
        p3 = prompts[name] + first[name] + ids(4, 40)  # edit: the end of turn 1
        (done,) = run(engine, gen(p3, name, n=6))
        assert done.reused_prompt_tokens == len(prompts[name]) + len(first[name]) - 1
        out[name].append(done.generated_token_ids)
    return out


def test_hybrid_sessions_offloaded_equal_resident(model: Any, tmp_path: Path) -> None:  # noqa: F811
    names = ["a", "b", "c", "d"]
    resident = conversation(make_engine(model, max_sessions=5), names)
    model.prepare_for_cpu = lambda: 0  # packed once: the second engine shares the model
    engine = make_engine(model, max_sessions=5, max_resident=2, session_dir=str(tmp_path))
    # a host tier for one session: the others go to disk
    engine.tiers.host.budget_bytes = engine.kv.export_slot(0, 0).nbytes + 1  # type: ignore[union-attr]
    tiered = conversation(engine, names)
    assert tiered == resident
    stats = engine.stats()["tiers"]
    assert stats["reloads"] >= 8 and stats["disk_writes"] >= 1, stats
