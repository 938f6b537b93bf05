"""The shared-prefix cache on a hybrid model (qwen3_5_moe: full layers' KV blocks plus DeltaNet
states at some block ends, worker/engine/prefix_cache.py) through the real Engine: every
continuation built from cached blocks and states is token-identical (greedy) to the same prompt
in an engine without the cache. A tiny random model with the 35B-A3B layout; blocks of 8 tokens,
prefill chunks of 16 (so chunk ends fall on block ends)."""

from __future__ import annotations

from typing import Any

import pytest
from test_engine_qwen3_5_moe import gen, ids, make_engine, model, run  # noqa: F401

from protocol import DoneEvent
from worker.engine.engine import Engine
from worker.engine.prefix_cache import block_keys

BLOCK = 8


def cached_engine(model: Any, budget: int = 8 << 20, **overrides: Any) -> Engine:  # noqa: F811
    settings = {"prefix_cache_bytes": budget, "prefix_block": BLOCK, **overrides}
    return make_engine(model, **settings)


def cold_engine(model: Any) -> Engine:  # noqa: F811
    model.prepare_for_cpu = lambda: 0  # packed once: the engines share the model
    return make_engine(model)


def turn(engine: Engine, prompt: list[int], session: str | None = None, n: int = 8) -> DoneEvent:
    (done,) = run(engine, gen(prompt, session, n=n))
    return done


def expected(cold: Engine, prompt: list[int], n: int = 8) -> list[int] | None:
    return turn(cold, prompt, None, n).generated_token_ids


def state_ends(engine: Engine, prompt: list[int]) -> list[int]:
    """The block ends of ``prompt``'s cached chain that hold a DeltaNet state."""
    cache = engine.prefix_cache
    assert cache is not None
    out = []
    for b, key in enumerate(block_keys(prompt, BLOCK)):
        entry = cache.blocks.get(key)
        if entry is not None and entry.state is not None:
            out.append((b + 1) * BLOCK)
    return out


def test_shared_prefixes_equal_a_cold_prefill(model: Any) -> None:  # noqa: F811
    engine = cached_engine(model)
    cold = cold_engine(model)
    first = ids(45, 1)  # chunks 16, 16, 13: states at the chunk ends 16, 32, and at 40
    done = turn(engine, first)
    assert done.reused_prompt_tokens == 0
    assert done.generated_token_ids == expected(cold, first)
    assert state_ends(engine, first) == [16, 32, 40]
    stats = engine.stats()["prefix_cache"]
    assert (stats["blocks"], stats["states"], stats["hits"]) == (5, 3, 0), stats

    # diverging at a block end (40): every block and the state there; a named session
    at_end = first[:40] + ids(9, 2)
    done = turn(engine, at_end, "a")
    assert (done.reused_prompt_tokens, done.prefilled_prompt_tokens) == (40, 9)
    assert done.session_reset_reason == "new"
    assert done.generated_token_ids == expected(cold, at_end)

    # diverging inside block 4 (at 37): the blocks before it, the state at 32; a scratch one
    inside = first[:37] + ids(10, 3)
    done = turn(engine, inside)
    assert done.reused_prompt_tokens == 32 and done.session_reset_reason == "new"
    assert done.generated_token_ids == expected(cold, inside)

    # diverging inside block 3 (at 29): the chain reaches 24, which has no state: back to 16,
    # `truncated`; the prefill keeps a state at 24 (where it left the chain) for the next one
    branch = first[:29] + ids(12, 4)
    done = turn(engine, branch, "b")
    assert done.reused_prompt_tokens == 16 and done.session_reset_reason == "truncated"
    assert done.generated_token_ids == expected(cold, branch)
    assert 24 in state_ends(engine, branch)
    again = first[:29] + ids(12, 5)
    done = turn(engine, again)
    assert done.reused_prompt_tokens == 24 and done.session_reset_reason == "new"
    assert done.generated_token_ids == expected(cold, again)

    stats = engine.stats()["prefix_cache"]
    assert stats["hits"] == 5 + 4 + 2 + 3, stats  # blocks reused
    assert stats["hit_tokens"] == 40 + 32 + 16 + 24, stats
    assert stats["truncated"] == 1 and stats["evictions"] == 0, stats


def test_prompt_shorter_than_a_block_and_the_same_prompt_again(model: Any) -> None:  # noqa: F811
    engine = cached_engine(model)
    cold = cold_engine(model)
    short = ids(6, 6)
    assert turn(engine, short).generated_token_ids == expected(cold, short)
    assert engine.stats()["prefix_cache"]["blocks"] == 0
    done = turn(engine, short, "s")
    assert done.reused_prompt_tokens == 0
    assert done.generated_token_ids == expected(cold, short)

    # a prompt of exactly two blocks: its last block end before the final token is 8
    exact = ids(16, 7)
    turn(engine, exact)
    assert state_ends(engine, exact) == [8, 16]
    done = turn(engine, exact, "t")
    assert (done.reused_prompt_tokens, done.prefilled_prompt_tokens) == (8, 8)
    assert done.generated_token_ids == expected(cold, exact)
    # a longer prompt starting with it reuses both blocks (the state at 16, a chunk end)
    longer = exact + ids(5, 8)
    done = turn(engine, longer)
    assert done.reused_prompt_tokens == 16
    assert done.generated_token_ids == expected(cold, longer)


def test_chunked_prefill_of_a_long_prompt(model: Any) -> None:  # noqa: F811
    """Chunks of 32 over blocks of 8: states only at chunk ends and the prompt's last block
    end; a prompt diverging between them reuses up to the nearest one below."""
    engine = cached_engine(model, prefill_chunk=32)
    cold = cold_engine(model)
    first = ids(100, 9)  # chunks end at 32, 64, 96 (96: the last block end before 99 too)
    assert turn(engine, first, n=4).generated_token_ids == expected(cold, first, n=4)
    assert state_ends(engine, first) == [32, 64, 96]
    for shared, reused in ((96, 96), (90, 64), (70, 64), (40, 32)):
        prompt = first[:shared] + ids(20, 10 + shared)
        done = turn(engine, prompt, n=4)
        assert done.reused_prompt_tokens == reused, (shared, done)
        assert done.generated_token_ids == expected(cold, prompt, n=4), shared


def test_eviction_under_a_tiny_budget(model: Any) -> None:  # noqa: F811
    probe = cached_engine(model)
    cache = probe.prefix_cache
    assert cache is not None
    budget = 2 * cache.state_bytes + 8 * cache.block_bytes  # 2 states, 8 blocks
    model.prepare_for_cpu = lambda: 0  # packed once: the engines share the model
    engine = cached_engine(model, budget=budget)
    cold = cold_engine(model)
    stats = engine.stats()["prefix_cache"]
    assert (stats["capacity_blocks"], stats["capacity_states"]) == (8, 2), stats
    a, b = ids(33, 11), ids(33, 12)  # 4 blocks each; states at 16, 32 each
    turn(engine, a)
    turn(engine, b)  # b's states push out a's
    stats = engine.stats()["prefix_cache"]
    assert stats["state_evictions"] == 2 and stats["blocks"] == 8, stats
    prompt = a[:32] + ids(4, 13)
    done = turn(engine, prompt)  # a's blocks are there but no state: nothing reused
    assert done.reused_prompt_tokens == 0 and done.session_reset_reason == "truncated"
    assert done.generated_token_ids == expected(cold, prompt)
    prompt = b[:32] + ids(4, 14)
    done = turn(engine, prompt)
    assert done.reused_prompt_tokens in (0, 16, 32)  # b's states may have gone in turn
    assert done.generated_token_ids == expected(cold, prompt)
    c = ids(40, 15)  # five blocks: the least recently used ones go
    turn(engine, c)
    stats = engine.stats()["prefix_cache"]
    assert stats["blocks"] <= 8 and stats["evictions"] > 0 and stats["states"] <= 2, stats
    done = turn(engine, c[:33] + ids(3, 16))
    assert done.reused_prompt_tokens == 32
    assert done.generated_token_ids == expected(cold, c[:33] + ids(3, 16))


def test_a_session_built_from_the_cache_rolls_back_and_goes_on(model: Any) -> None:  # noqa: F811
    engine = cached_engine(model)
    cold = cold_engine(model)
    system = ids(40, 20)
    turn(engine, system + ids(7, 21))  # another session's prompt fills the cache
    p1 = system + ids(6, 22)
    d1 = turn(engine, p1, "s")
    assert d1.reused_prompt_tokens == 40
    g1 = d1.generated_token_ids or []
    assert g1 == expected(cold, p1)
    p2 = p1 + g1 + ids(5, 23)  # append-only: the live state
    d2 = turn(engine, p2, "s")
    assert d2.session_reset_reason == "exact_prefix"
    assert d2.generated_token_ids == expected(cold, p2)
    d3 = turn(engine, p2, "s")  # regenerate: the slot's snapshot before the last token
    assert d3.reused_prompt_tokens == len(p2) - 1
    assert d3.generated_token_ids == d2.generated_token_ids
    p3 = p1 + ids(9, 24)  # the reply rewritten: back to the prompt-end snapshot of turn 1
    d4 = turn(engine, p3, "s")
    assert d4.reused_prompt_tokens == len(p1) - 1
    assert d4.generated_token_ids == expected(cold, p3)
    p4 = system[:20] + ids(10, 25)  # before every snapshot of the slot: the cache's state
    d5 = turn(engine, p4, "s")
    assert d5.reused_prompt_tokens == 16
    assert d5.generated_token_ids == expected(cold, p4)


def test_a_failed_step_gives_the_state_rows_back(model: Any) -> None:  # noqa: F811
    engine = cached_engine(model)
    cache = engine.prefix_cache
    assert cache is not None
    free = len(cache._free_states)
    prompt = ids(20, 30)
    pending = cache.begin(prompt, block_keys(prompt, BLOCK), 0, 0, 0, 16, (8,))
    assert pending is not None and len(pending.states) == 2  # at 8 (a point) and 16 (the end)
    cache.finish(pending, 0, 0, ok=False)
    assert len(cache._free_states) == free and not cache.blocks


def test_the_prefill_warm_up_leaves_nothing_behind(model: Any) -> None:  # noqa: F811
    """``Engine.warm_up_prefill`` (a CUDA start runs it): two chunks and an odd tail through the
    real path, a prefix-cache state inside the tail's step included; afterwards the cache, the
    counters and the slots are as a fresh engine's, and prompts give the cold engine's tokens
    and share prefixes."""
    engine = cached_engine(model, prefill_chunk=32)
    cold = cold_engine(model)
    before = engine.stats()
    assert engine.warm_up_prefill() == 2 * 32 + 25
    after = engine.stats()
    for key in ("prefix_cache", "steps", "generated_tokens", "free_slots", "session_ids"):
        assert after[key] == before[key], key
    first = ids(100, 9)
    assert turn(engine, first, "a", n=4).generated_token_ids == expected(cold, first, n=4)
    assert state_ends(engine, first) == [32, 64, 96]
    done = turn(engine, first[:96] + ids(20, 3), n=4)
    assert done.reused_prompt_tokens == 96

    short = make_engine(model, max_context=40)
    assert short.warm_up_prefill() == 37  # capped by the context


def test_a_failed_prefill_warm_up_says_so_and_leaves_nothing_behind(
    model: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm-up step that fails (out of memory, say) raises after the engine is idle again:
    the slot back, the cache forgotten; the worker logs it and serves on."""
    engine = cached_engine(model, prefill_chunk=32)
    before = engine.stats()
    real = engine.model.forward
    calls = []

    def failing(step: Any, kv: Any) -> Any:
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (a test)")
        return real(step, kv)

    monkeypatch.setattr(engine.model, "forward", failing)
    with pytest.raises(RuntimeError, match="the prefill warm-up failed: .*a test"):
        engine.warm_up_prefill()
    assert len(calls) == 2
    monkeypatch.undo()
    after = engine.stats()
    for key in ("prefix_cache", "steps", "generated_tokens", "free_slots", "session_ids"):
        assert after[key] == before[key], key
    cold = cold_engine(model)
    prompt = ids(50, 4)
    assert turn(engine, prompt, "a", n=4).generated_token_ids == expected(cold, prompt, n=4)
