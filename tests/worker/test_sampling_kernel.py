"""The sampling kernel's top-k paths (worker/device/kernels/sampling_kernel.py), compiled for
CUDA or run by Triton's interpreter: compaction into candidate slots and bisection find the
same k-th value (so draw the same tokens), with ties, -inf logits, k above the bucket count,
candidates that overflow the slots, and a vocabulary that is not a multiple of the block."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def kernels(triton_ready: None) -> ModuleType:
    importlib.import_module("worker.device.kernels.sampling_kernel")
    return importlib.import_module("worker.device.kernels.batched_sampling")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _draws(kernels: ModuleType, logits: torch.Tensor, rows: list, draws: int, **kw: int) -> list:
    """Each row's `draws` draws (draw numbers 0..draws-1) of the one logits row [V], as one
    batch: by the kernel with `kw`, or by the torch sampler when kw has torch=1."""
    batch = [r for r in rows for _ in range(draws)]
    counters = [i % draws for i in range(len(batch))]
    tensors = kernels.sampling_tensors(batch, counters, "cpu")
    big = logits[None].expand(len(batch), -1).contiguous()
    if kw.pop("torch", 0):
        return kernels.sample_rows_torch(big, *tensors).tolist()
    dev = _device()
    return kernels.sample_rows_triton(big.to(dev), *(t.to(dev) for t in tensors), **kw).tolist()


def test_compaction_bisection_and_torch_draw_the_same(kernels: ModuleType) -> None:
    """vocab 5,000: two blocks of 4,096, the second partly past the row. k within the bucket
    count goes by compaction (default slots), by bisection with slots=0, and by bisection
    after an overflow with 3 slots; k = 300 > 256 buckets always by bisection. All draw the
    torch sampler's tokens, top-p on top of top-k included."""
    RowSampling = kernels.RowSampling
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(8)) * 2.0
    rows = [RowSampling(0.9, k, p, seed=40 + k) for k, p in ((3, 1.0), (40, 1.0), (40, 0.8))]
    rows.append(RowSampling(1.1, 300, 1.0, seed=9))
    want = _draws(kernels, logits, rows, 4, torch=1)
    assert _draws(kernels, logits, rows, 4) == want
    assert _draws(kernels, logits, rows, 4, slots=0) == want
    assert _draws(kernels, logits, rows, 4, slots=3) == want  # 40 candidates > 3 slots
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert set(want[:4]) <= top3


def test_ties_at_the_kth_value_are_all_kept(kernels: ModuleType) -> None:
    """s >= the k-th value keeps every token tied with it (k = 2: the 9.0 and all four 8.0s),
    by compaction and by bisection alike."""
    RowSampling = kernels.RowSampling
    logits = torch.full((700,), -5.0)
    logits[[650, 3, 402, 41, 99]] = torch.tensor([8.5, 8.0, 8.0, 8.0, 8.0])
    rows = [RowSampling(1.0, 2, 1.0, seed=5)]
    compacted = _draws(kernels, logits, rows, 40)
    assert compacted[:12] == _draws(kernels, logits, rows, 12, slots=0)
    assert set(compacted) == {650, 3, 402, 41, 99}


def test_minus_infinity_logits(kernels: ModuleType) -> None:
    """A constrained row: -inf outside 30 allowed tokens. k = 50 > the allowed count keeps
    them all; k = 4 keeps the 4 largest; neither draws a disallowed token, by compaction or
    by bisection (which once bisected from -inf: NaN midpoints, no top-k at all)."""
    RowSampling = kernels.RowSampling
    gen = torch.Generator().manual_seed(3)
    logits = torch.full((1500,), float("-inf"))
    allowed = torch.randperm(1500, generator=gen)[:30]
    logits[allowed] = torch.randn(30, generator=gen)
    rows = [RowSampling(1.0, 50, 1.0, seed=2), RowSampling(1.0, 4, 1.0, seed=3)]
    for slots in (1024, 0):
        ids = _draws(kernels, logits, rows, 16, slots=slots)
        assert set(ids[:16]) <= set(allowed.tolist()) and len(set(ids[:16])) > 4
        assert set(ids[16:]) <= set(torch.topk(logits, 4).indices.tolist())


def test_seeded_row_draws_alike_whatever_shares_its_batch(kernels: ModuleType) -> None:
    """A seeded top-k row (compaction path) draws the same token alone and beside rows that
    take other paths (greedy, top-p, top-k by bisection)."""
    RowSampling = kernels.RowSampling
    dev = _device()
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(6)) * 1.5
    row = RowSampling(0.8, 40, 0.95, seed=1234)
    others = [RowSampling(), RowSampling(1.0, 0, 0.9, seed=7), RowSampling(1.0, 500, seed=8)]

    def draw(lg: torch.Tensor, rows: list, counters: list[int]) -> list[int]:
        tensors = kernels.sampling_tensors(rows, counters, dev)
        return kernels.sample_rows_triton(lg.to(dev), *tensors).tolist()

    for counter in (0, 5, 11):
        alone = draw(logits[1:2], [row], [counter])
        mixed = torch.stack([logits[0], logits[1], logits[2], logits[3]])
        together = draw(mixed, [others[0], row, others[1], others[2]], [1, counter, 2, 3])
        assert together[1] == alone[0]
        assert together[0] == int(logits[0].argmax())
