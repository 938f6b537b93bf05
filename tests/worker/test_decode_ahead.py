"""Decode ahead (worker/device/decode_graphs.py): the step after a decode step is launched
before it is asked for, fed with each row's argmax. On the CPU the same logic runs eagerly:
logits must equal the plain model's whether the guess is used, dropped
(sampled tokens, a row leaving) or never made (the end of the context), and a dropped guess
must not corrupt the cache."""

from __future__ import annotations

import torch
from test_cuda_graphs import tiny_model

from worker.device.graphed_lm import GraphedCausalLM
from worker.models.step import StepInput

torch.set_num_threads(2)


def _pair(slots: int = 4, context: int = 64):  # type: ignore[no-untyped-def]
    model = tiny_model()
    ahead = GraphedCausalLM(model, use_graphs=False, decode_ahead=True)
    kv_plain, kv_ahead = model.make_kv_cache(slots, context), ahead.make_kv_cache(slots, context)
    return model, ahead, kv_plain, kv_ahead


def _step(tokens: list[int], lens: list[int], slots: list[int], device: str = "cpu") -> StepInput:
    return StepInput(
        input_ids=torch.tensor(tokens, device=device),
        positions=torch.tensor(lens, device=device),
        slots=list(slots),
        cached_lens=list(lens), new_lens=[1] * len(slots),
    )  # fmt: skip


def _prefill(model, kv, prompts: dict[int, list[int]]) -> None:  # type: ignore[no-untyped-def]
    for slot, ids in prompts.items():
        model(StepInput.single(ids, slot, 0), kv)


def test_greedy_rows_use_the_step_launched_ahead() -> None:
    model, ahead, kv_plain, kv_ahead = _pair()
    prompts = {0: [5, 6, 7, 8, 9], 2: list(range(30, 60))}  # slot 2 is past the ring (24)
    _prefill(model, kv_plain, prompts)
    _prefill(ahead, kv_ahead, prompts)
    slots, lens = [2, 0], [30, 5]
    tokens = [prompts[s][-1] for s in slots]
    for _ in range(10):
        want = model(_step(tokens, lens, slots), kv_plain)
        got = ahead(_step(tokens, lens, slots), kv_ahead).clone()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens, lens = want.argmax(dim=-1).tolist(), [n + 1 for n in lens]
    assert ahead.ahead_hits == 9 and ahead.ahead_misses == 0


def test_sampled_tokens_drop_the_guess_and_leave_the_cache_right() -> None:
    model, ahead, kv_plain, kv_ahead = _pair()
    _prefill(model, kv_plain, {1: [3, 1, 4, 1, 5]})
    _prefill(ahead, kv_ahead, {1: [3, 1, 4, 1, 5]})
    feed = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    for i, token in enumerate(feed):  # teacher-forced: not the argmax (a sampling row)
        want = model(_step([token], [5 + i], [1]), kv_plain)
        got = ahead(_step([token], [5 + i], [1]), kv_ahead)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # two wasted guesses (the rows' settings are unknown: no `sample` call), then no more
    assert ahead.ahead_hits == 0 and ahead.ahead_misses == 2


def _sampled_run(model, kv, sampled: bool, steps: int = 12):  # type: ignore[no-untyped-def]
    """3 rows decoding through `sample` (row 1 greedy, rows 0 and 2 seeded samplers): the
    tokens drawn per step."""
    from worker.engine.sampling import SamplingParams, make_generator, sample

    prompts = {0: [5, 6, 7, 8, 9], 2: list(range(30, 60)), 3: [1, 2, 3]}
    _prefill(model, kv, prompts)
    slots, lens = [2, 0, 3], [30, 5, 3]
    params = [
        SamplingParams(temperature=1.2, top_p=0.9, seed=11),
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=20, min_p=0.01, seed=12),
    ]
    if not sampled:
        params = [SamplingParams()] * 3
    streams = [None if p.greedy else make_generator(p.seed) for p in params]
    tokens = [prompts[s][-1] for s in slots]
    out = []
    for _ in range(steps):
        logits = model(_step(tokens, lens, slots), kv)
        tokens = sample(logits, params, streams).tolist()
        out.append(tokens)
        lens = [n + 1 for n in lens]
    return out


def test_sampled_rows_use_the_step_launched_ahead() -> None:
    """Seeded sampling rows draw the same tokens with decode ahead as the plain model with
    `sample`; after the first steps (settings learnt) every guess is used."""
    model, ahead, kv_plain, kv_ahead = _pair()
    want = _sampled_run(model, kv_plain, sampled=True)
    got = _sampled_run(ahead, kv_ahead, sampled=True)
    assert got == want
    assert len({tuple(t) for t in want}) > 1
    assert ahead.ahead_misses <= 1 and ahead.ahead_hits >= 10, (
        ahead.ahead_hits, ahead.ahead_misses,
    )  # fmt: skip


def test_a_row_leaving_drops_the_guess() -> None:
    model, ahead, kv_plain, kv_ahead = _pair()
    prompts = {0: [7, 7, 7], 1: [8, 9], 3: [1, 2, 3, 4]}
    _prefill(model, kv_plain, prompts)
    _prefill(ahead, kv_ahead, prompts)
    slots, lens = [0, 1, 3], [3, 2, 4]
    tokens = [prompts[s][-1] for s in slots]
    for step in range(8):
        if step == 4:  # slot 1 finished; slot 3 continues at a position the guess wrote
            slots, lens, tokens = [0, 3], [lens[0], lens[2]], [tokens[0], tokens[2]]
        want = model(_step(tokens, lens, slots), kv_plain)
        got = ahead(_step(tokens, lens, slots), kv_ahead).clone()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens, lens = want.argmax(dim=-1).tolist(), [n + 1 for n in lens]
    assert ahead.ahead_misses == 1 and ahead.ahead_hits == 6
    # a prefill-only step after a decode step drops the guess too
    ahead(StepInput.single([4, 5], 2, 0), kv_ahead)
    assert ahead.ahead_misses == 2


def test_no_guess_past_the_end_of_the_context() -> None:
    model, ahead, kv_plain, kv_ahead = _pair(slots=2, context=12)
    prompt = list(range(40, 50))
    _prefill(model, kv_plain, {0: prompt})
    _prefill(ahead, kv_ahead, {0: prompt})
    first = [layer.k[0, :, 0].clone() for layer in kv_ahead.layers]
    token = prompt[-1]
    for pos in (10, 11):  # the last position: nothing may be written at 12 (index 0)
        want = model(_step([token], [pos], [0]), kv_plain)
        got = ahead(_step([token], [pos], [0]), kv_ahead)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        token = int(want.argmax())
    for layer, k0 in zip(kv_ahead.layers, first, strict=True):
        assert torch.equal(layer.k[0, :, 0], k0)


def test_the_cache_keeps_fewer_tokens_of_a_ring_with_lookahead() -> None:
    _, ahead, kv_plain, kv_ahead = _pair()
    assert kv_ahead.lookahead == 1 and kv_plain.lookahead == 0
    # ring 24, window 8: keeping L of N = 40 needs L >= N - R + W - 1 (one more with lookahead)
    assert kv_plain.keepable_prefix(40, 23) == 23
    assert kv_ahead.keepable_prefix(40, 23) == 0
    assert kv_ahead.keepable_prefix(40, 24) == 24


def test_graphs_and_side_stream_give_the_same_tokens_on_cuda() -> None:
    """On CUDA (graphs, the side stream): 3 sessions decode the same greedy tokens with and
    without decode ahead, through a row leaving and a prefill joining."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_cuda_graphs import sharpened_tiny_model

    runs = []
    for decode_ahead in (False, True):
        model = GraphedCausalLM(
            sharpened_tiny_model("cuda", torch.bfloat16), decode_ahead=decode_ahead
        )
        kv = model.make_kv_cache(4, 128)
        prompts = {0: [5, 6, 7], 1: list(range(10, 40)), 2: [9, 9]}
        for slot, ids in prompts.items():
            model(StepInput.single(ids, slot, 0, device="cuda"), kv)
        slots, lens = [0, 1, 2], [3, 30, 2]
        tokens = [prompts[s][-1] for s in slots]
        out: list[list[int]] = []
        for step in range(30):
            if step == 10:  # slot 2 leaves
                slots, lens, tokens = slots[:2], lens[:2], tokens[:2]
            if step == 20:  # slot 3 joins with a prefill riding along
                model(StepInput.single([1, 2, 3, 4], 3, 0, device="cuda"), kv)
                slots, lens, tokens = [*slots, 3], [*lens, 4], [*tokens, 4]
            logits = model(_step(tokens, lens, slots, "cuda"), kv)
            tokens = logits.argmax(dim=-1).tolist()
            out.append(list(tokens))
            lens = [n + 1 for n in lens]
        runs.append(out)
        if decode_ahead:
            assert model.ahead_hits >= 25, (model.ahead_hits, model.ahead_misses)
    assert runs[0] == runs[1]
