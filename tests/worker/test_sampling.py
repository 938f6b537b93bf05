"""Tests of device sampling (worker/engine/sampling.py)."""

from __future__ import annotations

import torch

from worker.engine.sampling import SamplingParams, make_generator, sample

CPU = torch.device("cpu")


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax() -> None:
    logits = _logits()
    out = sample(logits, [SamplingParams()] * 3, [None] * 3)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_seed_reproducible_whatever_the_batch() -> None:
    logits = _logits(4)
    p = SamplingParams(temperature=1.0, seed=42)

    def draws(row_logits: torch.Tensor, others: int) -> list[int]:
        gen = make_generator(42, CPU)
        result = []
        for step in range(20):
            batch = row_logits[None]
            if others:
                batch = torch.cat([batch, _logits(others, seed=step)])
            params = [p] + [SamplingParams(temperature=1.0)] * others
            gens = [gen] + [make_generator(0, CPU) for _ in range(others)]
            result.append(sample(batch, params, gens)[0].item())
        return result

    alone = draws(logits[0], 0)
    assert alone == draws(logits[0], 3)
    assert len(set(alone)) > 1  # it does sample


def test_top_k_one_and_min_p_restrict() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    for _ in range(20):
        gen = make_generator(0, CPU)
        assert sample(logits, [SamplingParams(temperature=1.0, top_k=1)], [gen]).item() == 1
        ids = sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [gen]).item()
        assert ids in (1, 2)
        ids = sample(logits, [SamplingParams(temperature=1.0, min_p=0.5)], [gen]).item()
        assert ids in (1, 2)


def test_top_p_keeps_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    gen = make_generator(7, CPU)
    seen = {
        sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)], [gen]).item()
        for _ in range(200)
    }
    assert seen == {0, 1}


def test_distribution_matches_softmax() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None]
    gen = make_generator(3, CPU)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sample(logits, [SamplingParams(temperature=1.0)], [gen]).item()] += 1
    freqs = [c / 3000 for c in counts]
    assert all(abs(f - p) < 0.04 for f, p in zip(freqs, probs.tolist(), strict=True))
