"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, without sorting the
vocabulary (`worker.device.kernels.batched_sampling`: a Triton kernel on CUDA, the same
algorithm in torch on the CPU).

`sample(logits, params, streams)` picks one token per row in one call over the batch (no
host sync); the engine reads all sampled ids with one `.tolist()` per step. A row's
randomness is counter-based: the draw number of its request's `NoiseStream` and its seed
give the uniform, so a seeded request samples the same ids whatever shares its batch, eager
or replayed from a CUDA graph.

`sample_step` is the engine's call: it applies the grammar bitmask of constrained rows
(`worker.engine.constraints`) on the device before sampling, computes the log-probabilities
a request asked for from the same logits, and copies ids and log-probabilities to the host
in one transfer.

Logits a model returns may carry `presampled(params, streams) -> Tensor | None` (set by
`worker.device.graphed_lm`): the ids its CUDA graph already drew for exactly these rows'
settings and draw numbers, which `sample` then takes instead of drawing again. Logits of a
step marked `grammar_masked` may carry `launch_ahead(ids)`: `sample_step` hands it the ids
sampled after the mask (on the device, before the host copy), and the step after is
launched fed with them (decode ahead for constrained rows).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
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
        if logits.device.type == "cpu":
            from worker.device.cpu_gemv import argmax

            ids = argmax(logits)
            if ids is not None:
                return ids
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


@dataclass(frozen=True)
class RowLogprobs:
    """A sampled token's log-probability and the row's most likely tokens (most likely
    first), from the temperature-scaled logits before filters and the grammar mask."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with -inf where `bitmask` [B, ceil(V / 32)] int32 (same device) has a 0
    bit (bit j of word w: token 32 w + j). Returns a new tensor; no host sync."""
    batch, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, words, 32]
    allowed = bits.reshape(batch, -1)[:, :vocab].bool()  # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))


def sample_step(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    streams: Sequence[NoiseStream | None],
    token_mask: Callable[[], torch.Tensor | None] | None = None,
    top_logprobs: Sequence[int] | None = None,
) -> tuple[list[int], list[RowLogprobs | None]]:
    """Sample one token per row of logits [B, V] and read the ids (and log-probabilities)
    to the host with one copy.

    token_mask: called once the forward is launched (on the CPU path: done), it returns the
    bitmask [B, words] int32 of the step's rows on the host (all ones for free rows), or
    None. top_logprobs: per row, -1 for no log-probabilities, else how many top tokens."""
    mask = token_mask() if token_mask is not None else None
    sampled_from = logits
    if mask is not None:
        # a new tensor, without the graph's `presampled` (decode ahead drew before the mask)
        sampled_from = apply_token_mask(logits, mask.to(logits.device, non_blocking=True))
    streams_ids = sample(sampled_from, params, streams)
    launch_ahead = getattr(logits, "launch_ahead", None)  # a masked step's next, fed these ids
    if launch_ahead is not None:
        launch_ahead(streams_ids)
    wants = [n for n in (top_logprobs or ()) if n >= 0]
    if not wants:
        return streams_ids.tolist(), [None] * len(params)  # the one host sync of the step
    top_n = max(wants)
    temperatures = torch.tensor(
        [p.temperature if p.temperature > 0 else 1.0 for p in params],
        dtype=torch.float32,
    ).to(logits.device, non_blocking=True)
    logprobs = torch.log_softmax(logits.float() / temperatures.unsqueeze(-1), dim=-1)  # [B, V]
    chosen = logprobs.gather(1, streams_ids.unsqueeze(-1))  # [B, 1]
    parts = [streams_ids.unsqueeze(-1).double(), chosen.double()]
    if top_n:
        values, ids = torch.topk(logprobs, top_n, dim=-1)  # [B, top_n], most likely first
        parts += [ids.double(), values.double()]
    packed = torch.cat(parts, dim=1).tolist()  # [B, 2 + 2 top_n]: the one host sync
    ids_out: list[int] = []
    rows: list[RowLogprobs | None] = []
    assert top_logprobs is not None
    for row, n in zip(packed, top_logprobs, strict=True):
        ids_out.append(int(row[0]))
        if n < 0:
            rows.append(None)
            continue
        top_ids = [int(i) for i in row[2 : 2 + n]]
        rows.append(RowLogprobs(row[1], top_ids, row[2 + top_n : 2 + top_n + n]))
    return ids_out, rows
