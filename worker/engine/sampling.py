"""Sampling on the device: greedy, temperature, top-k, top-p, min-p (pure tensor code).

`sample(logits, params)` picks one token per row without a host sync; the engine reads
all sampled ids with one `.tolist()` per step. A row's randomness comes only from its own
`torch.Generator`, so a seeded request samples the same ids whatever shares its batch
(exponential race: argmax(p / E) with E ~ Exp(1) drawn from the row's generator is a draw
from the categorical distribution p).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


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


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A request's private generator: seeded when `seed` > 0, else from fresh entropy."""
    gen = torch.Generator(device=device)
    if seed > 0:
        gen.manual_seed(seed)
    else:
        gen.seed()
    return gen


def _filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scaled and masked logits of one row. logits: [V] float32."""
    scaled = logits / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if params.min_p > 0.0:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
        floor = scaled.max() + math.log(params.min_p)
        scaled = scaled.masked_fill(scaled < floor, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, -math.inf)
    return scaled


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row. logits: [B, V] float; returns [B] int64 on the same device.

    Greedy rows take the argmax; other rows draw with their own generator. No host sync.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    logits = logits.float()
    out = torch.argmax(logits, dim=-1)  # [B]
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        filtered = _filter_logits(logits[row], p)
        probs = torch.softmax(filtered, dim=-1)  # [V]
        noise = torch.empty_like(probs).exponential_(generator=gen)  # [V], Exp(1)
        out[row] = torch.argmax(probs / noise)
    return out
