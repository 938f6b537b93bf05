"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, without sorting the
vocabulary (`worker.device.kernels.batched_sampling`: a Triton kernel on CUDA, the same
algorithm in torch on the CPU).

`sample(logits, params, streams)` picks one token per row in one call over the batch (no
host sync); the engine reads all sampled ids with one `.tolist()` per step. A row's
randomness is counter-based: the draw number of its request's `NoiseStream` and its seed
give the uniform, so a seeded request samples the same ids whatever shares its batch, eager
or replayed from a CUDA graph.

Logits a model returns may carry `presampled(params, streams) -> Tensor | None` (set by
`worker.device.graphed_lm`): the ids its CUDA graph already drew for exactly these rows'
settings and draw numbers, which `sample` then takes instead of drawing again.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.device.kernels.batched_sampling import RowSampling, sample_rows, sampling_tensors


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (already validated)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int = 0  # 0 = unseeded

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass
class NoiseStream:
    """A request's randomness: its seed (the request's, or a fresh random one) and the number
    of tokens drawn so far (the counter of the next draw)."""

    seed: int
    draws: int = 0


def make_generator(seed: int, device: torch.device | str | None = None) -> NoiseStream:
    """A request's noise stream: seeded when `seed` > 0, else from fresh entropy."""
    return NoiseStream(seed if seed > 0 else secrets.randbits(62) + 1)


def row_settings(params: SamplingParams, stream: NoiseStream | None) -> RowSampling:
    """The kernel's settings of one row (greedy rows: temperature 0)."""
    if params.greedy or stream is None:
        return RowSampling()
    return RowSampling(params.temperature, params.top_k, params.top_p, params.min_p, stream.seed)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    streams: Sequence[NoiseStream | None],
) -> torch.Tensor:
    """Pick one token per row. logits: [B, V] float; returns [B] int64. No host sync.

    Greedy rows take the argmax; the others draw their stream's next number."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(streams)
    if all(p.greedy or s is None for p, s in zip(params, streams, strict=True)):
        return torch.argmax(logits, dim=-1)
    presampled = getattr(logits, "presampled", None)
    ids = presampled(params, streams) if presampled is not None else None
    if ids is None:
        rows = [row_settings(p, s) for p, s in zip(params, streams, strict=True)]
        counters = [s.draws if s is not None else 0 for s in streams]
        ids = sample_rows(logits, *sampling_tensors(rows, counters, logits.device))
    for p, s in zip(params, streams, strict=True):
        if s is not None and not p.greedy:
            s.draws += 1
    return ids
