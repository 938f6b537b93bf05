"""Decode ahead on a hybrid cache (qwen3_5_moe: DeltaNet state next to the KV; worker/device/
graphed_lm.py, worker/layers/hybrid_cache.py): a step launched ahead advances its slots'
recurrent and conv states in place behind a backup; a miss puts the backup back, and every
reader of a slot's state settles the step first. On the CPU the graphed path runs eagerly (no
capture, no side stream): the engine with decode ahead must give, token for token, what it gives
without, across rows finishing and joining, stop strings, cancellation, warm resumes and
rollbacks after a miss, and prefix-cache states stored after a step ahead."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_engine_qwen3_5_moe import IdTokenizer, gen, ids, model  # noqa: F401

from protocol import CancelRequest, DoneEvent, Event, GenerateRequest, IdsSegment, TokenEvent
from worker.device.graphed_lm import GraphedCausalLM
from worker.engine.engine import Engine, EngineConfig
from worker.models.step import StepInput

torch.set_num_threads(1)


def _engine(model: Any, ahead: bool, **overrides: Any) -> Engine:  # noqa: F811
    from types import SimpleNamespace

    model.prepare_for_cpu = lambda: 0  # the engines share the model: no CPU repacking
    graphed = GraphedCausalLM(model, use_graphs=False, capture=False, decode_ahead=ahead)
    loaded = SimpleNamespace(
        model=graphed, tokenizer=IdTokenizer(), config=model.config, meta={"model": "tiny"}
    )
    settings = {"max_sessions": 4, "max_context": 256, "prefill_chunk": 16, **overrides}
    return Engine(loaded, EngineConfig(**settings), "cpu")


Schedule = dict[int, list[GenerateRequest | CancelRequest]]


def _drive(engine: Engine, schedule: Schedule) -> dict[str, list[Any]]:
    """Submit each step's requests before that step; run until idle. -> per request id: its
    streamed pieces and its done line's deterministic fields."""
    events: list[Event] = []
    step = 0
    while step <= max(schedule) or not engine.idle:
        for request in schedule.get(step, []):
            events.extend(engine.submit(request))
        events.extend(engine.step())
        step += 1
        assert step < 2_000
    out: dict[str, list[Any]] = {}
    for event in events:
        if isinstance(event, TokenEvent):
            out.setdefault(str(event.id), []).append(event.token)
        elif isinstance(event, DoneEvent):
            fields = (
                event.finish_reason, event.generated_token_ids, event.completion_tokens,
                event.reused_prompt_tokens, event.prefilled_prompt_tokens,
                event.session_reset_reason,
            )  # fmt: skip
            out.setdefault(str(event.id), []).append(fields)
        else:
            raise AssertionError(event)
    return out


def _req(rid: str, prompt: list[int], session: str | None, n: int, **kw: Any) -> GenerateRequest:
    return GenerateRequest(
        id=rid, prompt_segments=[IdsSegment(prompt)], add_prefix=False, max_new_tokens=n,
        session_id=session, return_token_ids=True, **kw,
    )  # fmt: skip


def _both(model: Any, schedules: list[Schedule], **overrides: Any) -> Engine:  # noqa: F811
    """Run the schedules on an engine without decode ahead and one with: the same outputs.
    Returns the one with."""
    plain, ahead = _engine(model, False, **overrides), _engine(model, True, **overrides)
    for schedule in schedules:
        assert _drive(ahead, schedule) == _drive(plain, schedule)
    return ahead


def test_batch_rows_finish_join_stop_and_cancel(model: Any) -> None:  # noqa: F811
    """Greedy and seeded sampling rows in one batch: one finishes early, one joins mid-way
    (its prefill riding along), one is cancelled, one ends on a stop string; then the named
    sessions resume warm (append-only) and roll back (regenerate), after those misses."""
    a, b, c, d = ids(20, 1), ids(13, 2), ids(25, 3), ids(9, 4)
    probe = _drive(_engine(model, False), {0: [_req("p", c, None, 24)]})
    text = "".join(probe["p"][:-1])
    stop = next(ch for ch in text[6:] if ch.isprintable() and ch != "\ufffd")
    first: Schedule = {
        0: [
            _req("a", a, "sa", 18),
            _req("b", b, "sb", 5, temperature=0.9, top_k=40, seed=7),
            _req("c", c, None, 24, stop=[stop]),
        ],
        6: [_req("d", d, "sd", 14, temperature=0.7, top_p=0.9, seed=3)],
        11: [CancelRequest(id="a")],
    }
    plain, ahead = _engine(model, False), _engine(model, True)
    got, want = _drive(ahead, first), _drive(plain, first)
    assert got == want
    assert got["c"][-1][0] == "stop" and got["a"][-1][0] == "cancelled"
    assert ahead.model.ahead_hits >= 5 and ahead.model.ahead_misses >= 3, (
        ahead.model.ahead_hits, ahead.model.ahead_misses,
    )  # fmt: skip
    hits = ahead.model.ahead_hits

    # warm resumes and a rollback of the sessions whose last steps ahead were dropped
    done_d = want["d"][-1]
    d2 = d + done_d[1] + ids(5, 5)
    second: Schedule = {
        0: [_req("d2", d2, "sd", 10, temperature=0.7, top_p=0.9, seed=4), _req("a2", a, "sa", 8)],
    }
    again: Schedule = {0: [_req("d3", d2, "sd", 10, temperature=0.7, top_p=0.9, seed=4)]}
    for schedule in (second, again):
        got, want = _drive(ahead, schedule), _drive(plain, schedule)
        assert got == want
    assert got["d3"][-1][5] == "mismatch" and got["d3"][-1][3] == len(d2) - 1
    assert ahead.model.ahead_hits > hits


def test_greedy_continuations_equal_fresh_prompts(model: Any) -> None:  # noqa: F811
    """A session's turns with decode ahead (append, regenerate, an edited turn) give what the
    same prompts give in fresh sessions without it."""
    plain, ahead = _engine(model, False), _engine(model, True)
    p1 = ids(30, 10)
    (turn1,) = _drive(ahead, {0: [_req("t1", p1, "s", 12)]})["t1"][-1:]
    p2 = p1 + turn1[1] + ids(6, 11)
    p3 = p1 + turn1[1] + ids(4, 12)
    for rid, prompt in (("t2", p2), ("t3", p2), ("t4", p3)):
        got = _drive(ahead, {0: [_req(rid, prompt, "s", 12)]})[rid][-1]
        want = _drive(plain, {0: [_req(rid, prompt, None, 12)]})[rid][-1]
        assert got[1] == want[1], rid
    assert ahead.model.ahead_hits >= 40


def test_prefix_cache_states_stored_after_steps_ahead(model: Any) -> None:  # noqa: F811
    """An anonymous request leaves its last step ahead in flight; the next request on the slot
    stores prefix-pool states there, which a third one reuses: the same tokens as without."""
    shared = ids(40, 20)
    schedules: list[Schedule] = [
        {0: [_req("x", ids(12, 21), None, 10)]},
        {0: [_req("y", shared + ids(7, 22), None, 10)]},
        {0: [_req("z", shared + ids(9, 23), None, 10), _req("w", ids(5, 24), "sw", 10)]},
        {0: [_req("v", shared[:33] + ids(6, 25), "sw", 10)]},
    ]
    ahead = _both(model, schedules, prefix_cache_bytes=8 << 20, prefix_block=8)
    assert ahead.prefix_cache is not None and ahead.prefix_cache.hits >= 2
    assert ahead.model.ahead_hits >= 20


def test_no_step_ahead_past_a_rows_last_token(model: Any) -> None:  # noqa: F811
    """The engine marks a step whose rows change after it (`same_rows_next`): a row's last
    token, a prefill row's last chunk. Nothing is launched ahead there, so a turn of 8 tokens
    uses all 6 steps ahead and drops none."""
    ahead = _engine(model, True)
    for turn in range(2):
        _drive(ahead, {0: [_req(f"t{turn}", ids(12, 40 + turn), "s" if turn else None, 8)]})
        assert (ahead.model.ahead_hits, ahead.model.ahead_misses) == (6 * (turn + 1), 0)


def test_big_batches_run_without_a_step_ahead(model: Any) -> None:  # noqa: F811
    """More rows than the backup holds (TOKENPIPE_HYBRID_AHEAD_ROWS=2 here): no step ahead
    while three rows decode, steps ahead again once one has finished."""
    schedule: Schedule = {0: [_req(r, ids(8, i), None, n) for i, (r, n) in enumerate(
        [("q", 6), ("r", 14), ("s", 14)]
    )]}  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENPIPE_HYBRID_AHEAD_ROWS", "2")
        plain, ahead = _engine(model, False), _engine(model, True)
    assert len(ahead.model._lanes[1].buckets) == 2
    assert _drive(ahead, schedule) == _drive(plain, schedule)
    assert 0 < ahead.model.ahead_hits <= 8


def test_sessions_through_the_tiers(model: Any, tmp_path: Any) -> None:  # noqa: F811
    """Sessions offloaded to host memory and disk between turns (each export settles the step
    ahead) continue as without decode ahead and as sessions that never left their slots."""
    from test_session_tiers_hybrid import conversation

    names = ["a", "b", "c", "d"]
    resident = conversation(_engine(model, False, max_sessions=5), names)
    runs = []
    for ahead in (False, True):
        engine = _engine(model, ahead, max_sessions=5, max_resident=2,
                         session_dir=str(tmp_path / str(ahead)))  # fmt: skip
        assert engine.tiers is not None and engine.tiers.host is not None
        engine.tiers.host.budget_bytes = engine.kv.export_slot(0, 0).nbytes + 1
        runs.append(conversation(engine, names))
        assert engine.stats()["tiers"]["reloads"] >= 8
    assert runs[0] == runs[1] == resident
    assert engine.model.ahead_hits >= 40


@pytest.mark.parametrize("marked", [True, False])
def test_grammar_masked_rows(model: Any, marked: bool) -> None:  # noqa: F811
    """Rows sampled under a grammar mask: a marked step launches its next once the masked ids
    are drawn (every guess used); an unmarked one guesses the unmasked ids and is dropped (the
    states put back). Tokens equal the plain model's either way."""
    from test_structured_sampling import _run

    torch.set_num_threads(1)  # that module's import asked for 2
    graphed = GraphedCausalLM(model, use_graphs=False, capture=False, decode_ahead=True)
    kv_plain, kv_ahead = model.make_kv_cache(4, 64), graphed.make_kv_cache(4, 64)
    allowed = [set(range(0, 256, 7)), set(range(100, 120)), None]  # row 2 is free
    want = _run(model, kv_plain, allowed)
    assert _run(graphed, kv_ahead, allowed, masked=marked) == want
    if marked:
        assert (graphed.ahead_hits, graphed.ahead_misses) == (len(want) - 1, 0)
    else:
        assert (graphed.ahead_hits, graphed.ahead_misses) == (0, 2)


def test_a_bad_row_count_is_refused(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("TOKENPIPE_HYBRID_AHEAD_ROWS", "four")
    with pytest.raises(ValueError, match="TOKENPIPE_HYBRID_AHEAD_ROWS"):
        _engine(model, True)
    monkeypatch.setenv("TOKENPIPE_HYBRID_AHEAD_ROWS", "0")  # none: one lane, no backup
    engine = _engine(model, True)
    assert len(engine.model._lanes) == 1 and engine.kv.ahead_rows == 0


def _decode(tokens: list[int], lens: list[int], slots: list[int]) -> StepInput:
    return StepInput(
        input_ids=torch.tensor(tokens), positions=torch.tensor(lens), slots=list(slots),
        cached_lens=list(lens), new_lens=[1] * len(slots),
    )  # fmt: skip


def test_a_bucket_with_more_rows_than_slots(model: Any) -> None:  # noqa: F811
    """5 slots: 5 decoders fill a bucket of 8 (3 padding rows, slot -1), which runs without a
    step ahead; once 2 leave, the 3 left run ahead in the bucket of 4. Logits equal the plain
    model's throughout; every slot's state equals the plain cache's at the end."""
    graphed = GraphedCausalLM(model, use_graphs=False, capture=False, decode_ahead=True)
    kv, plain = graphed.make_kv_cache(5, 128), model.make_kv_cache(5, 128)
    assert graphed.runner is not None and graphed.runner.buckets == (1, 2, 4, 8)
    prompts = {slot: ids(6 + slot, 50 + slot) for slot in range(5)}
    for slot, prompt in prompts.items():
        for cache in (kv, plain):
            graphed(StepInput.single(prompt, slot, 0), cache)
    slots = [4, 0, 2, 1, 3]
    lens = [len(prompts[s]) for s in slots]
    tokens = [prompts[s][-1] for s in slots]
    for step in range(8):
        if step == 4:
            slots, lens, tokens = slots[:3], lens[:3], tokens[:3]
        want = model(_decode(tokens, lens, slots), plain)
        got = graphed(_decode(tokens, lens, slots), kv).clone()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        tokens, lens = want.argmax(dim=-1).tolist(), [n + 1 for n in lens]
    assert (graphed.ahead_hits, graphed.ahead_misses) == (3, 0)
    kv.snapshot_at(slots[0], lens[0])  # settles the step ahead
    for got, want in ((kv.all_recurrent, plain.all_recurrent), (kv.all_conv, plain.all_conv)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _after_one_decode(model: Any, ahead: bool) -> tuple[GraphedCausalLM, Any]:  # noqa: F811
    """Slot 1: a 10-token prompt, then one decode step (with `ahead`: and the next launched)."""
    graphed = GraphedCausalLM(model, use_graphs=False, capture=False, decode_ahead=ahead)
    kv = graphed.make_kv_cache(3, 128)
    prompt = ids(10, 30)
    graphed(StepInput.single(prompt, 1, 0), kv)
    graphed(_decode([prompt[-1]], [10], [1]), kv)
    assert kv.live_len[1] == 11 and kv.ahead_slots == ((1,) if ahead else ())
    return graphed, kv


@pytest.mark.parametrize("reader", ["snapshot", "export", "truncate", "clear", "prefill"])
def test_readers_settle_the_step_ahead(model: Any, reader: str) -> None:  # noqa: F811
    """Between steps a step ahead has advanced its slots' states: a snapshot, an export, a
    rollback, a slot handed on or a prefill over it sees the state of the tokens fed."""
    _, plain = _after_one_decode(model, ahead=False)
    graphed, kv = _after_one_decode(model, ahead=True)
    want = plain.all_recurrent[:, 1].clone()
    assert not torch.equal(kv.all_recurrent[:, 1], want)  # the step ahead's
    if reader == "snapshot":
        kv.snapshot_at(1, 11)
        entry = kv.snapshot_lens[1].index(11)
        got = torch.stack([layer.snap_recurrent[1, entry] for layer in kv.deltanet_layers])
    elif reader == "export":
        state = kv.export_slot(1, 11)
        got = torch.stack([state.tensors[f"recurrent{i}"] for i in (0, 1, 2)])
    elif reader == "truncate":  # an append-only resume keeps the live state
        kv.truncate(1, 11)
        got = kv.all_recurrent[:, 1]
    elif reader == "clear":
        kv.clear_slot(1)
        got = kv.all_recurrent[:, 1]
    else:  # the next turn's prefill continues the live state
        tail = ids(3, 31)
        got_logits = graphed(StepInput.single(tail, 1, 11), kv)
        torch.testing.assert_close(got_logits, model(StepInput.single(tail, 1, 11), plain))
        got, want = kv.all_recurrent[:, 1], plain.all_recurrent[:, 1]
    assert kv.ahead_slots == () and graphed.ahead_misses == 1
    assert torch.equal(got, want)
