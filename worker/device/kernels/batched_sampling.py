"""Sampling with per-row parameters as tensors: no Python loop over rows, no host sync, no
`torch.Generator`, so it can run inside a captured CUDA graph.

Randomness is counter-based: the Exp(1) noise of token t in a row is a hash of
(row seed, row counter, t). With the counter = the position being sampled, a seeded request
draws the same tokens whatever shares its batch, eager or graph-replayed, on any device.
The draw is the exponential race argmax(p / E) == argmax(logit - log E), E ~ Exp(1).

Filters apply in this order on temperature-scaled logits: top-k (0 = off), min-p (0 = off,
relative to the top probability), top-p (1 = off, on the distribution left by the first two;
keeps >= 1 token). Rows with temperature 0 (or top_k 1) take the argmax of the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] int64 seeds and counters -> [B, vocab] float32 uniforms in (0, 1)."""
    row = _hash32(_hash32(seeds & _MASK32) ^ _hash32((seeds >> 32) & _MASK32) + 0x9E3779B9)
    row = _hash32(row ^ _hash32(counters & _MASK32))  # [B]
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)  # [V]
    bits = _hash32(row[:, None] ^ _hash32(tokens + 0x632BE5AB)[None, :])  # [B, V]
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V]; temperature, top_p, min_p [B] float32; top_k, seeds, counters [B] int64.
    Returns [B] int64 token ids on logits' device."""
    logits = logits.float()
    batch, vocab = logits.shape
    greedy_ids = torch.argmax(logits, dim=-1)  # [B]
    sampling = (temperature > 0) & (top_k != 1)  # [B]
    scaled = logits / torch.where(sampling, temperature, 1.0)[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    keep = (top_k[:, None] <= 0) | (ranks < top_k[:, None])
    # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)   (log 0 = -inf keeps all)
    keep &= sorted_logits >= sorted_logits[:, :1] + torch.log(min_p)[:, None]
    masked = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (ranks == 0)
    masked = sorted_logits.masked_fill(~keep, float("-inf"))
    noise = uniform_noise(seeds, counters, vocab).gather(1, order)  # [B, V] by rank
    race = masked - torch.log(-torch.log(noise))  # logit - log(E), E = -log(U)
    picked = order.gather(1, torch.argmax(race, dim=-1, keepdim=True))[:, 0]
    return torch.where(sampling, picked, greedy_ids)


@dataclass(frozen=True)
class RowSampling:
    """One row's settings as the tensors above take them (host values)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


def sampling_tensors(
    rows: Sequence[RowSampling], counters: Sequence[int], device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p, seeds, counters) for `sample_rows`."""
    floats = torch.tensor(
        [[r.temperature, r.top_p, r.min_p] for r in rows], dtype=torch.float32
    ).reshape(-1, 3)
    ints = torch.tensor([[r.top_k, r.seed, c] for r, c in zip(rows, counters, strict=True)])
    floats, ints = floats.reshape(-1, 3).to(device), ints.reshape(-1, 3).to(device)
    return floats[:, 0], ints[:, 0], floats[:, 1], floats[:, 2], ints[:, 1], ints[:, 2]
