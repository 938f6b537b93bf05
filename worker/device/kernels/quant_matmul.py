"""Triton matmuls over weight-only quantized weights (W4A16 / W8A16) on CUDA.

    packed = KMajorWeight.pack(qw)     # once, at start-up (worker/device/cuda_setup.py)
    y = quant_linear(x, packed)        # x [M, K] bf16/fp16/fp32 -> [M, N]

The canonical layout of ``worker.layers.quant`` (row-major codes) is repacked for the GPU
into a **K-major, output-interleaved** one: codes in int32 words [K, N / P], word (k, c)
holding the codes of outputs P*c .. P*c + P - 1 at input k (int4: P = 8 nibbles, output
P*c + i at bits 4i..4i+3; int8: P = 4 bytes), and the fp16 (int4 in a bf16 model: bf16)
scales (and int4 offsets) as [K / g, P, N / P] (position-major: the scales of one code
position are contiguous). N is padded to a multiple of P with zero codes (outputs never
stored). Stored **blocked** by default (``KMajorWeight.block``, BLOCK_WORDS): the C = N / P word
columns in blocks of 32, words [C / 32, K, 32] and scales [C / 32, K / g, P, 32], so the K rows
of a column block are contiguous and a warp's rows come in one read (`_layout` gives every
kernel its addresses in either order; the bits are the same).

A word shares its input k, so one x value feeds all P codes of a loaded word, and a code
becomes an fp32 operand in **one instruction**: ``word & mask`` read as an fp32 is the code
times a power of two (a denormal, code * 2^(a - 149) for the code at bits a..; codes above
bit 23 come from ``word >> 8``). The multiply-add against x (scaled by 2^90, exact) is exact
and denormals are kept by fp32 FMA (Triton emits no flush-to-zero), so a weight costs an AND
and an FMA; each group's scale (times the power of two back) and offset apply once per
group to the sums ``sum code * x`` and ``sum x`` (``w = code * scale + offset``; int8 codes
are stored offset by 128 and the 128 * scale * sum x taken back). The previous layout (words
along K) needed a shift, a mask, an OR and a subtract per weight and a scalar x load per
code: ~8.4 instructions per weight against ~3 now (SASS counts in BENCHMARKS.md).

Three paths, by the number of rows M:

- **GEMV, M == 1** (batch-1 decode): CUDA cores, fp32 accumulation, software-pipelined (the
  next rows' words are in flight while the current ones are summed), K split over programs
  for matrices of few outputs (partial sums added in a fixed order by the last program of a
  column block to finish: deterministic, and no second kernel).
- **GEMM, 1 < M <= GEMM_MAX_ROWS** (decode batches; rows in tiles of at most GEMM_BLOCK_M,
  side by side in the grid): per code position p, the
  [K tile, N / P tile] weights dequantized in registers (an AND and an FMA with the scale,
  then x's dtype) and multiplied on the tensor cores (``tl.dot``) into the outputs P*c + p;
  the P accumulators are interleaved into consecutive outputs for one coalesced store.
- **Longer inputs** (prefill chunks): the weight dequantized into a [K, N] scratch of x's
  dtype by one kernel, then cuBLAS; the dequantization costs ~2.5 bytes per weight per
  chunk, small against a chunk's matmul.

Every weight is ``code * scale (+ offset)`` in fp32 as in the reference
(``worker.layers.quant.dequantize``). This module imports Triton: import it only after
``worker.device.kernels.triton_available()``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker.device.kernels.rmsnorm import GATED_ACTIVATIONS, gated_activation
from worker.layers.quant import INT4, QuantizedWeight, unpack_nibbles

GEMV_MAX_ROWS = 1
GEMM_MAX_ROWS = 64
# GEMV: (BLOCK_C words, programs wanted (K split to reach them), num_warps, rows a step: 4 or 8
# in registers, or -S: the cp.async pipeline of S stages, `_qgemv_staged_kernel`[, group slots:
# the tile's group rows, num_warps when left out; more slots than warps put a warp's lanes on
# several groups, so a lane holds 4 words of a row (one 128-bit load) even at BLOCK_C 32:
# 2.79 SASS instructions a weight against 4.24 for (32, 264, 8, 8), BENCHMARKS.md "offline
# SASS"; SLOT_CANDIDATES, timed at start-up[, L2 prefetch: steps ahead, 0 none]]);
# GEMM: (BLOCK_C words, BLOCK_K (a multiple of the group), num_warps, num_stages[, joined
# store: 1 (``_gemm_store_joined``)[, programs: the K split's target, GEMM_PROGRAMS if left
# out or 0[, L2 prefetch: K tiles ahead]]]); TOKENPIPE_QUANT_GEMM_JOINED=0: the per-position
# store and its tiles of session 7
GEMM_JOINED = os.environ.get("TOKENPIPE_QUANT_GEMM_JOINED", "1") != "0"
GEMV_CONFIG = (32, 264, 8, 8)
GEMM_CONFIG: tuple[int, ...] = (32, 32, 2, 3, 1, 528) if GEMM_JOINED else (64, 32, 4, 3)
# rows a GEMM program takes at most: 33-64 rows run as two row tiles (the tiles' 8
# accumulators of 64 rows spill; BENCHMARKS "Gemma 4 31B int4 on one H200, session 13")
GEMM_BLOCK_M = int(os.environ.get("TOKENPIPE_QUANT_GEMM_BLOCK_M", "32"))
# about one per SM of an H200: tiles without a 6th field split K up to this many programs
# (gate_up's 84 tiles of 64 word columns get no split at 32 rows); the joined tiles, at 216
# registers, run two 4-warp programs an SM: 264 (BENCHMARKS "The int4 decode GEMM's store")
GEMM_PROGRAMS = int(os.environ.get("TOKENPIPE_QUANT_GEMM_PROGRAMS", "132"))
# where the row tiles (33-64 rows: two) alone would fill the K split's program target unsplit,
# the target counts per row tile: a 64-row gate_up ran 336 programs unsplit at 0.82 TB/s
# (176 us), split 3 ways 134 us; 48-64 sessions +8-10% through the worker (BENCHMARKS "Gemma
# 4 31B int4 on one H200, session 14"). TOKENPIPE_QUANT_GEMM_ROW_TILE_PROGRAMS=0: the old split
GEMM_PROGRAMS_PER_ROW_TILE = os.environ.get("TOKENPIPE_QUANT_GEMM_ROW_TILE_PROGRAMS", "1") != "0"


# the K-split GEMM's partial sums, for bf16 x, stored in bf16: half the bytes written and read
# again by `_reduce_kernel` (32 rows of o / down: 25 splits, 17 MB of fp32 partials a call),
# 32 sessions +4.2% through the worker (BENCHMARKS "session 19"); the sum stays fp32. On the
# H200, o at 32 rows split 8 or 25 ways: rms error against the float64 product 0.166% ->
# 0.235% of the output (the output's own bf16 rounding is the 0.166%), max 0.23% -> 0.33%.
# TOKENPIPE_QUANT_PARTIALS=fp32: fp32 partials
def _partials_bf16() -> bool:
    return os.environ.get("TOKENPIPE_QUANT_PARTIALS", "bf16") != "fp32"


PARTIALS_BF16 = _partials_bf16()
# outputs a `_reduce_kernel` program sums (two warps): 16-byte loads of fp32 partials, 8-byte
# loads of bf16 ones; 512 (16-byte bf16 loads) was 0.3% slower at 32 sessions (session 20)
REDUCE_BLOCK = 256
# a gate_up matrix on the GEMM (2-64 rows): its split sum and the gated activation in one
# kernel (`qgemm_gated`; the same bits, one launch a layer fewer). 31B int4 at 32 sessions,
# one tile cache, alternating arms (session 22): 2,767 / 2,770 -> 2,832 / 2,827 tok/s (+2.2%)
# on one H200, 2,638 / 2,645 -> 2,678 / 2,679 (+1.4%) on another. Folding o's, down's or
# qkv's split sum into the kernel that reads them next (the add + norm, the qkv store) was
# neutral (-0.3% to +0.8%): the launch saved went to the reader loading every split (the
# norm kernel with one program a row).
# TOKENPIPE_QUANT_GATED_SUM=0: the split sum, then the activation
GATED_SUM = os.environ.get("TOKENPIPE_QUANT_GATED_SUM", "1") != "0"
PACK_ROWS = 4096  # outputs repacked at a time: bounds the int32 temporaries
# word columns a block of the blocked layout (``KMajorWeight.block``): a column block's K rows of
# 32 words (128 bytes) lie one after another, so a warp's run of rows in the GEMV is one
# contiguous read; the GEMV 15-21% faster on every 31B matrix at one row, the GEMM 2-4% at 32
# rows (BENCHMARKS "Gemma 4 31B int4 on one H200, session 16"). TOKENPIPE_QUANT_BLOCKED=0: the
# plain [K, C] layout
BLOCK_WORDS = 32 if os.environ.get("TOKENPIPE_QUANT_BLOCKED", "1") != "0" else 0


@dataclass
class KMajorWeight:
    """A quantized [N, K] weight in the GPU's layout (module docstring)."""

    kind: str
    shape: tuple[int, int]
    group_size: int
    # int32 [K, C = N / P] (N padded to a multiple of P); blocked (``block`` B): [C / B, K, B]
    words: torch.Tensor
    # fp16 (or bf16: ``meta_dtype_for``) [K / g, P, C]; blocked: [C / B, K / g, P, B]
    scales: torch.Tensor
    offsets: torch.Tensor | None  # the same, int4 only
    # tile configs timed for this matrix on this GPU (choose_configs); None: the defaults
    gemv_config: tuple[int, ...] | None = None
    gemm_config: tuple[int, ...] | None = None
    # the K-split GEMV's arrival counters, one per column block (zero between calls)
    arrivals: torch.Tensor | None = None
    # B > 0: the blocked layout, word columns in blocks of B (the last padded with zero words,
    # which no kernel reads: a word's address depends on B and K only); 0: plain rows of C words
    block: int = 0
    width: int = 0  # blocked: C, the word columns before the padding

    def counters(self, blocks: int) -> torch.Tensor:
        """At least ``blocks`` zeroed counters of this weight's own (made by ``pack``, before
        any CUDA graph capture; a weight is used on one stream at a time)."""
        if self.arrivals is None or self.arrivals.numel() < blocks:
            self.arrivals = torch.zeros(max(blocks, triton.cdiv(self.columns, 8)),
                                        dtype=torch.int32, device=self.words.device)  # fmt: skip
        return self.arrivals

    @property
    def per_word(self) -> int:
        return 8 if self.kind == INT4 else 4

    @property
    def columns(self) -> int:
        """Word columns C = N / P (N padded up to whole words)."""
        return self.width if self.block else self.words.shape[1]

    @property
    def nbytes(self) -> int:
        parts = [self.words, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    @staticmethod
    def supports(qw: QuantizedWeight) -> bool:
        """Groups of a power of two from 8 up."""
        group = qw.group_size
        return group >= 8 and group & (group - 1) == 0

    @staticmethod
    def pack(
        qw: QuantizedWeight,
        meta_dtype: torch.dtype = torch.float16,
        block: int | None = None,
        device: torch.device | str | None = None,
    ) -> KMajorWeight:
        """``meta_dtype``: the scales' and offsets' (fp16 as in ``qw``; bf16 for int4 weights
        of a bf16 model, ``meta_dtype_for``); ``block``: word columns a block of the blocked
        layout, 0 for plain rows (None: BLOCK_WORDS); ``device``: where the packed weight goes
        (None: ``qw``'s; from host memory a chunk of rows is copied over at a time)."""
        n, k = qw.shape
        if not KMajorWeight.supports(qw):
            group = qw.group_size
            raise ValueError(f"K-major packing needs a power-of-two group >= 8, got {group}")
        per_word = 8 if qw.kind == INT4 else 4
        bits = 32 // per_word
        block = BLOCK_WORDS if block is None else block
        if block < 0 or block and (PACK_ROWS // 8) % block:
            raise ValueError(f"K-major packing: blocks of {block} words do not divide a chunk")
        width = triton.cdiv(n, per_word)
        columns = triton.cdiv(width, block) * block if block else width  # stored
        device = qw.qdata.device if device is None else torch.device(device)
        # blocked: [C / B, K, B], filled a chunk of whole blocks at a time (chunks start at
        # multiples of PACK_ROWS / P word columns), so no [K, C] copy is made
        shape = (columns // block, k, block) if block else (k, columns)
        words = torch.zeros(shape, dtype=torch.int32, device=device)
        for start in range(0, n, PACK_ROWS):
            stop = min(start + PACK_ROWS, n)
            rows = qw.qdata[start:stop].to(device)
            if qw.kind == INT4:
                codes = unpack_nibbles(rows).to(torch.int32)
            else:  # signed bytes stored offset by 128 (the kernels take 128 * scale back)
                codes = (rows.to(torch.int32) + 128) & 0xFF
            first, last = start // per_word, triton.cdiv(stop, per_word)
            span = triton.cdiv(last - first, block) * block if block else last - first
            chunk = torch.zeros((span * per_word, k), dtype=torch.int32, device=device)
            chunk[: stop - start] = codes
            chunk = chunk.view(span, per_word, k)
            word = torch.zeros((span, k), dtype=torch.int32, device=device)
            for position in range(per_word):
                word |= chunk[:, position] << (bits * position)
            if block:
                at = first // block
                words[at : at + span // block] = word.view(-1, block, k).transpose(1, 2)
            else:
                words[:, first:last] = word.t()

        def by_position(meta: torch.Tensor) -> torch.Tensor:  # [N, K / g] -> [K / g, P, C]
            meta = meta.to(device)
            padded = meta.new_zeros((columns * per_word, meta.shape[1]), dtype=meta_dtype)
            padded[:n] = meta
            meta = padded.t().reshape(-1, columns, per_word).transpose(1, 2)
            if not block:
                return meta.contiguous()
            groups = meta.shape[0]  # -> [C / B, K / g, P, B]
            return meta.reshape(groups, per_word, -1, block).permute(2, 0, 1, 3).contiguous()

        scales = by_position(qw.scales)
        offsets = None if qw.offsets is None else by_position(qw.offsets)
        packed = KMajorWeight(qw.kind, qw.shape, qw.group_size, words, scales, offsets,
                              block=block, width=width)  # fmt: skip
        packed.counters(1)  # now, not inside a graph capture
        return packed

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] of the dequantized weight -> [T, K] (an embedding lookup from a
        table shared with the LM head; plain torch ops over the T outputs)."""
        per_word = self.per_word
        bits = 32 // per_word
        column, position = ids // per_word, ids % per_word
        if self.block:
            blocks, lanes = column // self.block, column % self.block
            words = self.words[blocks, :, lanes]  # [T, K]

            def meta(t: torch.Tensor) -> torch.Tensor:  # [T, K / g]
                return t[blocks, :, position, lanes].float()
        else:
            words = self.words[:, column].t()

            def meta(t: torch.Tensor) -> torch.Tensor:
                return t[:, position, column].t().float()

        codes = (words >> (bits * position).to(torch.int32)[:, None]) & ((1 << bits) - 1)
        if self.kind != INT4:
            codes = codes - 128
        group = self.group_size
        out = codes.float() * meta(self.scales).repeat_interleave(group, dim=1)
        if self.offsets is not None:
            out = out + meta(self.offsets).repeat_interleave(group, dim=1)
        return out.to(dtype)


@triton.jit
def _extract(word, position, INT4_KIND: tl.constexpr):
    """Code ``position`` of words packed along K (the experts' layout of
    ``worker.layers.quant_experts``), as fp32. Without an integer-to-float conversion (a
    quarter-rate instruction on Hopper): the code goes into the mantissa of 2^23 and 2^23
    (+ 128, for int8's sign flip) is subtracted, exact."""
    if INT4_KIND:
        bits = ((word >> (4 * position)) & 15) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    bits = (((word >> (8 * position)) & 255) ^ 128) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _code(low, high, p: tl.constexpr, INT4_KIND: tl.constexpr):
    """Code p of each word as the fp32 code * 2^(a_p - 149), exactly (a denormal; a_p in
    `_unscale`). ``high`` is ``low >> 8``: the codes above bit 23 move down to bits 16..23."""
    if INT4_KIND:
        if p < 6:
            bits = low & (15 << (4 * p))
        else:
            bits = high & (15 << (4 * p - 8))
    else:
        if p < 3:
            bits = low & (255 << (8 * p))
        else:
            bits = high & (255 << 16)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _unscale(p: tl.constexpr, INT4_KIND: tl.constexpr):
    """2^(59 - a_p): a `_code` (code * 2^(a_p - 149)) times an x scaled by 2^90, times this,
    is code * x (a_p: the code's lowest bit, 4p / 8p, or 16 / 20 for the codes taken from
    ``high``)."""
    if INT4_KIND:
        if p == 0:
            u = 5.764607523034235e17  # 2^59
        elif p == 1:
            u = 3.602879701896397e16  # 2^55
        elif p == 2:
            u = 2251799813685248.0  # 2^51
        elif p == 3:
            u = 140737488355328.0  # 2^47
        elif p == 4:
            u = 8796093022208.0  # 2^43
        elif p == 5:
            u = 549755813888.0  # 2^39
        elif p == 6:
            u = 8796093022208.0  # 2^43
        else:
            u = 549755813888.0  # 2^39
    else:
        if p == 0:
            u = 5.764607523034235e17  # 2^59
        elif p == 1:
            u = 2251799813685248.0  # 2^51
        elif p == 2:
            u = 8796093022208.0  # 2^43
        else:
            u = 8796093022208.0  # 2^43
    return u


@triton.jit
def _layout(offs_c, C, K, GROUP: tl.constexpr, P: tl.constexpr, BW: tl.constexpr):
    """Where word column c starts in the words and in the scales, and the strides of a word
    row and of a code position there: plain (BW 0) c, c, C, C; blocked (``KMajorWeight.block``
    = BW) the block's offset plus c's lane in it, and BW, BW."""
    if BW == 0:
        words_at = offs_c.to(tl.int64)
        meta_at = offs_c
        row = C
    else:
        block = offs_c // BW
        lane = offs_c % BW
        words_at = block.to(tl.int64) * (K * BW) + lane
        meta_at = block * ((K // GROUP) * (P * BW)) + lane
        row = C * 0 + BW
    return words_at, meta_at, row


@triton.jit
def _gemv_meta(ptr, meta, mask, p: tl.constexpr, C):
    """The fp32 scales (or offsets) of code position p for a [WARPS, BLOCK_C] tile."""
    return tl.load(ptr + meta + p * C, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _gemv_group_end(acc, dot, scale, offset, xs, p: tl.constexpr, INT4_KIND: tl.constexpr):
    """acc += one group's sum for code position p, scaled (int4: plus offset * sum x; int8:
    minus the 128 of the stored codes)."""
    if INT4_KIND:
        acc += dot * (scale * _unscale(p, INT4_KIND)) + offset * xs
    else:
        acc += (dot * _unscale(p, INT4_KIND) - 128.0 * xs) * scale
    return acc


@triton.jit
def _gemv_end_at(acc, dot, s_ptr, o_ptr, meta, mask, xs, p: tl.constexpr, C,
                 INT4_KIND: tl.constexpr):  # fmt: skip
    """`_gemv_group_end` with the group's scale (and offset) of position p loaded here."""
    scale = _gemv_meta(s_ptr, meta, mask, p, C)
    if INT4_KIND:
        offset = _gemv_meta(o_ptr, meta, mask, p, C)
    else:
        offset = scale  # unused
    return _gemv_group_end(acc, dot, scale, offset, xs, p, INT4_KIND)


@triton.jit
def _gemv_store(y_ptr, acc, offs_c, mask_c, N, p: tl.constexpr, P: tl.constexpr):
    out = offs_c * P + p
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask_c & (out < N))


@triton.jit
def _gemv_row(w_ptr, x_ptr, g, row, mask_g, mask_c, offs_c, C, GROUP: tl.constexpr):
    """Row ``row`` of each warp's group g: the words [WARPS, BLOCK_C] and x [WARPS] (fp32)."""
    return _gemv_words(w_ptr, g, row, mask_g, mask_c, offs_c, C, GROUP), _gemv_x(
        x_ptr, g, row, mask_g, GROUP
    )


@triton.jit
def _gemv_words(w_ptr, g, row, mask_g, mask_c, offs_c, C, GROUP: tl.constexpr):
    base = w_ptr + (g * GROUP)[:, None].to(tl.int64) * C + offs_c[None, :]
    return tl.load(base + row * C, mask=mask_g[:, None] & mask_c[None, :], other=0)


@triton.jit
def _gemv_x(x_ptr, g, row, mask_g, GROUP: tl.constexpr):
    return tl.load(x_ptr + g * GROUP + row, mask=mask_g, other=0.0).to(tl.float32)


@triton.jit
def _prefetch_l2(ptrs, mask):
    """A hint, no registers held: bring the 128-byte line of each of ``ptrs`` (where ``mask``)
    into L2 (PTX ``prefetch.global.L2``; the bulk form ``cp.async.bulk.prefetch`` takes a
    warp-uniform address: ptxas loops over the lanes). The 0 returned is a dummy: an inline
    asm needs a result."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs.to(tl.int64), mask.to(tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@triton.jit
def _gemv_prefetch(w_ptr, g0, last, row, pid, C, K, GROUP: tl.constexpr, BLOCK_C: tl.constexpr,
                   ROWS: tl.constexpr, WARPS: tl.constexpr, BW: tl.constexpr = 0):  # fmt: skip
    """Prefetch into L2 the words of one pipeline step: rows row .. row + ROWS - 1 of groups
    g0 .. g0 + WARPS - 1 (below ``last``), this program's BLOCK_C columns of each: one
    128-byte line (32 words) an element of a [WARPS, ROWS * lines] tensor of its own, about
    one a thread."""
    LINES: tl.constexpr = (BLOCK_C + 31) // 32
    g = g0 + tl.arange(0, WARPS)
    j = tl.arange(0, ROWS * LINES)
    k = (g * GROUP)[:, None] + (row + j // LINES)[None, :]
    col = pid * BLOCK_C + (j % LINES) * 32
    words_at, _, stride = _layout(col, C, K, GROUP, 1, BW)
    ptrs = w_ptr + k.to(tl.int64) * stride + words_at[None, :]
    mask = (g < last)[:, None] & (col < C)[None, :]
    _prefetch_l2(ptrs, mask)


@triton.jit
def _gemv_dot_row(d0, d1, d2, d3, d4, d5, d6, d7, xs, word, x, INT4_KIND: tl.constexpr):
    """The group sums d_p += code_p * x of one row (codes as denormals, x scaled by 2^90)."""
    xs += x
    xb = (x * 1.2379400392853803e27)[:, None]  # 2^90: products stay normal floats
    high = word >> 8
    d0 += _code(word, high, 0, INT4_KIND) * xb
    d1 += _code(word, high, 1, INT4_KIND) * xb
    d2 += _code(word, high, 2, INT4_KIND) * xb
    d3 += _code(word, high, 3, INT4_KIND) * xb
    if INT4_KIND:
        d4 += _code(word, high, 4, INT4_KIND) * xb
        d5 += _code(word, high, 5, INT4_KIND) * xb
        d6 += _code(word, high, 6, INT4_KIND) * xb
        d7 += _code(word, high, 7, INT4_KIND) * xb
    return d0, d1, d2, d3, d4, d5, d6, d7, xs


@triton.jit
def _gemv_finish(a0, a1, a2, a3, a4, a5, a6, a7, part_ptr, y_ptr, count_ptr, pid, split, splits,
                 offs_c, mask_c, N, C, BLOCK_C: tl.constexpr, INT4_KIND: tl.constexpr,
                 SPLIT: tl.constexpr):  # fmt: skip
    """Store the outputs (or, K split, this split's partials; the last program of the column
    block to arrive adds all splits' partials in order and resets its counter)."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    out = y_ptr
    if SPLIT:  # partials [splits, C * P] in fp32, indexed like the outputs
        out = part_ptr + split * (C * P)
    _gemv_store(out, tl.sum(a0, axis=0), offs_c, mask_c, N, 0, P)
    _gemv_store(out, tl.sum(a1, axis=0), offs_c, mask_c, N, 1, P)
    _gemv_store(out, tl.sum(a2, axis=0), offs_c, mask_c, N, 2, P)
    _gemv_store(out, tl.sum(a3, axis=0), offs_c, mask_c, N, 3, P)
    if INT4_KIND:
        _gemv_store(out, tl.sum(a4, axis=0), offs_c, mask_c, N, 4, P)
        _gemv_store(out, tl.sum(a5, axis=0), offs_c, mask_c, N, 5, P)
        _gemv_store(out, tl.sum(a6, axis=0), offs_c, mask_c, N, 6, P)
        _gemv_store(out, tl.sum(a7, axis=0), offs_c, mask_c, N, 7, P)
    if SPLIT:
        # every thread's partials are stored (barrier) before one thread's acq_rel add
        # publishes them; the last to arrive reads all (bypassing L1) and resets the counter
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            outs = pid * BLOCK_C * P + tl.arange(0, BLOCK_C * P)
            mask_o = outs < N
            total = tl.zeros([BLOCK_C * P], dtype=tl.float32)
            for s in range(splits):
                total += tl.load(part_ptr + s * (C * P) + outs, mask=mask_o, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            tl.store(y_ptr + outs, total.to(y_ptr.dtype.element_ty), mask=mask_o)
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")


@triton.jit
def _qgemv_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, part_ptr, y_ptr, count_ptr, N, C, K,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
    WARPS: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = 0,
    BW: tl.constexpr = 0,
):  # fmt: skip
    """y = x @ W^T for one row of x. Program (i, s): word columns [i * BLOCK_C, ...) over the
    groups of K split s, which its WARPS tile rows share out (row w takes groups w, w + WARPS,
    ...; WARPS is num_warps, or a multiple of it: the group slots of the config).
    Software-pipelined: each step handles ROWS (4 or 8) rows of a warp's group, and the
    next step's words are loaded before this step's math, so loads stay in flight while it
    runs; a group's scales are loaded when the group starts. With K split (SPLIT), each program
    writes fp32 partial sums and the last program of a column block to arrive (a counter per
    block, reset by that program) adds them in split order: deterministic, one kernel.
    PREFETCH = D > 0: the words of the step D ahead are prefetched into L2 at each step (steps
    1 .. D at the start), so D + 1 steps are in flight instead of one, without registers."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    SUB: tl.constexpr = GROUP // ROWS
    pid = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    words_at, meta_at, RS = _layout(offs_c, C, K, GROUP, P, BW)
    lanes = tl.arange(0, WARPS)
    groups = K // GROUP
    span = tl.cdiv(groups, splits)
    first = split * span
    last = tl.minimum(first + span, groups)
    g = first + lanes
    mask_g = g < last
    # the first step's words need nothing from the kernel before (PDL: they load while it ends)
    for t in tl.static_range(1, PREFETCH + 1):
        _gemv_prefetch(w_ptr, first + (t // SUB) * WARPS, last, (t % SUB) * ROWS, pid, C, K,
                       GROUP, BLOCK_C, ROWS, WARPS, BW)  # fmt: skip
    w0 = _gemv_words(w_ptr, g, 0, mask_g, mask_c, words_at, RS, GROUP)
    w1 = _gemv_words(w_ptr, g, 1, mask_g, mask_c, words_at, RS, GROUP)
    w2 = _gemv_words(w_ptr, g, 2, mask_g, mask_c, words_at, RS, GROUP)
    w3 = _gemv_words(w_ptr, g, 3, mask_g, mask_c, words_at, RS, GROUP)
    if ROWS == 8:
        w4 = _gemv_words(w_ptr, g, 4, mask_g, mask_c, words_at, RS, GROUP)
        w5 = _gemv_words(w_ptr, g, 5, mask_g, mask_c, words_at, RS, GROUP)
        w6 = _gemv_words(w_ptr, g, 6, mask_g, mask_c, words_at, RS, GROUP)
        w7 = _gemv_words(w_ptr, g, 7, mask_g, mask_c, words_at, RS, GROUP)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x (and the outputs' memory) belong to the kernels before
    x0 = _gemv_x(x_ptr, g, 0, mask_g, GROUP)
    x1 = _gemv_x(x_ptr, g, 1, mask_g, GROUP)
    x2 = _gemv_x(x_ptr, g, 2, mask_g, GROUP)
    x3 = _gemv_x(x_ptr, g, 3, mask_g, GROUP)
    if ROWS == 8:
        x4 = _gemv_x(x_ptr, g, 4, mask_g, GROUP)
        x5 = _gemv_x(x_ptr, g, 5, mask_g, GROUP)
        x6 = _gemv_x(x_ptr, g, 6, mask_g, GROUP)
        x7 = _gemv_x(x_ptr, g, 7, mask_g, GROUP)
    a0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    for g0 in range(first, last, WARPS):
        g = g0 + lanes
        mask_g = g < last
        mask = mask_g[:, None] & mask_c[None, :]
        meta = g[:, None] * (P * RS) + meta_at[None, :]
        s0 = _gemv_meta(s_ptr, meta, mask, 0, RS)
        s1 = _gemv_meta(s_ptr, meta, mask, 1, RS)
        s2 = _gemv_meta(s_ptr, meta, mask, 2, RS)
        s3 = _gemv_meta(s_ptr, meta, mask, 3, RS)
        if INT4_KIND:
            s4 = _gemv_meta(s_ptr, meta, mask, 4, RS)
            s5 = _gemv_meta(s_ptr, meta, mask, 5, RS)
            s6 = _gemv_meta(s_ptr, meta, mask, 6, RS)
            s7 = _gemv_meta(s_ptr, meta, mask, 7, RS)
            o0 = _gemv_meta(o_ptr, meta, mask, 0, RS)
            o1 = _gemv_meta(o_ptr, meta, mask, 1, RS)
            o2 = _gemv_meta(o_ptr, meta, mask, 2, RS)
            o3 = _gemv_meta(o_ptr, meta, mask, 3, RS)
            o4 = _gemv_meta(o_ptr, meta, mask, 4, RS)
            o5 = _gemv_meta(o_ptr, meta, mask, 5, RS)
            o6 = _gemv_meta(o_ptr, meta, mask, 6, RS)
            o7 = _gemv_meta(o_ptr, meta, mask, 7, RS)
        d0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        xs = tl.zeros([WARPS], dtype=tl.float32)
        for sub in tl.static_range(SUB):
            if PREFETCH > 0:  # the step PREFETCH ahead into L2
                _gemv_prefetch(w_ptr, g0 + ((sub + PREFETCH) // SUB) * WARPS, last,
                               ((sub + PREFETCH) % SUB) * ROWS, pid, C, K, GROUP, BLOCK_C, ROWS,
                               WARPS, BW)  # fmt: skip
            if sub + 1 < SUB:  # the next step: this group's next rows, or the next group's first
                ng = g
            else:
                ng = g + WARPS
            nm = ng < last
            r0 = ((sub + 1) % SUB) * ROWS
            n0, y0 = _gemv_row(w_ptr, x_ptr, ng, r0, nm, mask_c, words_at, RS, GROUP)
            n1, y1 = _gemv_row(w_ptr, x_ptr, ng, r0 + 1, nm, mask_c, words_at, RS, GROUP)
            n2, y2 = _gemv_row(w_ptr, x_ptr, ng, r0 + 2, nm, mask_c, words_at, RS, GROUP)
            n3, y3 = _gemv_row(w_ptr, x_ptr, ng, r0 + 3, nm, mask_c, words_at, RS, GROUP)
            if ROWS == 8:
                n4, y4 = _gemv_row(w_ptr, x_ptr, ng, r0 + 4, nm, mask_c, words_at, RS, GROUP)
                n5, y5 = _gemv_row(w_ptr, x_ptr, ng, r0 + 5, nm, mask_c, words_at, RS, GROUP)
                n6, y6 = _gemv_row(w_ptr, x_ptr, ng, r0 + 6, nm, mask_c, words_at, RS, GROUP)
                n7, y7 = _gemv_row(w_ptr, x_ptr, ng, r0 + 7, nm, mask_c, words_at, RS, GROUP)
            d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                d0, d1, d2, d3, d4, d5, d6, d7, xs, w0, x0, INT4_KIND)  # fmt: skip
            d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                d0, d1, d2, d3, d4, d5, d6, d7, xs, w1, x1, INT4_KIND)  # fmt: skip
            d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                d0, d1, d2, d3, d4, d5, d6, d7, xs, w2, x2, INT4_KIND)  # fmt: skip
            d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                d0, d1, d2, d3, d4, d5, d6, d7, xs, w3, x3, INT4_KIND)  # fmt: skip
            w0, x0, w1, x1, w2, x2, w3, x3 = n0, y0, n1, y1, n2, y2, n3, y3
            if ROWS == 8:
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w4, x4, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w5, x5, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w6, x6, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w7, x7, INT4_KIND)  # fmt: skip
                w4, x4, w5, x5, w6, x6, w7, x7 = n4, y4, n5, y5, n6, y6, n7, y7
        xsum = xs[:, None]
        if INT4_KIND:
            a0 = _gemv_group_end(a0, d0, s0, o0, xsum, 0, INT4_KIND)
            a1 = _gemv_group_end(a1, d1, s1, o1, xsum, 1, INT4_KIND)
            a2 = _gemv_group_end(a2, d2, s2, o2, xsum, 2, INT4_KIND)
            a3 = _gemv_group_end(a3, d3, s3, o3, xsum, 3, INT4_KIND)
            a4 = _gemv_group_end(a4, d4, s4, o4, xsum, 4, INT4_KIND)
            a5 = _gemv_group_end(a5, d5, s5, o5, xsum, 5, INT4_KIND)
            a6 = _gemv_group_end(a6, d6, s6, o6, xsum, 6, INT4_KIND)
            a7 = _gemv_group_end(a7, d7, s7, o7, xsum, 7, INT4_KIND)
        else:
            a0 = _gemv_group_end(a0, d0, s0, s0, xsum, 0, INT4_KIND)
            a1 = _gemv_group_end(a1, d1, s1, s1, xsum, 1, INT4_KIND)
            a2 = _gemv_group_end(a2, d2, s2, s2, xsum, 2, INT4_KIND)
            a3 = _gemv_group_end(a3, d3, s3, s3, xsum, 3, INT4_KIND)
    if PDL:  # the next kernel may launch while this one sums its K splits and stores
        tl.extra.cuda.gdc_launch_dependents()
    _gemv_finish(a0, a1, a2, a3, a4, a5, a6, a7, part_ptr, y_ptr, count_ptr, pid, split,
                 splits, offs_c, mask_c, N, C, BLOCK_C, INT4_KIND, SPLIT)  # fmt: skip


@triton.jit
def _qgemv_staged_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, part_ptr, y_ptr, count_ptr, N, C, K,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr,
    WARPS: tl.constexpr, SPLIT: tl.constexpr, BW: tl.constexpr = 0,
):  # fmt: skip
    """`_qgemv_kernel` with Triton's software pipeliner instead of registers: the words of the
    next STAGES - 1 group steps are fetched by cp.async into shared memory while this one is
    summed (deep prefetch at few registers: a tile choice, timed against the register one)."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    pid = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    words_at, meta_at, RS = _layout(offs_c, C, K, GROUP, P, BW)
    lanes = tl.arange(0, WARPS)
    groups = K // GROUP
    span = tl.cdiv(groups, splits)
    first = split * span
    last = tl.minimum(first + span, groups)
    a0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    for g0 in tl.range(first, last, WARPS, num_stages=STAGES):
        g = g0 + lanes
        mask_g = g < last
        mask = mask_g[:, None] & mask_c[None, :]
        meta = g[:, None] * (P * RS) + meta_at[None, :]
        d0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        xs = tl.zeros([WARPS], dtype=tl.float32)
        for r in tl.static_range(GROUP):
            word, x = _gemv_row(w_ptr, x_ptr, g, r, mask_g, mask_c, words_at, RS, GROUP)
            d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                d0, d1, d2, d3, d4, d5, d6, d7, xs, word, x, INT4_KIND)  # fmt: skip
        xsum = xs[:, None]
        a0 = _gemv_end_at(a0, d0, s_ptr, o_ptr, meta, mask, xsum, 0, RS, INT4_KIND)
        a1 = _gemv_end_at(a1, d1, s_ptr, o_ptr, meta, mask, xsum, 1, RS, INT4_KIND)
        a2 = _gemv_end_at(a2, d2, s_ptr, o_ptr, meta, mask, xsum, 2, RS, INT4_KIND)
        a3 = _gemv_end_at(a3, d3, s_ptr, o_ptr, meta, mask, xsum, 3, RS, INT4_KIND)
        if INT4_KIND:
            a4 = _gemv_end_at(a4, d4, s_ptr, o_ptr, meta, mask, xsum, 4, RS, INT4_KIND)
            a5 = _gemv_end_at(a5, d5, s_ptr, o_ptr, meta, mask, xsum, 5, RS, INT4_KIND)
            a6 = _gemv_end_at(a6, d6, s_ptr, o_ptr, meta, mask, xsum, 6, RS, INT4_KIND)
            a7 = _gemv_end_at(a7, d7, s_ptr, o_ptr, meta, mask, xsum, 7, RS, INT4_KIND)
    _gemv_finish(a0, a1, a2, a3, a4, a5, a6, a7, part_ptr, y_ptr, count_ptr, pid, split,
                 splits, offs_c, mask_c, N, C, BLOCK_C, INT4_KIND, SPLIT)  # fmt: skip


@triton.jit
def _reduce_kernel(part_ptr, y_ptr, count, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = the sum over s of part[s, i] in fp32, in a fixed order (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(part_ptr + s * count + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_gated_kernel(part_ptr, y_ptr, count, N, INNER, SPLIT: tl.constexpr,
                         ACT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """y[row, j] = act(gate) * up of a gate_up matrix's K-split partials [SPLIT, rows, N]:
    gate the sum of column j, up of column INNER + j, each summed in fp32 in split order and
    rounded to y's dtype first (as ``_reduce_kernel`` stores them for the gated activation)."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INNER
    at = row * N + offs
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        gate += tl.load(part_ptr + s * count + at, mask=mask, other=0.0)
        up += tl.load(part_ptr + s * count + at + INNER, mask=mask, other=0.0)
    dt = y_ptr.dtype.element_ty
    gated = gated_activation(gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32), ACT, dt)
    tl.store(y_ptr + row * INNER + offs, gated, mask=mask)


@triton.jit
def _weights(word, scale_ptr, offset_ptr, meta, mask, p: tl.constexpr, C, INT4_KIND: tl.constexpr):
    """The fp32 weights of code position p for a [rows, BLOCK_C] tile of words: the code
    into the mantissa of 2^23 (codes above bit 19 / 15 shifted down first), 2^23 taken off,
    times the group's scale divided by the code's power of two, plus the offset (int8:
    minus 128 * scale). ``meta`` indexes the [rows or 1, BLOCK_C] scales of position 0."""
    if INT4_KIND:
        if p < 5:
            bits = (word & (15 << (4 * p))) | 0x4B000000
            a: tl.constexpr = 4 * p
        else:
            bits = ((word >> 12) & (15 << (4 * p - 12))) | 0x4B000000
            a: tl.constexpr = 4 * p - 12
    else:
        if p < 2:
            bits = (word & (255 << (8 * p))) | 0x4B000000
            a: tl.constexpr = 8 * p
        else:
            bits = ((word >> 16) & (255 << (8 * p - 16))) | 0x4B000000
            a: tl.constexpr = 8 * p - 16
    value = bits.to(tl.float32, bitcast=True) - 8388608.0  # code * 2^a, exact
    scale = tl.load(scale_ptr + meta + p * C, mask=mask, other=0.0).to(tl.float32)
    if INT4_KIND:
        offset = tl.load(offset_ptr + meta + p * C, mask=mask, other=0.0).to(tl.float32)
    else:
        offset = -128.0 * scale
    return value * (scale * (1.0 / (1 << a))) + offset


def _bf16_pairs_asm() -> str:
    """PTX for 8 code positions of two int4 words at a time (``pack=2``): operands $0..$7 the
    bf16x2 weights of positions 0..7, $8 and $9 the two words, $10..$17 the bf16x2 scales and
    $18..$25 the offsets of positions 0..7. Per position: a byte permute puts the byte holding
    the code of each word in one half (odd positions from the words shifted right by 4), an
    AND/OR makes each half 128 + code as a bf16 (exact), a bf16x2 subtract takes the 128 off
    (exact) and one bf16x2 FMA gives code * scale + offset, rounded to bf16 once."""
    lines = ["{", ".reg .b32 hi0, hi1, t, base;", "mov.b32 base, 0x43004300;",
             "shr.u32 hi0, $8, 4;", "shr.u32 hi1, $9, 4;"]  # fmt: skip
    for p in range(8):
        byte = p // 2
        low, high = ("$8", "$9") if p % 2 == 0 else ("hi0", "hi1")
        select = byte | byte << 4 | (4 + byte) << 8 | (4 + byte) << 12
        lines += [
            f"prmt.b32 t, {low}, {high}, {select:#x};",
            "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;",  # (t & mask) | 128.0 in each half
            "sub.bf16x2 t, t, base;",
            f"fma.rn.bf16x2 ${p}, t, ${10 + p}, ${18 + p};",
        ]
    return "\n".join([*lines, "}"])


BF16_PAIRS_ASM = tl.constexpr(_bf16_pairs_asm())
BF16_PAIRS_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 18))


@triton.jit
def _bf16_meta(ptr, meta, mask, p: tl.constexpr, C, ASM: tl.constexpr):
    """Scales or offsets of code position p rounded to bf16 (kept in fp32 without ASM)."""
    value = tl.load(ptr + meta + p * C, mask=mask, other=0.0)
    if ASM:
        rounded = value.to(tl.bfloat16)
    else:
        rounded = _nearest_bf16(value.to(tl.float32))
    return rounded


@triton.jit
def _int4_bf16_weights(word, s_ptr, o_ptr, meta, mask, C, ASM: tl.constexpr):
    """The 8 bf16 weight tiles (code positions 0..7) of a [BLOCK_C, BLOCK_K] tile of int4
    words in one group: code * scale + offset rounded to bf16 once, with the scale and offset
    rounded to bf16 first. ASM: the PTX of `_bf16_pairs_asm` (~2 instructions a weight);
    otherwise the same arithmetic in fp32 (Triton's interpreter runs no PTX)."""
    s0 = _bf16_meta(s_ptr, meta, mask, 0, C, ASM)
    s1 = _bf16_meta(s_ptr, meta, mask, 1, C, ASM)
    s2 = _bf16_meta(s_ptr, meta, mask, 2, C, ASM)
    s3 = _bf16_meta(s_ptr, meta, mask, 3, C, ASM)
    s4 = _bf16_meta(s_ptr, meta, mask, 4, C, ASM)
    s5 = _bf16_meta(s_ptr, meta, mask, 5, C, ASM)
    s6 = _bf16_meta(s_ptr, meta, mask, 6, C, ASM)
    s7 = _bf16_meta(s_ptr, meta, mask, 7, C, ASM)
    o0 = _bf16_meta(o_ptr, meta, mask, 0, C, ASM)
    o1 = _bf16_meta(o_ptr, meta, mask, 1, C, ASM)
    o2 = _bf16_meta(o_ptr, meta, mask, 2, C, ASM)
    o3 = _bf16_meta(o_ptr, meta, mask, 3, C, ASM)
    o4 = _bf16_meta(o_ptr, meta, mask, 4, C, ASM)
    o5 = _bf16_meta(o_ptr, meta, mask, 5, C, ASM)
    o6 = _bf16_meta(o_ptr, meta, mask, 6, C, ASM)
    o7 = _bf16_meta(o_ptr, meta, mask, 7, C, ASM)
    if ASM:
        return tl.inline_asm_elementwise(
            BF16_PAIRS_ASM, BF16_PAIRS_CONSTRAINTS,
            [word, s0, s1, s2, s3, s4, s5, s6, s7, o0, o1, o2, o3, o4, o5, o6, o7],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2,
        )  # fmt: skip
    return (
        _bf16_weight(word, s0, o0, 0), _bf16_weight(word, s1, o1, 1),
        _bf16_weight(word, s2, o2, 2), _bf16_weight(word, s3, o3, 3),
        _bf16_weight(word, s4, o4, 4), _bf16_weight(word, s5, o5, 5),
        _bf16_weight(word, s6, o6, 6), _bf16_weight(word, s7, o7, 7),
    )  # fmt: skip


@triton.jit
def _wgmma_drain(k):
    """Wait for every warpgroup MMA in flight (PTX ``wgmma.wait_group 0``) at the end of a K
    step. Triton leaves the step's last MMAs in flight across the loop's back edge, where the
    accumulators' initial values also enter; ptxas then serializes every MMA of the loop
    (C7515: each waited for before the next dequantization). Closing the step here lets the
    step's 16 MMAs overlap one another and the dequantization between them. ``k`` is a dummy
    operand (an inline asm needs one); the 0 returned is unused."""
    return tl.inline_asm_elementwise(
        "{ wgmma.wait_group.sync.aligned 0; mov.b32 $0, 0; }", "=r,r", [k], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _bf16_dot(acc, w, x, ASM: tl.constexpr):
    """acc += w @ x for bf16 tiles; without ASM (Triton's interpreter, whose bf16 dot is
    wrong) as an exact fp32 dot of the same values."""
    if ASM:
        return acc + tl.dot(w, x)
    return acc + tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")


@triton.jit
def _bf16_weight(word, scale, offset, p: tl.constexpr):
    """The PTX's weight in fp32 arithmetic: code * scale + offset (exact in fp32 but for
    the add's rounding) rounded to the nearest bf16, even on ties (by hand: the interpreter's
    conversion truncates)."""
    code = ((word >> (4 * p)) & 15).to(tl.float32)
    return _nearest_bf16(code * scale + offset).to(tl.bfloat16)


@triton.jit
def _nearest_bf16(value):
    bits = value.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _qgemm_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, M, N, C, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_K: tl.constexpr, BF16_PAIRS: tl.constexpr, ASM: tl.constexpr,
    JOINED: tl.constexpr = False, PREFETCH: tl.constexpr = 0, BW: tl.constexpr = 0,
    DRAIN: tl.constexpr = False,
):  # fmt: skip
    """y [M, N] = x @ W^T, computed transposed: per code position p, tl.dot of the
    [BLOCK_C, BLOCK_K] weights of outputs P*c + p (dequantized in registers, the large side
    of the tensor-core tile, split across warps) and x's [BLOCK_K, BLOCK_M] tile. BLOCK_K is a
    multiple of the group, or (groups of 8) holds two: then each weight reads its own
    group's scales. JOINED: the P accumulators are interleaved into consecutive outputs before
    the store (``_gemm_store_joined``), else each is stored on its own, P outputs apart.
    PREFETCH = D > 0: at each K step the words, scales and offsets D steps ahead are
    prefetched into L2 (beyond the stages Triton's pipeliner keeps in shared memory)."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    PER_ROW: tl.constexpr = BLOCK_K > GROUP
    pid_m = tl.program_id(0)  # the row tiles of a column tile side by side: one reads the
    pid_c = tl.program_id(1)  # weights from HBM, the others mostly from L2
    split = tl.program_id(2)  # K split: partial sums into y[split] (fp32), added by _reduce_kernel
    tiles = tl.cdiv(K, BLOCK_K)
    span = tl.cdiv(tiles, tl.num_programs(2))
    k_first = split * span * BLOCK_K
    k_last = tl.minimum((split + 1) * span, tiles) * BLOCK_K
    y_ptr += split * M * N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_m = offs_m < M
    mask_c = offs_c < C
    words_at, meta_at, RS = _layout(offs_c, C, K, GROUP, P, BW)
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    acc0 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_C, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_first, k_last, BLOCK_K):
        if PREFETCH > 0 and BW == 0:  # (the plain layout's addresses)
            _gemm_prefetch(w_ptr, s_ptr, o_ptr, k0 + PREFETCH * BLOCK_K, k_last, pid_c, C, K,
                           GROUP, BLOCK_C, BLOCK_K, P, INT4_KIND)  # fmt: skip
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = (offs_k < K) | EVEN_K  # EVEN_K: K a multiple of BLOCK_K, no mask to compute
        mask = mask_c[:, None] & mask_k[None, :]
        word = tl.load(w_ptr + offs_k[None, :].to(tl.int64) * RS + words_at[:, None], mask=mask,
                       other=0)  # fmt: skip
        if PER_ROW:
            meta = (offs_k // GROUP)[None, :] * (P * RS) + meta_at[:, None]
            meta_mask = mask
        else:
            meta = (k0 // GROUP) * (P * RS) + meta_at[:, None]
            meta_mask = mask_c[:, None]
        x = tl.load(x_cols + offs_k[:, None], mask=mask_k[:, None] & mask_m[None, :],
                    other=0.0)  # fmt: skip
        if BF16_PAIRS:  # int4 with bf16 x: weights made as bf16 pairs (~2 instructions each)
            w0, w1, w2, w3, w4, w5, w6, w7 = _int4_bf16_weights(word, s_ptr, o_ptr, meta,
                                                                meta_mask, RS, ASM)  # fmt: skip
            acc0 = _bf16_dot(acc0, w0, x, ASM)
            acc1 = _bf16_dot(acc1, w1, x, ASM)
            acc2 = _bf16_dot(acc2, w2, x, ASM)
            acc3 = _bf16_dot(acc3, w3, x, ASM)
            acc4 = _bf16_dot(acc4, w4, x, ASM)
            acc5 = _bf16_dot(acc5, w5, x, ASM)
            acc6 = _bf16_dot(acc6, w6, x, ASM)
            acc7 = _bf16_dot(acc7, w7, x, ASM)
        else:
            ty = x.dtype
            w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 0, RS, INT4_KIND)
            acc0 += tl.dot(w.to(ty), x, input_precision=PRECISION)
            w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 1, RS, INT4_KIND)
            acc1 += tl.dot(w.to(ty), x, input_precision=PRECISION)
            w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 2, RS, INT4_KIND)
            acc2 += tl.dot(w.to(ty), x, input_precision=PRECISION)
            w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 3, RS, INT4_KIND)
            acc3 += tl.dot(w.to(ty), x, input_precision=PRECISION)
            if INT4_KIND:
                w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 4, RS, INT4_KIND)
                acc4 += tl.dot(w.to(ty), x, input_precision=PRECISION)
                w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 5, RS, INT4_KIND)
                acc5 += tl.dot(w.to(ty), x, input_precision=PRECISION)
                w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 6, RS, INT4_KIND)
                acc6 += tl.dot(w.to(ty), x, input_precision=PRECISION)
                w = _weights(word, s_ptr, o_ptr, meta, meta_mask, 7, RS, INT4_KIND)
                acc7 += tl.dot(w.to(ty), x, input_precision=PRECISION)
        if ASM and DRAIN:  # the K step's MMAs closed before the loop's back edge
            _wgmma_drain(k0)
    y_cols = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym
    if JOINED:
        _gemm_store_joined(y_cols, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, pid_c, mask_m,
                           N, BLOCK_C, BLOCK_M, P)  # fmt: skip
    else:
        _gemm_store(y_cols, acc0, offs_c, mask_m, mask_c, N, 0, P)
        _gemm_store(y_cols, acc1, offs_c, mask_m, mask_c, N, 1, P)
        _gemm_store(y_cols, acc2, offs_c, mask_m, mask_c, N, 2, P)
        _gemm_store(y_cols, acc3, offs_c, mask_m, mask_c, N, 3, P)
        if INT4_KIND:
            _gemm_store(y_cols, acc4, offs_c, mask_m, mask_c, N, 4, P)
            _gemm_store(y_cols, acc5, offs_c, mask_m, mask_c, N, 5, P)
            _gemm_store(y_cols, acc6, offs_c, mask_m, mask_c, N, 6, P)
            _gemm_store(y_cols, acc7, offs_c, mask_m, mask_c, N, 7, P)


@triton.jit
def _gemm_prefetch(w_ptr, s_ptr, o_ptr, k0, k_last, pid_c, C, K, GROUP: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr,
                   INT4_KIND: tl.constexpr):  # fmt: skip
    """Prefetch into L2 the K tile at k0 (if below k_last): its [BLOCK_K, BLOCK_C] words a
    128-byte line an element, and its groups' scales (and offsets) of the P code positions."""
    LINES: tl.constexpr = (BLOCK_C + 31) // 32
    rows = k0 + tl.arange(0, BLOCK_K)
    col = pid_c * BLOCK_C + tl.arange(0, LINES) * 32
    ptrs = w_ptr + rows[:, None].to(tl.int64) * C + col[None, :]
    _prefetch_l2(ptrs, ((rows < k_last) & (rows < K))[:, None] & (col < C)[None, :])
    META: tl.constexpr = (BLOCK_C + 63) // 64  # lines of BLOCK_C fp16
    GROUPS: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP
    j = tl.arange(0, GROUPS * P)
    mcol = pid_c * BLOCK_C + tl.arange(0, META) * 64
    meta = ((k0 // GROUP + j // P) * (P * C) + (j % P) * C)[:, None] + mcol[None, :]
    first = k0 + (j // P) * GROUP
    mmask = ((first < k_last) & (first < K))[:, None] & (mcol < C)[None, :]
    _prefetch_l2(s_ptr + meta, mmask)
    if INT4_KIND:
        _prefetch_l2(o_ptr + meta, mmask)


@triton.jit
def _gemm_store(y_cols, acc, offs_c, mask_m, mask_c, N, p: tl.constexpr, P: tl.constexpr):
    out = offs_c * P + p  # acc [BLOCK_C, BLOCK_M]: outputs by rows of x
    mask = (mask_c & (out < N))[:, None] & mask_m[None, :]
    tl.store(y_cols + out[:, None], acc.to(y_cols.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_store_joined(y_cols, a0, a1, a2, a3, a4, a5, a6, a7, pid_c, mask_m, N,
                       BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, P: tl.constexpr):  # fmt: skip
    """The P accumulators [BLOCK_C, BLOCK_M] (acc p: outputs P*c + p) as one tile of
    [BLOCK_C * P, BLOCK_M] consecutive outputs, stored along N: whole lines per warp, where
    ``_gemm_store`` writes 4 of every 32 bytes a store (int4), P stores a line."""
    if P == 8:  # joins nest as p = 4 l + 2 j + i, the flattened order of [.., l, j, i]
        t = tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)),
                    tl.join(tl.join(a1, a5), tl.join(a3, a7)))  # fmt: skip
    else:  # p = 2 l + i
        t = tl.join(tl.join(a0, a2), tl.join(a1, a3))
    t = tl.reshape(t, [BLOCK_C, BLOCK_M, P])
    t = tl.reshape(tl.permute(t, (0, 2, 1)), [BLOCK_C * P, BLOCK_M])  # row P*c + p
    out = pid_c * (BLOCK_C * P) + tl.arange(0, BLOCK_C * P)
    mask = (out < N)[:, None] & mask_m[None, :]
    tl.store(y_cols + out[:, None], t.to(y_cols.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, o_ptr, out_ptr, N, C, K, C0,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    BW: tl.constexpr = 0,
):  # fmt: skip
    """out [K, N] (x's dtype) = the dequantized weight's outputs from word column C0 on,
    transposed (N: the outputs out holds; the grid covers its word columns)."""
    P: tl.constexpr = 8 if INT4_KIND else 4
    offs_c = C0 + tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_k < K)[:, None] & (offs_c < C)[None, :]
    words_at, meta_at, RS = _layout(offs_c, C, K, GROUP, P, BW)
    word = tl.load(w_ptr + offs_k[:, None].to(tl.int64) * RS + words_at[None, :], mask=mask,
                   other=0)  # fmt: skip
    meta = (offs_k // GROUP)[:, None] * (P * RS) + meta_at[None, :]
    ty = out_ptr.dtype.element_ty
    w0 = _weights(word, s_ptr, o_ptr, meta, mask, 0, RS, INT4_KIND).to(ty)
    w1 = _weights(word, s_ptr, o_ptr, meta, mask, 1, RS, INT4_KIND).to(ty)
    w2 = _weights(word, s_ptr, o_ptr, meta, mask, 2, RS, INT4_KIND).to(ty)
    w3 = _weights(word, s_ptr, o_ptr, meta, mask, 3, RS, INT4_KIND).to(ty)
    # the P positions of a word side by side (join's new last axis, in registers): each
    # thread stores its words' P outputs as one contiguous vector
    if INT4_KIND:
        w4 = _weights(word, s_ptr, o_ptr, meta, mask, 4, RS, INT4_KIND).to(ty)
        w5 = _weights(word, s_ptr, o_ptr, meta, mask, 5, RS, INT4_KIND).to(ty)
        w6 = _weights(word, s_ptr, o_ptr, meta, mask, 6, RS, INT4_KIND).to(ty)
        w7 = _weights(word, s_ptr, o_ptr, meta, mask, 7, RS, INT4_KIND).to(ty)
        evens = tl.join(tl.join(w0, w4), tl.join(w2, w6))  # [.., a, b] = w(4a + 2b)
        odds = tl.join(tl.join(w1, w5), tl.join(w3, w7))
        tile = tl.reshape(tl.join(evens, odds), [BLOCK_K, BLOCK_C * P])
    else:
        tile = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_K, BLOCK_C * P])
    cols = tl.program_id(0) * BLOCK_C * P + tl.arange(0, BLOCK_C * P)
    out = out_ptr + offs_k[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, tile, mask=(offs_k < K)[:, None] & (cols < N)[None, :])


def meta_dtype_for(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The scales' and offsets' dtype in the GPU layout: bf16 for int4 weights of a bf16 model
    (its GEMM rounds them to bf16 anyway, ``_int4_bf16_weights``; stored so, its loop skips 48
    of 567 instructions a K step converting them, tools/sass_quant_kernels.py; its GEMV takes
    them as they are), else fp16 as quantized. TOKENPIPE_QUANT_BF16_META=0: always fp16."""
    if kind == INT4 and dtype == torch.bfloat16 and _bf16_pairs():
        if os.environ.get("TOKENPIPE_QUANT_BF16_META", "1") != "0":
            return torch.bfloat16
    return torch.float16


def _check(x: torch.Tensor, packed: KMajorWeight) -> None:
    if x.dim() != 2 or x.shape[1] != packed.shape[1] or x.stride(1) != 1:
        raise ValueError(f"quantized matmul: x {tuple(x.shape)} against {list(packed.shape)}")


def _offsets(packed: KMajorWeight) -> torch.Tensor:
    return packed.offsets if packed.offsets is not None else packed.scales  # int8: never read


def split_for(columns: int, groups: int, block_c: int, programs: int, warps: int = 1) -> int:
    """K splits (whole groups each) that bring the GEMV to about ``programs`` programs: a
    matrix of few outputs (5,376 of them, K 21,504) otherwise leaves most SMs idle. Each
    split keeps at least one group per warp."""
    return max(1, min(groups // warps, programs // triton.cdiv(columns, block_c)))


def qgemv(
    x: torch.Tensor, packed: KMajorWeight, config: tuple[int, ...] | None = None,
    split: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [1, K] @ W^T -> [1, N] in x's dtype; ``split`` K-splits (None: ``split_for`` the
    config's program count), added in fp32 by the last program of each column block."""
    _check(x, packed)
    if x.shape[0] != 1:
        raise ValueError(f"qgemv serves one row, got {x.shape[0]}")
    n, k = packed.shape
    block_c, programs, num_warps, rows, *more = config or packed.gemv_config or GEMV_CONFIG
    slots = more[0] if more else num_warps
    prefetch = more[1] if len(more) > 1 and not _interpreting() else 0
    groups = k // packed.group_size
    stages = -rows if rows < 0 else 0  # -S: `_qgemv_staged_kernel` with S stages
    rows = 8 if rows >= 8 and packed.group_size >= 8 else 4
    if split is None:
        split = split_for(packed.columns, groups, block_c, programs, slots)
    blocks = triton.cdiv(packed.columns, block_c)
    pdl = _pdl(x) and not stages
    y = torch.empty((1, n), device=x.device, dtype=x.dtype)
    part = y
    if split > 1:
        part = torch.empty((split, packed.columns * packed.per_word), device=x.device,
                           dtype=torch.float32)  # fmt: skip
    args = (x, packed.words, packed.scales, _offsets(packed), part, y, packed.counters(blocks), n,
            packed.columns, k)  # fmt: skip
    if stages:
        _qgemv_staged_kernel[(blocks, split)](
            *args, GROUP=packed.group_size, INT4_KIND=packed.kind == INT4, BLOCK_C=block_c,
            STAGES=stages, WARPS=slots, SPLIT=split > 1, BW=packed.block, num_warps=num_warps,
        )  # fmt: skip
    else:
        _qgemv_kernel[(blocks, split)](
            *args, GROUP=packed.group_size, INT4_KIND=packed.kind == INT4, BLOCK_C=block_c,
            ROWS=rows, WARPS=slots, SPLIT=split > 1, PDL=pdl, PREFETCH=prefetch, BW=packed.block,
            num_warps=num_warps, launch_pdl=pdl,
        )  # fmt: skip
    return y


def qgemm(
    x: torch.Tensor, packed: KMajorWeight, config: tuple[int, ...] | None = None,
    split: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ W^T -> [M, N], weights dequantized in registers for ``tl.dot``; K split
    over ``split`` programs (None: enough for about ``programs`` programs), summed in fp32.
    ``config``: (BLOCK_C, BLOCK_K, num_warps, num_stages[, joined store: 1[, programs]]);
    programs left out: GEMM_PROGRAMS."""
    out = _qgemm_launch(x, packed, config, split)
    return out if out.dim() == 2 else sum_splits(out, x.dtype)


def sum_splits(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[split, M, N] K-split partials -> their sum [M, N] in ``dtype``, added in fp32 in split
    order by ``_reduce_kernel``."""
    split, m, n = partials.shape
    y = torch.empty((m, n), device=partials.device, dtype=dtype)
    count = m * n
    _reduce_kernel[(triton.cdiv(count, REDUCE_BLOCK),)](
        partials, y, count, SPLIT=split, BLOCK=REDUCE_BLOCK, num_warps=2
    )
    return y


def qgemm_gated(
    x: torch.Tensor, packed: KMajorWeight, act: str, config: tuple[int, ...] | None = None,
    split: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """act(gate) * up [M, N / 2] of a gate_up matrix (gate outputs first): ``qgemm``, with
    its split sum and the gated activation in one kernel (``_reduce_gated_kernel``), the same
    bits as ``qgemm`` then ``rmsnorm.gated_act_triton``. ``act``: a GATED_ACTIVATIONS key."""
    from worker.device.kernels.rmsnorm import gated_act_triton

    out = _qgemm_launch(x, packed, config, split)
    inner = out.shape[-1] // 2
    if out.dim() == 2:  # not split
        return gated_act_triton(out[:, :inner], out[:, inner:], act)
    split, m, n = out.shape
    gated = torch.empty((m, inner), device=x.device, dtype=x.dtype)
    _reduce_gated_kernel[(m, triton.cdiv(inner, REDUCE_BLOCK))](
        out, gated, m * n, n, inner, SPLIT=split, ACT=GATED_ACTIVATIONS[act], BLOCK=REDUCE_BLOCK,
        num_warps=2,
    )  # fmt: skip
    return gated


def _qgemm_launch(
    x: torch.Tensor, packed: KMajorWeight, config: tuple[int, ...] | None, split: int | None
) -> torch.Tensor:
    """The GEMM kernel of ``qgemm``: what it wrote, y [M, N] itself, or K-split partials
    [split, M, N] (bf16 for bf16 x, ``PARTIALS_BF16``; else fp32)."""
    _check(x, packed)
    m = x.shape[0]
    n, k = packed.shape
    block_c, block_k, num_warps, num_stages, *more = config or packed.gemm_config or GEMM_CONFIG
    joined = bool(more and more[0])
    programs = more[1] if len(more) > 1 and more[1] else GEMM_PROGRAMS
    prefetch = more[2] if len(more) > 2 and not _interpreting() else 0
    group = packed.group_size
    block_k = max(16, group, block_k - block_k % group)  # a multiple of the group, >= 16
    if block_k > group and group < 16:
        block_k = 16  # groups of 8: two per tile, scales read per row
    block_m = 16 if m <= 16 else min(32 if m <= 32 else 64, GEMM_BLOCK_M)
    tiles = (triton.cdiv(m, block_m), triton.cdiv(packed.columns, block_c))
    if split is None:  # few word columns (5,376 outputs: 11 tiles of 64): split K
        split = programs // (tiles[0] * tiles[1])
        if split < 2 and GEMM_PROGRAMS_PER_ROW_TILE:  # row tiles fill the grid unsplit
            split = programs // tiles[1]  # the target per row tile
        split = max(1, min(triton.cdiv(k, block_k), split))
    partial = x.dtype if PARTIALS_BF16 and x.dtype == torch.bfloat16 else torch.float32
    if split == 1:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    else:
        out = torch.empty((split, m, n), device=x.device, dtype=partial)
    _qgemm_kernel[(*tiles, split)](
        x, packed.words, packed.scales, _offsets(packed), out, m, n, packed.columns, k,
        x.stride(0), n,
        GROUP=group, INT4_KIND=packed.kind == INT4,
        BLOCK_M=block_m, BLOCK_C=block_c, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EVEN_K=k % block_k == 0,
        BF16_PAIRS=packed.kind == INT4 and x.dtype == torch.bfloat16 and _bf16_pairs(),
        ASM=not _interpreting(), JOINED=joined, PREFETCH=prefetch, BW=packed.block,
        DRAIN=num_warps % 4 == 0 and _wgmma_drain_on(x.device),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _pdl(x: torch.Tensor) -> bool:
    """Programmatic dependent launch for the GEMV (``kernels.dependent_launch``): it may start
    while the kernel before it ends, loading its first weights, and waits for that kernel
    (``gdc_wait``) before it reads x."""
    from worker.device.kernels import dependent_launch

    return dependent_launch(x.device)


@functools.cache
def _wgmma_drain_on(device: torch.device) -> bool:
    """Whether the GEMM closes each K step's warpgroup MMAs (``_wgmma_drain``): on Hopper
    (sm_90, the only GPUs with wgmma; a tile of whole warpgroups), unless
    TOKENPIPE_QUANT_GEMM_DRAIN=0."""
    if os.environ.get("TOKENPIPE_QUANT_GEMM_DRAIN", "1") == "0" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def _interpreting() -> bool:
    """Triton's interpreter (CPU tests) runs no PTX: the L2 prefetch hints are left out."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _bf16_pairs() -> bool:
    """int4 GEMMs with bf16 x make their weights as bf16 pairs (``_int4_bf16_weights``) unless
    TOKENPIPE_QUANT_BF16_PAIRS=0 (then in fp32, rounded to bf16 once, as the reference)."""
    return os.environ.get("TOKENPIPE_QUANT_BF16_PAIRS", "1") != "0"


def dequantize_triton(
    packed: KMajorWeight,
    dtype: torch.dtype,
    outputs: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight, transposed: [K, N] in ``dtype`` (the prefill path's scratch); with
    ``outputs`` = (start, end), only those outputs ([K, end - start]; start a multiple of the
    outputs a word holds). ``out``: where to write it (default: a new tensor)."""
    n, k = packed.shape
    start, end = outputs if outputs is not None else (0, n)
    per_word = packed.per_word
    assert start % per_word == 0 and 0 <= start < end <= n, (start, end, n)
    if out is None:
        out = torch.empty((k, end - start), device=packed.words.device, dtype=dtype)
    block_c, block_k = 32, 32
    words = triton.cdiv(end, per_word) - start // per_word
    grid = (triton.cdiv(words, block_c), triton.cdiv(k, block_k))
    _dequant_kernel[grid](
        packed.words, packed.scales, _offsets(packed), out, end - start, packed.columns, k,
        start // per_word, GROUP=packed.group_size, INT4_KIND=packed.kind == INT4,
        BLOCK_C=block_c, BLOCK_K=block_k, BW=packed.block, num_warps=4,
    )  # fmt: skip
    return out


SCRATCH_BYTES = int(float(os.environ.get("TOKENPIPE_QUANT_SCRATCH_MB", "64")) * (1 << 20))
"""The prefill path's dequantized scratch holds at most this many bytes: a longer weight is
dequantized and multiplied a range of outputs at a time (cuBLAS per range; each output's sum
is the same computation, so the result is the whole weight's, up to cuBLAS's choice of kernel
for the narrower shape). The whole gate_up of Gemma 4 31B in bf16 is 441 MiB, once in the
eager prefill and once in the prefill graphs' pool: too much next to a 24 GB card's KV."""

_SCRATCH: dict[torch.device, torch.Tensor] = {}


def reserve_scratch(device: torch.device | str) -> int:
    """Allocate the prefill path's dequantized scratch on `device` now, for the life of the
    process: ``SCRATCH_BYTES``, which every quantized matmul's prefill range (int4, int8 and
    int6 weights, eager steps and the prefill graphs alike) then writes instead of a tensor of
    its own. A worker does this before its caches, while the memory is in one piece: a step
    that asks for it later, under a card's limit, finds only holes (session 40: 251 MiB free in
    137 pieces, the largest 30 MiB, so a 64 MiB scratch failed where the step's other tensors
    fitted). Steps run one after another on one stream, so one scratch serves them all. The
    bytes newly allocated (0 where it already was)."""
    from worker.device.memory import indexed

    key = indexed(device)
    if key in _SCRATCH:
        return 0
    _SCRATCH[key] = torch.empty(SCRATCH_BYTES, dtype=torch.uint8, device=key)
    return SCRATCH_BYTES


def scratch(
    shape: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """A [K, width] view of the reserved scratch (``reserve_scratch``) on `device`, or None
    where none is reserved or it is too small (the caller allocates one)."""
    buffer = _SCRATCH.get(device)
    size = shape[0] * shape[1] * dtype.itemsize
    if buffer is None or size > buffer.numel():
        return None
    return buffer[:size].view(dtype).view(shape)


def _dequantized_linear(flat: torch.Tensor, packed: KMajorWeight) -> torch.Tensor:
    """x [M, K] @ W^T through a scratch of at most ``SCRATCH_BYTES`` (the reserved one where
    ``reserve_scratch`` ran)."""
    n, k = packed.shape
    per_word = packed.per_word
    budget = SCRATCH_BYTES // (k * flat.element_size())  # outputs a range may hold
    width = budget // 256 * 256 if budget >= 256 else max(per_word, budget // per_word * per_word)
    if width >= n:
        whole = scratch((k, n), flat.dtype, flat.device)
        return F.linear(flat, dequantize_triton(packed, flat.dtype, None, whole).t())
    y = flat.new_empty((flat.shape[0], n))
    for start in range(0, n, width):
        end = min(n, start + width)
        into = scratch((k, end - start), flat.dtype, flat.device)
        w = dequantize_triton(packed, flat.dtype, (start, end), into)
        torch.mm(flat, w, out=y[:, start:end])
    return y


def quant_linear_gated(x: torch.Tensor, packed: KMajorWeight, act: str) -> torch.Tensor | None:
    """act(gate) * up of a gate_up matrix (gate outputs first) for x [M, K] by
    ``qgemm_gated``, where x's rows take the GEMM and ``GATED_SUM`` is on; else None (the
    caller runs the matrix, then the activation)."""
    m = x.shape[0]
    if not GATED_SUM or x.dim() != 2 or not GEMV_MAX_ROWS < m <= GEMM_MAX_ROWS:
        return None
    if act not in GATED_ACTIVATIONS or packed.shape[0] % 2:
        return None
    return qgemm_gated(x if x.stride(-1) == 1 else x.contiguous(), packed, act)


def quant_linear(
    x: torch.Tensor, packed: KMajorWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for x [..., K], by the path that suits M."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if m == 0:
        y = flat.new_empty((0, packed.shape[0]))
    elif m <= GEMV_MAX_ROWS:
        y = qgemv(flat, packed)
    elif m <= GEMM_MAX_ROWS:
        y = qgemm(flat, packed)
    else:
        y = _dequantized_linear(flat, packed)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, packed.shape[0])


# -- choosing tiles per matrix ------------------------------------------------------------------

# candidates timed per matrix shape at start-up (tools/bench_quant_kernels.py --sweep: the
# fastest configs of the 31B shapes on an H200 were among these)
# (the cp.async variant, rows -S, never won on the H200's 31B shapes: not timed at start-up)
GEMV_CANDIDATES: list[tuple[int, ...]] = [(32, 264, 8, 8), (128, 264, 4, 8), (64, 264, 8, 8),
                                          (128, 396, 4, 8), (32, 132, 8, 8)]  # fmt: skip
# GEMV tiles with group slots (a warp's lanes on 4 / 2 groups, 128-bit loads at BLOCK_C 32),
# timed beside the others unless TOKENPIPE_QUANT_GEMV_SLOTS=0. On an H200 through the worker
# with them as candidates (s11r1, s11r5): int8 batch 1 80.2 -> 88.5 tok/s, int4 103 -> 103-106
# (the start-up picked (64, 264, 4, 8, 8) for qkv, gate_up and the full layers' matrices).
SLOT_CANDIDATES = [(32, 264, 8, 8, 32), (32, 264, 4, 4, 16), (32, 396, 4, 8, 16),
                   (64, 264, 4, 8, 8)]  # fmt: skip
if os.environ.get("TOKENPIPE_QUANT_GEMV_SLOTS", "1") != "0":
    GEMV_CANDIDATES += SLOT_CANDIDATES
# GEMM tiles with the joined store (5th field; ``_gemm_store_joined``: 128-bit stores of
# consecutive outputs instead of 4-byte stores 32 bytes apart, 216 registers instead of 253 at
# 32 rows), two with K split for 264 programs (6th field; two programs an SM). On an H200
# (s11r5, weights past L2) they beat session 7's tiles (at their 132 programs) at 8, 32 and
# 64 rows (32 rows: 1.4-1.55x), and int4 decode at 32 sessions went 1,565 -> 2,123 tok/s.
# Session 13 (s13r1): narrower tiles on mma.sync, (32, 32, 2, 3, 1, 528) and (16, 32, 1, 3,
# 1, 528 / 1056), 4 programs of 2 warps or 8 of 1 an SM, 6-12% faster at 32 rows on every
# matrix (the same 4.4 instructions a weight; more programs to hide latency behind).
JOINED_CANDIDATES: list[tuple[int, ...]] = [
    (32, 32, 2, 3, 1, 528), (32, 32, 2, 4, 1, 528), (16, 32, 1, 3, 1, 528),
    (16, 32, 1, 3, 1, 1056), (32, 32, 2, 3, 1, 264), (64, 32, 4, 3, 1, 264),
    (64, 32, 4, 4, 1, 264),
]  # fmt: skip
PER_POSITION_CANDIDATES: list[tuple[int, ...]] = [(64, 32, 4, 3), (32, 32, 4, 3),
                                                  (128, 32, 8, 3), (64, 64, 4, 2)]  # fmt: skip
GEMM_CANDIDATES = JOINED_CANDIDATES if GEMM_JOINED else PER_POSITION_CANDIDATES
# L2 prefetch ahead (GEMV field 6: steps; GEMM field 7: K tiles): each program asks for the
# words of a later step while it sums this one (``_prefetch_l2``: no registers held), so
# more of a matrix is in flight than its register or shared-memory pipeline holds. Timed
# beside the others unless TOKENPIPE_QUANT_PREFETCH=0.
# On an H200 (s12r1, Gemma 4 31B int4 matrices past L2) the GEMM at 32 rows gained 2-6% with
# 4 tiles ahead (not the LM head); the GEMV none (0-20% slower: it is not waiting on HBM
# latency), so its field stays a benchmark option (tools/bench_quant_kernels.py --tiles).
PREFETCH_GEMM_CANDIDATES = [(64, 32, 4, 3, 1, 264, 4), (64, 32, 4, 4, 1, 264, 6)]
if os.environ.get("TOKENPIPE_QUANT_PREFETCH", "1") != "0" and not BLOCK_WORDS:  # plain layout
    GEMM_CANDIDATES = GEMM_CANDIDATES + PREFETCH_GEMM_CANDIDATES


def choose_configs(
    weights: list[KMajorWeight],
    dtype: torch.dtype,
    timer: Callable[..., float] | None = None,
    cache: Path | None = None,
    device_name: str = "",
    remember: bool = True,
) -> int:
    """Time the candidate tiles of each distinct matrix shape (one row for the GEMV, 32 for
    the GEMM) inside CUDA graphs, the way decode runs them, over the model's matrices of that
    shape in turn (``_past_l2``), and keep the fastest on each weight.
    A candidate this GPU cannot run (shared memory) is skipped. Choices are remembered in
    ``cache`` (a JSON file keyed by the GPU's name, the matrix and the candidates) so a later
    start skips the timing; ``remember=False`` leaves the file as it was (a run whose timer
    only launches, worker/device/cuda_setup.py). Returns the shapes timed now."""
    if timer is None:
        from worker.device.kernels.gemv import graph_seconds as timer
    known = _read_choices(cache)
    chosen: dict[tuple[object, ...], tuple[object, object]] = {}
    shapes: dict[tuple[object, ...], list[KMajorWeight]] = {}
    for packed in weights:
        shapes.setdefault((packed.kind, packed.shape, packed.group_size), []).append(packed)
    timed = 0
    for packed in weights:
        key = (packed.kind, packed.shape, packed.group_size)
        if key not in chosen:
            name = _choice_key(device_name, packed, dtype)
            if name in known:
                gemv, gemm = (tuple(c) if c else None for c in known[name])
            else:
                n, k = packed.shape
                device = packed.words.device
                one = torch.randn(1, k, device=device, dtype=dtype)
                many = torch.randn(32, k, device=device, dtype=dtype)
                turn = _past_l2(shapes[key])

                def gemv_run(c, x=one, ws=turn):  # type: ignore[no-untyped-def]
                    return [qgemv(x, w, c) for w in ws]

                def gemm_run(c, x=many, ws=turn):  # type: ignore[no-untyped-def]
                    return [qgemm(x, w, c) for w in ws]

                gemv = _fastest(gemv_run, GEMV_CANDIDATES, timer)
                gemm = _fastest(gemm_run, GEMM_CANDIDATES, timer)
                known[name] = [gemv, gemm]
                timed += 1
            chosen[key] = (gemv, gemm)
        packed.gemv_config, packed.gemm_config = chosen[key]  # type: ignore[assignment]
    if timed and remember:
        _write_choices(cache, known)
    return timed


def _past_l2(same: list[KMajorWeight], enough: int = 200_000_000) -> list[KMajorWeight]:
    """The model's matrices of one shape to time a tile over, each call on the next: as many
    as make ``enough`` bytes, so no call finds its weight in L2 (50 MB on an H200), as in a
    decode step, which reads each matrix once. A single matrix times the tiles from L2 where
    it fits: a qkv or o_proj of the 31B model (28-55 MB) partly does."""
    return same[: max(1, -(-enough // max(1, same[0].nbytes)))]


def _choice_key(device_name: str, packed: KMajorWeight, dtype: torch.dtype) -> str:
    n, k = packed.shape
    candidates = repr((GEMV_CANDIDATES, GEMM_CANDIDATES, "timed past L2"))
    digest = hashlib.sha256(candidates.encode()).hexdigest()[:8]
    meta = "" if packed.scales.dtype == torch.float16 else f"|{packed.scales.dtype}"
    meta += f"|blocks of {packed.block}" if packed.block else ""
    return f"{device_name}|{packed.kind}|{n}x{k}|g{packed.group_size}|{dtype}{meta}|{digest}"


def _read_choices(cache: Path | None) -> dict[str, list[object]]:
    if cache is None or not cache.exists():
        return {}
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}  # a damaged file: time again, write it anew
    return data if isinstance(data, dict) else {}


def _write_choices(cache: Path | None, known: dict[str, list[object]]) -> None:
    if cache is None:
        return
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(known, indent=0, sort_keys=True))
        os.replace(partial, cache)  # atomic: concurrent workers never read half a file
    except OSError:
        pass  # a read-only home: time again next start


def tiles_cache() -> Path:
    """``quant_tiles.json`` beside the CPU kernel library (``$TOKENPIPE_CACHE/kernels``)."""
    from worker.device.cpu_gemv import _cache_dir

    return _cache_dir() / "quant_tiles.json"


def _fastest(run, candidates, timer):  # type: ignore[no-untyped-def]
    best = None
    for config in candidates:
        try:
            seconds = timer(lambda c=config: run(c))
        except Exception:  # noqa: BLE001 - e.g. out of shared memory on this GPU
            continue
        if best is None or seconds < best[0]:
            best = (seconds, config)
    return None if best is None else best[1]
