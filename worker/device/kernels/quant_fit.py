"""`--quantize`'s fits, one Triton launch a weight: what `worker.layers.quant.quantize_int4` and
`quantize_int8` compute with torch ops, for a weight on the GPU.

The torch form makes every candidate of the search a dozen elementwise passes over the whole
weight in fp32 (int4: 21 candidates, ~360 passes; int8: 64 divisors, ~500), so a float
checkpoint quantized at load spent most of its time there: Gemma 4 31B's bf16 files, read from
memory, loaded at 1.15 GB/s on an H100 (53 s), against 11.7-12.9 GB/s for the same bytes kept
bf16 (BENCHMARKS.md, session 48). Here a program holds `BLOCK_M` whole groups in registers, reads
each weight once and writes its codes, scale and offset: the search costs arithmetic, not
memory passes, and no fp32 copy of the weight is made.

Each candidate is computed as the torch form computes it on the CPU, one rounding an operation:
divisions are correctly rounded (`div_rn`; a number over a tensor is the tensor's reciprocal
times the number, as torch takes it), nothing is contracted into an FMA
(`enable_fp_fusion=False`), codes round half to even, and scales and offsets are rounded to fp16
where the torch form rounds them. Only the sums over a group add in another order, so a group
whose two best candidates tie to the last bit may pick the other: the interpreter's tests find
the torch fit's bits exactly, unweighted, and with importance weights almost every group equal
and none with more error. (torch on CUDA divides by a scalar through its reciprocal, so its own
GPU fit differs from its CPU one in the same rare way; the GPU test allows for that.) This module
imports Triton: import it only after `worker.device.kernels.triton_available()`.

`worker.layers.quant._fit_in_one_launch` takes it for every weight on a GPU whose group is a
power of two from 16 to 256 (`TOKENPIPE_QUANT_FIT=torch`: the torch passes). The CPU tests run it
in Triton's interpreter; on an H100 (session 49) every group of the 31B's matrices came out with
the torch fit's scale, each matrix 32-39x faster (`tools/bench_quant_fit.py`), and the 31B's bf16
files loaded at 7.9 GB/s, not 1.2 (`tools/bench_card_fit.py --checkpoint DIR --quantize int4`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # groups a program (int4 g32: 2,048 weights; the tile halves in registers)


@triton.jit
def _rint(x):
    """Round half to even for |x| < 2**22 (an fp32 add rounds so); larger values stay as large
    and of their sign, which every caller clamps into the code range."""
    return (x + 12582912.0) - 12582912.0  # 1.5 * 2**23


@triton.jit
def _codes(x, scale, offset, LOW: tl.constexpr, HIGH: tl.constexpr):
    """round((x - offset) / scale) clamped to LOW..HIGH, a scale of 0 taken as 1; `scale` and
    `offset` [BLOCK_M] a group's, `x` [BLOCK_M, n] its weights."""
    safe = tl.where(scale == 0.0, 1.0, scale)[:, None]
    return tl.minimum(tl.maximum(_rint(tl.math.div_rn(x - offset[:, None], safe)), LOW), HIGH)


@triton.jit
def _int4_error(a, b, wa, wb, scale, offset, WEIGHTED: tl.constexpr):
    """Each group's (weighted) squared error of its codes under `scale` and `offset`; `a` and
    `b` are a group's even and odd weights [BLOCK_M, G / 2]."""
    s = scale[:, None]
    o = offset[:, None]
    ca = _codes(a, scale, offset, 0.0, 15.0)
    cb = _codes(b, scale, offset, 0.0, 15.0)
    ea = (ca * s + o) - a
    eb = (cb * s + o) - b
    ea = ea * ea
    eb = eb * eb
    if WEIGHTED:
        ea = ea * wa
        eb = eb * wb
    return tl.sum(ea, 1) + tl.sum(eb, 1)


@triton.jit
def _int4_fit_kernel(
    w_ptr, imp_ptr, packed_ptr, scale_ptr, offset_ptr, M, GROUPS_A_ROW,
    G: tl.constexpr, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    groups = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = groups < M
    half = tl.arange(0, G // 2)
    at = groups.to(tl.int64)[:, None] * G + 2 * half[None, :]
    a = tl.load(w_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)  # even k
    b = tl.load(w_ptr + at + 1, mask=live[:, None], other=0.0).to(tl.float32)  # odd k
    wa = a
    wb = b
    if WEIGHTED:  # [K] importance, each group's mean 1: the group's column range in its row
        cols = (groups % GROUPS_A_ROW).to(tl.int64)[:, None] * G + 2 * half[None, :]
        wa = tl.load(imp_ptr + cols, mask=live[:, None], other=1.0)
        wb = tl.load(imp_ptr + cols + 1, mask=live[:, None], other=1.0)
    low = tl.minimum(tl.min(a, 1), tl.min(b, 1))
    span = tl.maximum(tl.max(a, 1), tl.max(b, 1)) - low
    best_scale = tl.math.div_rn(span, tl.full(span.shape, 15.0, tl.float32))
    best_scale = best_scale.to(tl.float16).to(tl.float32)
    best_offset = low.to(tl.float16).to(tl.float32)
    if SEARCH:
        best_error = _int4_error(a, b, wa, wb, best_scale, best_offset, WEIGHTED)
        if WEIGHTED:
            size = tl.sum(wa, 1) + tl.sum(wb, 1)
            sum_w = tl.sum(a * wa, 1) + tl.sum(b * wb, 1)
        else:
            size = tl.full(span.shape, G, tl.float32)
            sum_w = tl.sum(a, 1) + tl.sum(b, 1)
        # torch takes `number / tensor` as the tensor's reciprocal times the number
        reciprocal = tl.math.div_rn(
            tl.full(span.shape, 1.0, tl.float32), tl.where(span > 0, span, 1.0)
        )
        for d in tl.static_range(21):  # INT4_STEP_DELTAS: (d - 10) / 10
            factor = (reciprocal * (15.0 + (d - 10) / 10))[:, None]
            ca = tl.minimum(tl.maximum(_rint((a - low[:, None]) * factor), 0.0), 15.0)
            cb = tl.minimum(tl.maximum(_rint((b - low[:, None]) * factor), 0.0), 15.0)
            cca = ca * ca
            ccb = cb * cb
            cwa = ca * a
            cwb = cb * b
            if WEIGHTED:
                ca = ca * wa
                cb = cb * wb
                cca = cca * wa
                ccb = ccb * wb
                cwa = cwa * wa
                cwb = cwb * wb
            sum_c = tl.sum(ca, 1) + tl.sum(cb, 1)
            sum_cc = tl.sum(cca, 1) + tl.sum(ccb, 1)
            sum_cw = tl.sum(cwa, 1) + tl.sum(cwb, 1)
            det = size * sum_cc - sum_c * sum_c
            ok = det > 0
            scale = tl.math.div_rn(size * sum_cw - sum_c * sum_w, tl.where(ok, det, 1.0))
            scale = tl.where(ok, scale, best_scale).to(tl.float16).to(tl.float32)
            offset = tl.math.div_rn(sum_w - scale * sum_c, size).to(tl.float16).to(tl.float32)
            error = _int4_error(a, b, wa, wb, scale, offset, WEIGHTED)
            better = error < best_error
            best_scale = tl.where(better, scale, best_scale)
            best_offset = tl.where(better, offset, best_offset)
            best_error = tl.where(better, error, best_error)
    qa = _codes(a, best_scale, best_offset, 0.0, 15.0).to(tl.uint8)
    qb = _codes(b, best_scale, best_offset, 0.0, 15.0).to(tl.uint8)
    out = groups.to(tl.int64)[:, None] * (G // 2) + half[None, :]
    tl.store(packed_ptr + out, qa | (qb << 4), mask=live[:, None])
    tl.store(scale_ptr + groups, best_scale.to(tl.float16), mask=live)
    tl.store(offset_ptr + groups, best_offset.to(tl.float16), mask=live)


@triton.jit
def _int8_fit_kernel(
    w_ptr, q_ptr, scale_ptr, M, LOW: tl.constexpr, LIMIT: tl.constexpr, G: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    groups = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = groups < M
    at = groups.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(w_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    zero = tl.zeros(amax.shape, tl.float32)  # symmetric: no offset (x - 0 is x exactly)
    best_scale = zero
    best_error = zero
    for divisor in range(LOW, LIMIT + 1):
        scale = tl.math.div_rn(amax, tl.zeros_like(amax) + divisor)
        scale = scale.to(tl.float16).to(tl.float32)
        codes = _codes(x, scale, zero, -LIMIT, LIMIT)
        e = codes * scale[:, None] - x
        error = tl.sum(e * e, 1)
        better = (error < best_error) | (divisor == LOW)  # the first candidate starts the search
        best_scale = tl.where(better, scale, best_scale)
        best_error = tl.where(better, error, best_error)
    codes = _codes(x, best_scale, zero, -LIMIT, LIMIT)
    tl.store(q_ptr + at, codes.to(tl.int8), mask=live[:, None])
    tl.store(scale_ptr + groups, best_scale.to(tl.float16), mask=live)


def fit_int4(
    weight: torch.Tensor, group: int, search: bool, importance: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_int4`'s fit of `weight` [N, K] (any float dtype) in groups of `group` along K:
    (packed codes uint8 [N, K / 2], scales fp16 [N, K / group], offsets fp16 [N, K / group]).
    `importance`: the fp32 per-weight factors [K] (each group's mean 1), or None."""
    n, k = weight.shape
    weight = weight.contiguous()
    m = n * k // group
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, k // group, dtype=torch.float16, device=weight.device)
    offsets = torch.empty_like(scales)
    if m == 0:
        return packed, scales, offsets
    weighted = importance is not None
    imp = importance.contiguous() if importance is not None else weight  # unread without it
    _int4_fit_kernel[(triton.cdiv(m, BLOCK_M),)](
        weight, imp, packed, scales, offsets, m, k // group, G=group, BLOCK=BLOCK_M,
        WEIGHTED=weighted, SEARCH=search, num_warps=4, **_unfused(weight),
    )  # fmt: skip
    return packed, scales, offsets


def fit_int8(
    weight: torch.Tensor, group: int, low: int, limit: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int8`'s fit (divisors `low`..`limit`; `low == limit`: round to nearest) of
    `weight` [N, K] in groups of `group`: (codes int8 [N, K], scales fp16 [N, K / group])."""
    n, k = weight.shape
    weight = weight.contiguous()
    m = n * k // group
    codes = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scales = torch.empty(n, k // group, dtype=torch.float16, device=weight.device)
    if m == 0:
        return codes, scales
    block = max(1, min(BLOCK_M, 2048 // group))
    _int8_fit_kernel[(triton.cdiv(m, block),)](
        weight, codes, scales, m, LOW=low, LIMIT=limit, G=group, BLOCK=block, num_warps=4,
        **_unfused(weight),
    )  # fmt: skip
    return codes, scales


def _unfused(weight: torch.Tensor) -> dict[str, bool]:
    """No FMA contraction on the GPU: each product rounded before its sum, as torch's passes
    round it (the interpreter takes no such option and contracts nothing)."""
    return {"enable_fp_fusion": False} if weight.is_cuda else {}
