"""Sessions beyond the device slots (issue 16): no bleed between sessions whose caches move
between device slots, host memory and disk, on the default model (Gemma 3 270M, CPU).

The model's sliding window is shrunk to 24 (a ring of 40 entries) so that short
conversations wrap their rings, and a slot state has to carry a wrapped ring exactly. Both
runs (interleaved, and each conversation replayed alone) use that same model.

`TOKENPIPE_NO_BLEED_TURNS` sets the number of turns (CI: 100; the issue's 1,000 takes about
six times as long).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from protocol import (
    CloseRequest,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateRequest,
    IdsSegment,
    OpenRequest,
)
from worker.engine.engine import Engine, EngineConfig

WINDOW = 24
MAX_CONTEXT = 96
TURNS = int(os.environ.get("TOKENPIPE_NO_BLEED_TURNS", "100"))


@pytest.fixture(scope="module")
def loaded(default_model_dir: Path) -> Any:
    from worker.loading.loader import load_model

    torch.set_num_threads(1)  # as the workers in the tests (--threads 1): 2 shared cores
    torch.manual_seed(0)
    loaded = load_model(default_model_dir, "cpu", torch.float32, progress=False)
    model = loaded.model
    model.config = dataclasses.replace(model.config, sliding_window=WINDOW)
    model.prepare_for_cpu()  # once: the engines below share the model (a repack would fail)
    model.prepare_for_cpu = lambda: 0
    return loaded


def make_engine(loaded: Any, log: Any = None, **overrides: Any) -> Engine:
    settings: dict[str, Any] = {
        "max_sessions": 65,
        "max_context": MAX_CONTEXT,
        "prefill_chunk": 64,
        "prefix_cache_bytes": 0,
        **overrides,
    }
    shim = SimpleNamespace(
        model=loaded.model, tokenizer=loaded.tokenizer, config=loaded.config, meta={}
    )
    return Engine(shim, EngineConfig(**settings), "cpu", log=log or (lambda _m: None))


def drive(engine: Engine, *requests: Any) -> list[Event]:
    events: list[Event] = []
    for r in requests:
        events.extend(engine.submit(r))
    for _ in range(100_000):
        if engine.idle:
            return events
        events.extend(engine.step())
    raise AssertionError("engine did not finish")


def turn(sid: str, prompt: list[int], n: int, rid: Any) -> GenerateRequest:
    return GenerateRequest(
        prompt_segments=[IdsSegment(ids=prompt)],
        add_prefix=False,
        max_new_tokens=n,
        session_id=sid,
        id=rid,
    )


def done_of(events: list[Event], rid: Any) -> DoneEvent:
    ends = [e for e in events if isinstance(e, (DoneEvent, ErrorEvent)) and e.id == rid]
    assert len(ends) == 1 and isinstance(ends[0], DoneEvent), ends
    return ends[0]


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 20_000) for _ in range(n)]


def play(engine: Engine, sessions: int, turns: int, seed: int) -> dict[str, list[Any]]:
    """Random conversations, several sessions' turns in flight at once. Returns each
    session's (prompt, generated ids) turns, in order."""
    rng = random.Random(seed)
    bos = engine.prefix_ids
    history: dict[str, list[int]] = {}
    log: dict[str, list[Any]] = {f"s{i}": [] for i in range(sessions)}
    rid = 0
    done_turns = 0
    while done_turns < turns:
        batch = rng.sample(sorted(log), rng.randint(1, 4))
        requests = []
        for sid in batch:
            past = history.get(sid)
            n = rng.randint(1, 4)
            if past is None or len(past) + 12 + n > MAX_CONTEXT:
                prompt = bos + words(rng, rng.randint(3, 10))  # new conversation
            elif rng.random() < 0.25:
                prompt = past[: rng.randint(1, len(past))] + words(rng, rng.randint(1, 4))
            else:
                prompt = past + words(rng, rng.randint(1, 6))  # append
            rid += 1
            requests.append((sid, prompt, turn(sid, prompt, n, rid)))
        events = drive(engine, *(r for _, _, r in requests))
        for sid, prompt, request in requests:
            done = done_of(events, request.id)
            generated = list(done.generated_token_ids or [])
            log[sid].append((prompt, request.max_new_tokens, generated))
            history[sid] = prompt + generated
            done_turns += 1
    return log


def replay_alone(engine: Engine, log: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    rid = 0
    for sid, turns in log.items():
        drive(engine, OpenRequest(session_id="solo"))
        out[sid] = []
        for prompt, n, _ in turns:
            rid += 1
            events = drive(engine, turn("solo", prompt, n, rid))
            out[sid].append(list(done_of(events, rid).generated_token_ids or []))
        drive(engine, CloseRequest(session_id="solo"))
    return out


@pytest.mark.timeout(max(300, 2 * TURNS))  # the full 1,000 turns run past the default 300 s
def test_no_bleed_64_sessions_8_slots(loaded: Any, tmp_path: Path) -> None:
    """64 sessions on 8 slots, a host tier for a few of them and the rest on disk: every
    continuation equals the same conversation replayed alone."""
    t0 = time.perf_counter()
    engine = make_engine(
        loaded,
        max_resident=8,
        host_cache_bytes=8 << 20,
        session_dir=str(tmp_path),
        prefix_cache_bytes=128 << 20,  # shared blocks of 16 tokens too (the alone run has none)
        prefix_block=16,
    )
    log = play(engine, sessions=64, turns=TURNS, seed=16)
    t_play = time.perf_counter() - t0
    assert engine.stats()["prefix_cache"]["inserts"] > 0
    pool, tiers = engine.host_pool, engine.tiers
    assert pool is not None and tiers is not None and tiers.store is not None
    tiers.store.flush()  # the writes asked for are done (disk_writes counts them)
    stats = engine.stats()["tiers"]
    assert stats["offloads"] >= TURNS // 8 and stats["reloads"] >= (TURNS - 64) // 4, stats
    assert stats["disk_writes"] > 0 and stats["disk_write_errors"] == 0, stats
    assert stats["dropped_caches"] == 0, stats
    # the host copies used the pool's buffers, and every buffer in use is a host copy's
    held = [e.state.buffer for e in tiers.host.entries.values() if e.state.buffer is not None]
    assert len(pool.buffers) >= 2 and held, stats
    assert sum(b.holders for b in pool.buffers) == len(held), stats
    # the sessions really kept their caches: most turns reused tokens
    alone = replay_alone(make_engine(loaded, max_sessions=2), log)
    for sid, turns in log.items():
        assert [g for _, _, g in turns] == alone[sid], sid
    print(f"{TURNS} turns: {t_play:.1f} s interleaved, {time.perf_counter() - t0:.1f} s in all")


def test_no_bleed_with_shared_blocks(loaded: Any) -> None:
    """Fewer, longer conversations (rollbacks past the rings reuse earlier blocks): the
    interleaved run with shared 16-token blocks gives what each replayed alone without."""
    engine = make_engine(
        loaded, max_sessions=7, max_resident=4, prefix_cache_bytes=6 << 20, prefix_block=16
    )
    log = play(engine, sessions=6, turns=80, seed=7)
    shared = engine.stats()["prefix_cache"]
    assert shared["hits"] > 0 and shared["evictions"] > 0, shared
    alone = replay_alone(make_engine(loaded, max_sessions=2), log)
    for sid, turns in log.items():
        assert [g for _, _, g in turns] == alone[sid], sid


def one_turn(engine: Engine, sid: str | None, prompt: list[int], n: int = 3) -> DoneEvent:
    request = GenerateRequest(
        prompt_segments=[IdsSegment(ids=prompt)],
        add_prefix=False,
        max_new_tokens=n,
        session_id=sid,
        id="t",
    )
    return done_of(drive(engine, request), "t")


def test_restart_restores_sessions_and_bad_files_rebuild(loaded: Any, tmp_path: Path) -> None:
    rng = random.Random(3)
    first = make_engine(loaded, max_sessions=4, session_dir=str(tmp_path))
    bos = first.prefix_ids
    prompt = bos + words(rng, 60)  # wraps the 40-entry rings
    generated = one_turn(first, "chat", prompt).generated_token_ids or []
    follow = prompt + generated + words(rng, 5)
    first.close()  # shutdown: saved
    path = first.tiers.store.path_for("chat")  # type: ignore[union-attr]
    assert path.exists()
    expected = one_turn(first, "chat", follow)  # the first worker, continuing in memory

    logs: list[str] = []
    second = make_engine(loaded, logs.append, max_sessions=4, session_dir=str(tmp_path))
    logs.clear()  # "restored 1 session(s)"
    assert second.restored_sessions == 1 and second.stats()["sessions"] == 1
    done = one_turn(second, "chat", follow)
    assert done.session_reset_reason == "exact_prefix"
    assert done.reused_prompt_tokens == len(prompt) + len(generated) - 1
    assert done.generated_token_ids == expected.generated_token_ids
    assert not logs

    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # a corrupt payload: found at start (header fine), refused at use
    path.write_bytes(bytes(raw))
    third = make_engine(loaded, logs.append, max_sessions=4, session_dir=str(tmp_path))
    done = one_turn(third, "chat", follow)
    assert done.session_reset_reason == "new" and done.reused_prompt_tokens == 0
    assert done.generated_token_ids == expected.generated_token_ids
    bad = [line for line in logs if str(path) in line]  # read by the prefetch or the turn
    assert len(bad) == 1 and "checksum" in bad[0], logs

    drive(third, CloseRequest(session_id="chat"))
    third.close()
    assert not path.exists()  # close deletes the session's file


def test_shared_prefix_blocks_equal_a_cold_prefill(loaded: Any) -> None:
    rng = random.Random(5)
    shared = make_engine(loaded, max_sessions=4, max_context=700, prefix_cache_bytes=256 << 20)
    cold = make_engine(loaded, max_sessions=4, max_context=700)
    system = shared.prefix_ids + words(rng, 560)
    one_turn(shared, "a", system + words(rng, 8))
    stats = shared.stats()["prefix_cache"]
    assert stats["blocks"] == 2 and stats["hits"] == 0
    for sid in ("b", None):  # a named session and a scratch request
        prompt = system + words(rng, 8)
        done = one_turn(shared, sid, prompt)
        assert done.reused_prompt_tokens == 512, done
        assert done.prefilled_prompt_tokens == len(prompt) - 512
        assert done.generated_token_ids == one_turn(cold, sid, prompt).generated_token_ids
    diverged = system[:300] + words(rng, 20)  # diverges inside block 1
    done = one_turn(shared, "c", diverged)
    assert done.reused_prompt_tokens == 256
    assert done.generated_token_ids == one_turn(cold, "c", diverged).generated_token_ids
    stats = shared.stats()["prefix_cache"]
    assert stats["hits"] == 5 and stats["hit_tokens"] == 2 * 512 + 256, stats

    # one 700-token prefill chunk: the rings drop most of it, the capture keeps every block
    big_chunk = make_engine(
        loaded, max_sessions=4, max_context=700, prefill_chunk=700, prefix_cache_bytes=64 << 20
    )
    one_turn(big_chunk, "a", system + words(rng, 8))
    prompt = system + words(rng, 8)
    done = one_turn(big_chunk, "b", prompt)
    assert done.reused_prompt_tokens == 512, done
    assert done.generated_token_ids == one_turn(cold, "b", prompt).generated_token_ids

    # a block completed by a later turn, whose first positions the rings had dropped by then:
    # its full layers are kept, but a prompt ending with it cannot rebuild the rings
    half = make_engine(loaded, max_sessions=4, max_context=700, prefix_cache_bytes=64 << 20)
    first = one_turn(half, "a", system[:250], n=20)  # 270 resident: block 0 is not in a prompt
    second = system[:250] + list(first.generated_token_ids or []) + words(rng, 30)
    one_turn(half, "a", second)
    assert half.stats()["prefix_cache"]["blocks"] == 1
    prompt = second[:256] + words(rng, 8)
    done = one_turn(half, "b", prompt)
    assert done.reused_prompt_tokens == 0 and done.session_reset_reason == "truncated"
    assert half.stats()["prefix_cache"]["truncated"] == 1

    # LRU by block under a budget of 3 blocks
    assert shared.prefix_cache is not None
    block_bytes = shared.prefix_cache.block_bytes
    tight = make_engine(loaded, max_sessions=4, max_context=700, prefix_cache_bytes=3 * block_bytes)
    one_turn(tight, "a", system + words(rng, 8))
    one_turn(tight, "b", shared.prefix_ids + words(rng, 560))
    stats = tight.stats()["prefix_cache"]
    assert stats["blocks"] == 3 and stats["evictions"] == 1, stats


class Wrapped:
    """A model behind a wrapper holding it as ``inner``, as the CUDA graphs' one does: the
    engine opens --session-dir before building the cache and reads sessions back early."""

    def __init__(self, model: Any) -> None:
        self.inner = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def test_sessions_are_read_back_before_the_first_turn(loaded: Any, tmp_path: Path) -> None:
    rng = random.Random(4)
    first = make_engine(loaded, max_sessions=4, session_dir=str(tmp_path))
    prompts = {sid: first.prefix_ids + words(rng, 50) for sid in ("a", "b")}
    replies = {sid: one_turn(first, sid, p).generated_token_ids or [] for sid, p in prompts.items()}
    first.close()
    shim = SimpleNamespace(
        model=Wrapped(loaded.model), tokenizer=loaded.tokenizer, config=loaded.config, meta={}
    )
    config = EngineConfig(max_sessions=4, max_context=MAX_CONTEXT, prefill_chunk=64,
                          prefix_cache_bytes=0, session_dir=str(tmp_path))  # fmt: skip
    logs: list[str] = []
    second = Engine(shim, config, "cpu", log=logs.append)
    assert second.tiers is not None and second.tiers.store is not None
    store = second.tiers.store
    for _ in range(2000):  # 20 s: a loaded box reads slowly
        if store.prefetched == 2:
            break
        time.sleep(0.01)
    assert store.prefetched == 2 and sorted(second.restored_names) == ["a", "b"]
    for sid, prompt in prompts.items():
        store.path_for(sid).unlink()  # what the turn reads comes from memory
        follow = prompt + replies[sid] + words(rng, 3)
        done = one_turn(second, sid, follow)
        assert done.reused_prompt_tokens == len(prompt) + len(replies[sid]) - 1, done
    assert logs == ["restored 2 session(s) from " + str(tmp_path)], logs
