"""Triton matmuls over 6-bit weights (W6A16) on CUDA: a GGUF's Q6_K tensors at 7 bits a weight.

    packed = SixBitWeight.pack(qw)     # qw: an int6 QuantizedWeight (codes in [-32, 31])
    y = int6_linear(x, packed)         # x [M, K] -> [M, N]

int6 is symmetric (``w = q * scale``, one fp16 scale per group of 16 or a multiple of 16);
its canonical codes are int8 bytes (``worker.layers.quant``), which the CPU kernels take as
int8. On the GPU they are packed **row-major in two planes**, per tile of 128 inputs of a row:

    low   int32 [N, T * 16]: word m (0-15) of tile t holds the low 4 bits of u = q + 32 at
          inputs 128 t + 16 i + m in its nibble i (bits 4i..4i+3)
    high  int32 [N, T * 8]:  word m' (0-7) holds the top 2 bits of u at inputs
          128 t + 16 i + 2 m' + h in its bits 2 (i + 8 h)..+1 (i 0-7, h 0-1)

(T = K / 128 rounded up; padding inputs have u = 32, weight 0). So a kernel loads a tile's 16
low words and 8 high words of each row and builds slice i (16 inputs, one group of 16 or half
of a 32) with shifts and masks, a ``tl.join`` putting the high plane's two halves side by
side; the slice's x are 16 consecutive values and its scale one per row. 6 bits + 16 / 16 =
7 bits a weight at group 16 (Q6_K itself: 6.56), against 9 as int8 g16: the 56 Q6_K tensors of
a Gemma 4 31B Q4_K_M file go from 6.11 to 4.75 GB, what lets that file run on a 24 GB card
with two 8k sessions (BENCHMARKS.md, session 37).

Three paths by the rows M of x, as the int4 / int8 kernels (``quant_matmul``): a GEMV on CUDA
cores (fp32 sums, K split over programs for matrices of few rows) at M == 1, a GEMM on the
tensor cores (``tl.dot`` of a slice at a time) up to GEMM_MAX_ROWS, and a dequantized scratch
of at most ``quant_matmul.SCRATCH_BYTES`` with cuBLAS for prefill chunks. Import after
``worker.device.kernels.triton_available()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker.layers.quant import INT6, QuantizedWeight

TILE = 128  # inputs a tile: 8 slices of 16
GEMM_MAX_ROWS = 64
PACK_ELEMENTS = 1 << 24  # codes packed a chunk (bounds the int32 temporaries to ~64 MB)
# (rows a GEMV program, warps): timed on an H200, BENCHMARKS.md session 37
GEMV_BLOCK_N, GEMV_WARPS = 32, 4
GEMV_PROGRAMS = 528  # about four a streaming multiprocessor of an H200: the K split's target


@dataclass
class SixBitWeight:
    """A 6-bit [N, K] weight in the GPU's two-plane layout (module docstring)."""

    shape: tuple[int, int]
    group_size: int
    low: torch.Tensor  # int32 [N, T * 16]
    high: torch.Tensor  # int32 [N, T * 8]
    scales: torch.Tensor  # fp16 [N, T * 128 / g] (zero past K)
    kind: str = INT6

    @property
    def tiles(self) -> int:
        return self.low.shape[1] // 16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.low, self.high, self.scales))

    @staticmethod
    def supports(qw: QuantizedWeight) -> bool:
        return qw.kind == INT6 and qw.group_size % 16 == 0

    @staticmethod
    def pack(qw: QuantizedWeight) -> SixBitWeight:
        if not SixBitWeight.supports(qw):
            raise ValueError(f"6-bit packing needs int6 groups of a multiple of 16, got "
                             f"{qw.format.describe()}")  # fmt: skip
        n, k = qw.shape
        tiles = triton.cdiv(k, TILE)
        device = qw.qdata.device
        low = torch.empty((n, tiles * 16), dtype=torch.int32, device=device)
        high = torch.empty((n, tiles * 8), dtype=torch.int32, device=device)
        step = max(1, PACK_ELEMENTS // (tiles * TILE))
        for start in range(0, n, step):
            stop = min(n, start + step)
            u = torch.full((stop - start, tiles * TILE), 32, dtype=torch.int32, device=device)
            u[:, :k] = qw.qdata[start:stop].to(torch.int32) + 32
            u = u.view(-1, tiles, 8, 16)  # [rows, t, i, m]
            word = torch.zeros((stop - start, tiles, 16), dtype=torch.int32, device=device)
            for i in range(8):
                word |= (u[:, :, i] & 15) << (4 * i)
            low[start:stop] = word.view(stop - start, -1)
            top = (u >> 4).view(-1, tiles, 8, 8, 2)  # [rows, t, i, m', h]
            word = torch.zeros((stop - start, tiles, 8), dtype=torch.int32, device=device)
            for i in range(8):
                for h in range(2):
                    word |= top[:, :, i, :, h] << (2 * (i + 8 * h))
            high[start:stop] = word.view(stop - start, -1)
        scales = torch.zeros((n, tiles * TILE // qw.group_size), dtype=torch.float16,
                             device=device)  # fmt: skip
        scales[:, : qw.scales.shape[1]] = qw.scales
        return SixBitWeight(qw.shape, qw.group_size, low, high, scales)

    def codes(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The codes q in [-32, 31] of ``rows`` (default all) -> int32 [R, K] (torch ops: the
        layout's reference, and an embedding lookup's few rows)."""
        pick = slice(None) if rows is None else rows
        low, high = self.low[pick], self.high[pick]
        count, tiles = low.shape[0], self.tiles
        low = low.view(count, tiles, 1, 16)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=low.device).view(1, 1, 8, 1)
        lo = (low >> shifts) & 15  # [R, t, i, m]
        high = high.view(count, tiles, 1, 8, 1)
        slots = torch.arange(8, dtype=torch.int32, device=low.device).view(1, 1, 8, 1, 1)
        halves = torch.tensor([0, 16], dtype=torch.int32, device=low.device).view(1, 1, 1, 1, 2)
        hi = ((high >> (2 * slots + halves)) & 3).view(count, tiles, 8, 16)
        u = (lo | (hi << 4)) - 32
        return u.view(count, tiles * TILE)[:, : self.shape[1]]

    def dequantize(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """float32 [R, K] of ``rows`` (default all): ``q * scale`` as the reference."""
        pick = slice(None) if rows is None else rows
        k = self.shape[1]
        scales = self.scales[pick].float().repeat_interleave(self.group_size, dim=1)[:, :k]
        return self.codes(rows).float() * scales

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] of the dequantized weight -> [T, K] (an embedding lookup from a
        table shared with the LM head)."""
        return self.dequantize(ids).to(dtype)


@triton.jit
def _slice_codes(low, high, i: tl.constexpr, BLOCK_N: tl.constexpr):
    """Slice i of a tile: [BLOCK_N, 16] int32 codes q = u - 32 from a row's 16 low and 8 high
    words."""
    lo = (low >> (4 * i)) & 15
    hi = tl.reshape(tl.join((high >> (2 * i)) & 3, (high >> (2 * i + 16)) & 3), [BLOCK_N, 16])
    return (lo | (hi << 4)) - 32


@triton.jit
def _int6_gemv_kernel(
    x_ptr, low_ptr, high_ptr, s_ptr, part_ptr, N, K, TILES, PER_SPLIT, GROUPS,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """partial[split, n] = sum over this split's tiles of x . W[n] (fp32)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    rows64 = rows.to(tl.int64)
    m16 = tl.arange(0, 16)
    m8 = tl.arange(0, 8)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = split * PER_SPLIT
    last = tl.minimum(first + PER_SPLIT, TILES)
    for t in range(first, last):
        low = tl.load(low_ptr + rows64[:, None] * (TILES * 16) + t * 16 + m16[None, :],
                      mask=live[:, None], other=0)  # fmt: skip
        high = tl.load(high_ptr + rows64[:, None] * (TILES * 8) + t * 8 + m8[None, :],
                       mask=live[:, None], other=0)  # fmt: skip
        for i in tl.static_range(8):
            k = t * 128 + 16 * i + m16
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            q = _slice_codes(low, high, i, BLOCK_N).to(tl.float32)
            scale = tl.load(s_ptr + rows64 * GROUPS + (t * 128 + 16 * i) // GROUP, mask=live,
                            other=0.0).to(tl.float32)  # fmt: skip
            acc += tl.sum(q * x[None, :], axis=1) * scale
    tl.store(part_ptr + split * N + rows, acc, mask=live)


@triton.jit
def _int6_gemm_kernel(
    x_ptr, low_ptr, high_ptr, s_ptr, part_ptr, M, N, K, TILES, PER_SPLIT, GROUPS, stride_x,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """partial[split, m, n] = this split's tiles of x[m] . W[n]: each slice's weights
    dequantized in registers to x's dtype, then ``tl.dot`` (fp32 accumulators)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    rows64 = rows.to(tl.int64)
    xrows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    xlive = xrows < M
    m16 = tl.arange(0, 16)
    m8 = tl.arange(0, 8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = split * PER_SPLIT
    last = tl.minimum(first + PER_SPLIT, TILES)
    for t in range(first, last):
        low = tl.load(low_ptr + rows64[:, None] * (TILES * 16) + t * 16 + m16[None, :],
                      mask=live[:, None], other=0)  # fmt: skip
        high = tl.load(high_ptr + rows64[:, None] * (TILES * 8) + t * 8 + m8[None, :],
                       mask=live[:, None], other=0)  # fmt: skip
        for i in tl.static_range(8):
            k = t * 128 + 16 * i + m16
            x = tl.load(x_ptr + xrows[:, None].to(tl.int64) * stride_x + k[None, :],
                        mask=xlive[:, None] & (k[None, :] < K), other=0.0)  # fmt: skip
            scale = tl.load(s_ptr + rows64 * GROUPS + (t * 128 + 16 * i) // GROUP, mask=live,
                            other=0.0).to(tl.float32)  # fmt: skip
            w = (_slice_codes(low, high, i, BLOCK_N).to(tl.float32) * scale[:, None]).to(x.dtype)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
    out = part_ptr + split * M * N + xrows[:, None].to(tl.int64) * N + rows[None, :]
    tl.store(out, acc, mask=xlive[:, None] & live[None, :])


@triton.jit
def _int6_dequant_kernel(
    low_ptr, high_ptr, s_ptr, out_ptr, N, K, TILES, GROUPS, first_row,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[n - first_row, k] = W[n, k] in out's dtype for one tile of rows and inputs."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = first_row + local
    live = rows < N
    rows64 = rows.to(tl.int64)
    m16 = tl.arange(0, 16)
    m8 = tl.arange(0, 8)
    low = tl.load(low_ptr + rows64[:, None] * (TILES * 16) + t * 16 + m16[None, :],
                  mask=live[:, None], other=0)  # fmt: skip
    high = tl.load(high_ptr + rows64[:, None] * (TILES * 8) + t * 8 + m8[None, :],
                   mask=live[:, None], other=0)  # fmt: skip
    for i in tl.static_range(8):
        k = t * 128 + 16 * i + m16
        scale = tl.load(s_ptr + rows64 * GROUPS + (t * 128 + 16 * i) // GROUP, mask=live,
                        other=0.0).to(tl.float32)  # fmt: skip
        w = _slice_codes(low, high, i, BLOCK_N).to(tl.float32) * scale[:, None]
        out = out_ptr + local[:, None].to(tl.int64) * K + k[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=live[:, None] & (k[None, :] < K))


def _splits(blocks: int, tiles: int) -> int:
    """K splits (whole tiles each) bringing ``blocks`` row blocks to about GEMV_PROGRAMS."""
    return max(1, min(tiles, GEMV_PROGRAMS // blocks))


def _check(x: torch.Tensor, packed: SixBitWeight) -> None:
    if x.dim() != 2 or x.shape[1] != packed.shape[1] or x.stride(1) != 1:
        raise ValueError(f"6-bit matmul: x {tuple(x.shape)} against {list(packed.shape)}")


def _summed(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[split, M, N] fp32 partials -> [M, N] in ``dtype``, added in split order."""
    return (part[0] if part.shape[0] == 1 else part.sum(0)).to(dtype)


def int6_gemv(x: torch.Tensor, packed: SixBitWeight, split: int | None = None) -> torch.Tensor:
    """x [1, K] @ W^T -> [1, N] in x's dtype."""
    _check(x, packed)
    n, k = packed.shape
    blocks = triton.cdiv(n, GEMV_BLOCK_N)
    split = split or _splits(blocks, packed.tiles)
    per_split = triton.cdiv(packed.tiles, split)
    split = triton.cdiv(packed.tiles, per_split)
    part = torch.empty((split, 1, n), device=x.device, dtype=torch.float32)
    _int6_gemv_kernel[(blocks, split)](
        x, packed.low, packed.high, packed.scales, part, n, k, packed.tiles, per_split,
        packed.scales.shape[1], GROUP=packed.group_size, BLOCK_N=GEMV_BLOCK_N,
        num_warps=GEMV_WARPS,
    )  # fmt: skip
    return _summed(part, x.dtype)


def int6_gemm(x: torch.Tensor, packed: SixBitWeight, split: int | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, M of any size (``int6_linear`` sends it up to
    GEMM_MAX_ROWS)."""
    _check(x, packed)
    m = x.shape[0]
    n, k = packed.shape
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    blocks = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = split or _splits(blocks, packed.tiles)
    per_split = triton.cdiv(packed.tiles, split)
    split = triton.cdiv(packed.tiles, per_split)
    part = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _int6_gemm_kernel[grid](
        x, packed.low, packed.high, packed.scales, part, m, n, k, packed.tiles, per_split,
        packed.scales.shape[1], x.stride(0), GROUP=packed.group_size, BLOCK_M=block_m,
        BLOCK_N=block_n, IEEE=x.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return _summed(part, x.dtype)


def dequantize_rows(
    packed: SixBitWeight, dtype: torch.dtype, start: int = 0, end: int | None = None
) -> torch.Tensor:
    """Rows start..end of the weight, dequantized: [end - start, K] in ``dtype``."""
    n, k = packed.shape
    end = n if end is None else end
    out = torch.empty((end - start, k), device=packed.low.device, dtype=dtype)
    block_n = 32
    grid = (triton.cdiv(end - start, block_n), packed.tiles)
    _int6_dequant_kernel[grid](
        packed.low, packed.high, packed.scales, out, end, k, packed.tiles,
        packed.scales.shape[1], start, GROUP=packed.group_size, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out


def _dequantized_linear(flat: torch.Tensor, packed: SixBitWeight) -> torch.Tensor:
    """x [M, K] @ W^T through a scratch of at most ``quant_matmul.SCRATCH_BYTES``."""
    from worker.device.kernels.quant_matmul import SCRATCH_BYTES

    n, k = packed.shape
    width = max(256, SCRATCH_BYTES // (k * flat.element_size()) // 256 * 256)
    if width >= n:
        return F.linear(flat, dequantize_rows(packed, flat.dtype))
    y = flat.new_empty((flat.shape[0], n))
    for start in range(0, n, width):
        end = min(n, start + width)
        torch.mm(flat, dequantize_rows(packed, flat.dtype, start, end).t(), out=y[:, start:end])
    return y


def int6_linear(
    x: torch.Tensor, packed: SixBitWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for x [..., K], by the path that suits M."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if m == 0:
        y = flat.new_empty((0, packed.shape[0]))
    elif m == 1:
        y = int6_gemv(flat, packed)
    elif m <= GEMM_MAX_ROWS:
        y = int6_gemm(flat, packed)
    else:
        y = _dequantized_linear(flat, packed)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, packed.shape[0])
