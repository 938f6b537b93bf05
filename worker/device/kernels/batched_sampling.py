"""Filtered sampling with per-row parameters as tensors, without sorting the vocabulary: no
Python loop over rows on the device, no host sync, no `torch.Generator`, so it runs inside a
captured CUDA graph.

The kept set of a row (temperature-scaled logits s, max m) is a threshold set:
- top-k (0 = off): s >= the k-th largest s (found among the few elements >= a bound that the
  first pass gives, or by bisection on the value: counts only; see `sampling_kernel`);
- min-p (0 = off): s >= m + log(min_p), i.e. p >= min_p * p_max;
- top-p (1 = off), on the distribution left by the first two: a token is kept when the mass
  of the tokens above it is < top_p (keeps >= 1 token).
Rows with temperature 0 (or top_k 1) take the argmax of the raw logits.

The draw is an inverse CDF in index order over the kept-by-threshold candidates: one uniform
u per (seed, counter, attempt) and a scan for the first token whose running mass reaches
u * Z. Top-p is exact by rejection: a drawn token whose mass above is >= top_p is outside the
nucleus, and so is every token at or below it, so the next attempt draws (a fresh uniform)
among the tokens strictly above it. Each attempt succeeds with probability >= top_p and
shrinks the candidates, so a few passes over the row suffice (FlashInfer's sorting-free
samplers reject in the same spirit).

Randomness is counter-based: with the counter = the row's draw number, a seeded request
draws the same tokens whatever shares its batch, eager or graph-replayed (one function per
device: the Triton kernel on CUDA, `sample_rows_torch` on the CPU; both the same algorithm).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
MAX_ATTEMPTS = 64  # top-p rejections before the argmax (always in the nucleus) is taken


def _mix32(x: int) -> int:
    """lowbias32 on a Python int in [0, 2**32)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def draw_uniform(seed: int, counter: int, attempt: int) -> float:
    """The uniform in (0, 1) of one draw; the Triton kernel computes the same bits."""
    h = _mix32(seed & _MASK32)
    h = _mix32(h ^ ((seed >> 32) & _MASK32))
    h = _mix32(h ^ (counter & _MASK32))
    h = _mix32(h ^ ((counter >> 32) & _MASK32))
    h = _mix32(h ^ attempt)
    return ((h >> 8) + 0.5) * (1.0 / (1 << 24))


# ------------------------------------------------------------------------- torch (the CPU)


def _sample_one(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
    seed: int, counter: int,
) -> int:  # fmt: skip
    """One row [V] float32 -> a token id (the algorithm of the module doc)."""
    if temperature <= 0.0 or top_k == 1:
        return int(torch.argmax(logits))
    vocab = logits.shape[0]
    scaled = logits * (1.0 / temperature)
    tokens: torch.Tensor | None = None  # the candidates' ids (None: the whole row)
    if 0 < top_k < vocab:
        # only the top k can be drawn: keep them in index order, as the full scan sees them
        values, ids = torch.topk(scaled, top_k, sorted=False)
        order = torch.argsort(ids)
        scaled, tokens = values[order], ids[order]
    top = float(scaled.max())
    floor = top + math.log(min_p) if min_p > 0.0 else -math.inf
    weights = torch.exp(scaled - top)  # [candidates]
    if floor > -math.inf:
        weights = weights.masked_fill(scaled < floor, 0.0)
    total = float(weights.sum())  # Z of the top-k / min-p set (the top-p reference)
    for attempt in range(MAX_ATTEMPTS):
        running = torch.cumsum(weights, 0)
        target = draw_uniform(seed, counter, attempt) * float(running[-1])
        pick = min(int(torch.searchsorted(running, torch.tensor([target]))[0]), len(running) - 1)
        if top_p < 1.0:
            above = weights.masked_fill(scaled <= scaled[pick], 0.0)
            if float(above.sum()) >= top_p * total:
                weights = above  # outside the nucleus, and so is all at or below it
                continue
        return pick if tokens is None else int(tokens[pick])
    return int(torch.argmax(logits))


def sample_rows_torch(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The torch form of `sample_rows` (host loop over rows: the CPU path)."""
    logits = logits.float()
    params = zip(
        temperature.tolist(), top_k.tolist(), top_p.tolist(), min_p.tolist(),
        seeds.tolist(), counters.tolist(), strict=True,
    )  # fmt: skip
    ids = [_sample_one(logits[row], *p) for row, p in enumerate(params)]
    return torch.tensor(ids, dtype=torch.int64, device=logits.device)


# ------------------------------------------------------------------------- Triton (CUDA)


CANDIDATE_SLOTS = 1024  # a row's top-k candidates kept in registers (more: bisection)
BUCKETS = 256  # the first pass's bucket maxima: top-k by compaction for k <= this


def sample_rows_triton(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
    slots: int = CANDIDATE_SLOTS, warps: int = 0,
) -> torch.Tensor:  # fmt: skip
    """`sample_rows` by the Triton kernel (one program per row). `slots`: how many top-k
    candidates a row may compact before it falls back to bisection (0: always bisection);
    `warps`: a program's warps (0: 16 for a full vocabulary, which measured fastest)."""
    from worker.device.kernels.sampling_kernel import sample_kernel

    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    temperature, top_k, top_p, min_p, seeds, counters = (
        t.contiguous() for t in (temperature, top_k, top_p, min_p, seeds, counters)
    )
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    block = 4096 if vocab >= 4096 else max(16, 1 << (vocab - 1).bit_length())
    warps = warps or (16 if block >= 4096 else 8 if block >= 2048 else 4)
    width = max(16, 1 << (max(slots, 1) - 1).bit_length())  # registers for the candidates
    # scratch of the compaction (inside a CUDA graph: from the graph's pool, fixed addresses)
    cand_val = torch.empty((batch, width), dtype=torch.float32, device=logits.device)
    cand_id = torch.empty((batch, width), dtype=torch.int32, device=logits.device)
    sample_kernel[(batch,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, counters, out,
        cand_val, cand_id, slots, vocab, BLOCK=block, BUCKETS=min(BUCKETS, block), SLOTS=width,
        MAX_TRIES=MAX_ATTEMPTS, num_warps=warps,
    )  # fmt: skip
    return out


def _use_triton(t: torch.Tensor) -> bool:
    from worker.device.kernels.attention import use_triton

    return use_triton(t) and os.environ.get("TOKENPIPE_TORCH_SAMPLING") != "1"


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
    Returns [B] int64 token ids on logits' device (the Triton kernel where Triton serves the
    tensor, else the torch loop)."""
    if _use_triton(logits):
        return sample_rows_triton(logits, temperature, top_k, top_p, min_p, seeds, counters)
    return sample_rows_torch(logits, temperature, top_k, top_p, min_p, seeds, counters)


@dataclass(frozen=True)
class RowSampling:
    """One row's settings as the tensors above take them (host values)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def sampling_tensors(
    rows: Sequence[RowSampling], counters: Sequence[int], device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p, seeds, counters) for `sample_rows`."""
    floats = torch.tensor([[r.temperature, r.top_p, r.min_p] for r in rows], dtype=torch.float32)
    ints = torch.tensor(
        [[r.top_k, r.seed & ((1 << 63) - 1), c] for r, c in zip(rows, counters, strict=True)],
        dtype=torch.int64,
    )
    # non_blocking: a blocking copy waits for the stream, i.e. for a decode step launched
    # ahead, and the step after it would start late (a masked step samples outside the graph)
    floats = floats.reshape(-1, 3).T.contiguous().to(device, non_blocking=True)  # [3, B]
    ints = ints.reshape(-1, 3).T.contiguous().to(device, non_blocking=True)  # [3, B]
    return floats[0], ints[0], floats[1], floats[2], ints[1], ints[2]
