"""The grammar mask and logprobs in `sample_step` (worker/engine/sampling.py), on a tiny
model: masked rows only take allowed tokens, free rows in the same batch are untouched, and
decode ahead (worker/device/graphed_lm.py, eager on the CPU) never hands a masked row the id
its graph drew before the mask: the tokens equal the plain model's."""

from __future__ import annotations

import torch
from test_cuda_graphs import tiny_model

from worker.device.graphed_lm import GraphedCausalLM
from worker.engine.sampling import SamplingParams, apply_token_mask, make_generator, sample_step
from worker.models.step import StepInput

torch.set_num_threads(2)


def _bitmask(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    words = (vocab + 31) // 32
    mask = torch.zeros(len(allowed), words, dtype=torch.int64)
    for row, ids in enumerate(allowed):
        for token in ids:
            mask[row, token // 32] |= 1 << (token % 32)
    return ((mask + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)  # as signed words


def test_apply_token_mask_keeps_exactly_the_allowed_ids() -> None:
    logits = torch.randn(2, 70)
    masked = apply_token_mask(logits, _bitmask([{0, 31, 32, 69}, set(range(70))], 70))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert torch.equal(masked[1], logits[1])


def _run(  # type: ignore[no-untyped-def]
    model, kv, allowed: list[set[int] | None], steps: int = 10, masked: bool = True
):
    vocab = 256
    prompts = {0: [5, 6, 7, 8, 9], 1: list(range(30, 40)), 2: [1, 2, 3]}
    for slot, ids in prompts.items():
        model(StepInput.single(ids, slot, 0), kv)
    slots, lens = [0, 1, 2], [5, 10, 3]
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=4), SamplingParams()]
    streams = [None if p.greedy else make_generator(p.seed) for p in params]
    full = set(range(vocab))
    mask = _bitmask([a if a is not None else full for a in allowed], vocab)
    tokens = [prompts[s][-1] for s in slots]
    out = []
    for _ in range(steps):
        step = StepInput(
            input_ids=torch.tensor(tokens), positions=torch.tensor(lens), slots=slots,
            cached_lens=list(lens), new_lens=[1, 1, 1], grammar_masked=masked,
        )  # fmt: skip
        logits = model(step, kv)
        tokens, _ = sample_step(logits, params, streams, lambda: mask)
        out.append(tokens)
        lens = [n + 1 for n in lens]
    return out


def test_masked_rows_with_decode_ahead_equal_the_plain_model() -> None:
    model = tiny_model()
    ahead = GraphedCausalLM(model, use_graphs=False, decode_ahead=True)
    kv_plain, kv_ahead = model.make_kv_cache(4, 64), ahead.make_kv_cache(4, 64)
    allowed = [set(range(0, 256, 7)), set(range(100, 120)), None]  # row 2 is free
    want = _run(model, kv_plain, allowed)
    got = _run(ahead, kv_ahead, allowed)
    assert got == want
    for tokens in want:
        assert tokens[0] in allowed[0] and tokens[1] in allowed[1]  # type: ignore[operator]
    # a masked step launches its next once the masked ids are drawn: every guess is used
    assert ahead.ahead_hits == len(want) - 1 and ahead.ahead_misses == 0


def test_masked_rows_unmarked_waste_the_step_launched_ahead() -> None:
    """Without `grammar_masked` the step after is launched with the unmasked ids: it is
    dropped (the tokens still equal the plain model's)."""
    model = tiny_model()
    ahead = GraphedCausalLM(model, use_graphs=False, decode_ahead=True)
    kv_plain, kv_ahead = model.make_kv_cache(4, 64), ahead.make_kv_cache(4, 64)
    allowed = [set(range(0, 256, 7)), set(range(100, 120)), None]
    assert _run(ahead, kv_ahead, allowed, masked=False) == _run(model, kv_plain, allowed)
    assert ahead.ahead_hits == 0 and ahead.ahead_misses == 2


def test_logprobs_are_the_log_softmax_of_the_scaled_logits() -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(temperature=0.5, seed=3), SamplingParams()]
    streams = [None, make_generator(3), None]
    ids, rows = sample_step(logits, params, streams, None, [2, 0, -1])
    assert rows[2] is None and rows[0] is not None and rows[1] is not None
    for row, temperature in ((0, 1.0), (1, 0.5)):
        reference = torch.log_softmax(logits[row] / temperature, dim=-1)
        entry = rows[row]
        assert entry is not None
        assert abs(entry.logprob - float(reference[ids[row]])) < 1e-6
    assert rows[0].top_ids == torch.topk(logits[0], 2).indices.tolist()  # type: ignore[union-attr]
    assert rows[1].top_ids == [] and rows[1].top_logprobs == []  # type: ignore[union-attr]
