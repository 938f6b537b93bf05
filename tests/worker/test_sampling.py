"""Tests of device sampling (worker/engine/sampling.py and the torch form of
worker/device/kernels/batched_sampling.py; the Triton kernel's are in test_kernels.py)."""

from __future__ import annotations

import math

import pytest
import torch

from worker.device.kernels.batched_sampling import RowSampling, sample_rows_torch, sampling_tensors
from worker.engine.sampling import SamplingParams, make_generator, sample

CPU = torch.device("cpu")

# (temperature, top_k, top_p, min_p): each filter alone and combined
FILTERS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.0, 5, 1.0, 0.0),
    (1.0, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.08),
    (0.8, 12, 0.9, 0.0),
    (1.3, 0, 0.8, 0.02),
    (0.9, 20, 0.7, 0.05),
]


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def filtered_softmax(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> torch.Tensor:  # fmt: skip
    """The distribution a row must be drawn from, computed the sorting way. logits: [V]."""
    scaled = logits.double() / temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if top_k > 0:
        keep &= scaled >= torch.topk(scaled, top_k).values[-1]
    if min_p > 0:
        keep &= scaled >= scaled.max() + math.log(min_p)
    probs = torch.softmax(scaled.masked_fill(~keep, -math.inf), 0)
    if top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        nucleus = torch.zeros_like(keep)
        nucleus[order[(torch.cumsum(sorted_p, 0) - sorted_p) < top_p]] = True
        probs = torch.softmax(scaled.masked_fill(~(keep & nucleus), -math.inf), 0)
    return probs


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (tokens with
    probability 0 must have no draws)."""
    assert counts[probs == 0].sum() == 0, "a filtered-out token was drawn"
    kept = probs > 0
    expected = probs[kept] / probs[kept].sum() * counts.sum()
    stat = ((counts[kept].double() - expected) ** 2 / expected).sum()
    dof = torch.tensor((int(kept.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def draw_counts(sampler, logits: torch.Tensor, setting: tuple, draws: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Counts of `draws` draws of one row (draw numbers 0..draws-1, all in one batch)."""
    row = RowSampling(*setting, seed=1234)
    tensors = sampling_tensors([row] * draws, list(range(draws)), logits.device)
    ids = sampler(logits[None].expand(draws, -1).contiguous(), *tensors)
    return torch.bincount(ids.cpu(), minlength=logits.shape[0])


@pytest.mark.parametrize("setting", FILTERS)
def test_draws_match_the_filtered_softmax(setting: tuple) -> None:
    logits = _logits(1, 40, seed=5)[0] * 1.5
    counts = draw_counts(sample_rows_torch, logits, setting, 20_000)
    assert chi_square_p(counts, filtered_softmax(logits, *setting)) > 0.001


@pytest.mark.parametrize("setting", FILTERS)
def test_kernel_draws_match_the_filtered_softmax_on_cuda(setting: tuple) -> None:
    """The same for the compiled Triton kernel (on the CPU, test_kernels.py checks that the
    kernel in Triton's interpreter draws the torch sampler's very tokens)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (20,000 draws are too slow for Triton's interpreter)")
    from worker.device.kernels.batched_sampling import sample_rows_triton

    logits = _logits(1, 40, seed=5)[0] * 1.5
    counts = draw_counts(sample_rows_triton, logits.cuda(), setting, 20_000)
    assert chi_square_p(counts, filtered_softmax(logits, *setting)) > 0.001


def test_greedy_is_argmax() -> None:
    logits = _logits()
    out = sample(logits, [SamplingParams()] * 3, [None] * 3)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_seed_reproducible_whatever_the_batch() -> None:
    logits = _logits(4)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)

    def draws(row_logits: torch.Tensor, others: int) -> list[int]:
        stream = make_generator(42, CPU)
        result = []
        for step in range(20):
            batch = row_logits[None]
            if others:
                batch = torch.cat([batch, _logits(others, seed=step)])
            params = [p] + [SamplingParams(temperature=1.0)] * others
            streams = [stream] + [make_generator(0, CPU) for _ in range(others)]
            result.append(sample(batch, params, streams)[0].item())
        return result

    alone = draws(logits[0], 0)
    assert alone == draws(logits[0], 3)
    assert len(set(alone)) > 1  # it does sample
    unseeded = [make_generator(0, CPU).seed for _ in range(3)]
    assert len(set(unseeded)) == 3


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


def test_full_vocabulary_row() -> None:
    """A 262,144-token row (the default model's vocabulary) with each filter: the token is
    kept by the filters."""
    logits = torch.randn(262_144, generator=torch.Generator().manual_seed(3)) * 2
    for setting in FILTERS:
        probs = filtered_softmax(logits, *setting)
        stream = make_generator(9, CPU)
        for _ in range(3):
            token = sample(logits[None], [SamplingParams(*setting)], [stream]).item()
            assert probs[token] > 0


def test_kernel_replayed_in_a_cuda_graph_draws_the_eager_tokens() -> None:
    """The Triton sampler captured in a CUDA graph (its candidate slots then come from the
    graph's pool) draws the eager tokens at every draw number: top-k by compaction, top-k
    with top-p, top-p alone, top-k above the bucket count (bisection). Full-size rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from worker.device.kernels.batched_sampling import sample_rows_triton

    logits = torch.randn(4, 262_144, generator=torch.Generator().manual_seed(2)).cuda() * 1.5
    rows = [
        RowSampling(0.8, 40, 1.0, 0.0, seed=1),
        RowSampling(0.8, 40, 0.95, 0.0, seed=2),
        RowSampling(1.0, 0, 0.9, 0.0, seed=3),
        RowSampling(0.7, 300, 1.0, 0.0, seed=4),
    ]
    static = [t.clone() for t in sampling_tensors(rows, [0] * 4, logits.device)]
    sample_rows_triton(logits, *static)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = sample_rows_triton(logits, *static)
    for draw in range(6):
        static[-1].fill_(draw)  # the counters
        graph.replay()
        eager = sample_rows_triton(logits, *sampling_tensors(rows, [draw] * 4, logits.device))
        assert replayed.tolist() == eager.tolist()
