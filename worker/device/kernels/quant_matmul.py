"""Triton matmuls over weight-only quantized weights (W4A16 / W8A16) on CUDA.

    y = quant_linear(x, qw)      # x [M, K] bf16/fp16/fp32, qw a QuantizedWeight [N, K]

The weights stay in the canonical layout of ``worker.layers.quant`` (int4: uint8 [N, K / 2],
low nibble the even k; int8: int8 [N, K]; fp16 scale (and int4 offset) per group of ``g``
along K), so the CPU reference, the GGUF repacking and these kernels read the same bytes.
Three paths, by the number of rows M:

- **GEMV, M <= 4** (batch-1..4 decode): each program owns BLOCK_N output rows and walks K a
  few groups at a time, loading a [BLOCK_N, GROUPS, bytes-per-group] block of codes (16-byte
  loads), and per group sums ``code * x`` and ``x``: the group's scale multiplies the first
  sum and its offset the second, so the per-weight work is unpack + convert + FMA.
- **GEMM, 4 < M <= GEMM_MAX_ROWS** (decode batches): tiles of x against tiles of the codes
  dequantized in registers to x's dtype, ``tl.dot`` on the tensor cores.
- **Longer inputs** (prefill chunks): the weight dequantized into a scratch of x's dtype by
  one kernel, then cuBLAS; the dequantization costs ~2.5 bytes per weight per chunk, small
  against a chunk's matmul.

Accumulation is fp32; each weight is ``code * scale (+ offset)`` in fp32 as in the reference
(``worker.layers.quant.dequantize``). This module imports Triton: import it only after
``worker.device.kernels.triton_available()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker.layers.quant import INT4, QuantizedWeight

GEMV_MAX_ROWS = 4
GEMM_MAX_ROWS = 64
# (BLOCK_N, GROUPS per step, num_warps): a start; tools/bench_quant_kernels.py sweeps them
GEMV_CONFIG = (16, 8, 4)
GEMM_CONFIG = (64, 128, 4)  # (BLOCK_N, BLOCK_K, num_warps); BLOCK_M from M


@triton.jit
def _group_dot(
    x_row, codes, mask_g, gs, offs_b,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr,
):  # fmt: skip
    """One row of x against a block of codes [BN, GPB, B] -> (sum code * x, sum x) per group
    ([BN, GPB] and [GPB]), fp32."""
    if INT4_KIND:
        k_even = gs[:, None] * GROUP + 2 * offs_b[None, :]  # [GPB, B]
        xe = tl.load(x_row + k_even, mask=mask_g[:, None], other=0.0).to(tl.float32)
        xo = tl.load(x_row + k_even + 1, mask=mask_g[:, None], other=0.0).to(tl.float32)
        lo = (codes & 15).to(tl.float32)
        hi = (codes >> 4).to(tl.float32)
        dot = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)
        xsum = tl.sum(xe + xo, axis=1)
    else:
        ks = gs[:, None] * GROUP + offs_b[None, :]
        xk = tl.load(x_row + ks, mask=mask_g[:, None], other=0.0).to(tl.float32)
        dot = tl.sum(codes.to(tl.float32) * xk[None, :, :], axis=2)
        xsum = tl.sum(xk, axis=1)
    return dot, xsum


@triton.jit
def _qgemv_kernel(
    x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, N, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, GPB: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    n64 = offs_n.to(tl.int64)
    BYTES: tl.constexpr = GROUP // 2 if INT4_KIND else GROUP
    groups = K // GROUP
    row_bytes = groups * BYTES
    offs_g = tl.arange(0, GPB)
    offs_b = tl.arange(0, BYTES)
    acc0 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
    for g0 in range(0, groups, GPB):
        gs = g0 + offs_g
        mask_g = gs < groups
        mask_ng = mask_n[:, None] & mask_g[None, :]
        code_ptrs = (
            q_ptr + n64[:, None, None] * row_bytes + gs[None, :, None] * BYTES
            + offs_b[None, None, :]
        )  # fmt: skip
        codes = tl.load(code_ptrs, mask=mask_ng[:, :, None], other=0)
        meta = n64[:, None] * groups + gs[None, :]
        scale = tl.load(s_ptr + meta, mask=mask_ng, other=0.0).to(tl.float32)
        offset = tl.zeros([BLOCK_N, GPB], dtype=tl.float32)
        if INT4_KIND:
            offset = tl.load(o_ptr + meta, mask=mask_ng, other=0.0).to(tl.float32)
        dot, xsum = _group_dot(x_ptr, codes, mask_g, gs, offs_b, GROUP, INT4_KIND)
        acc0 += dot * scale + offset * xsum[None, :]
        if ROWS > 1:
            dot, xsum = _group_dot(x_ptr + stride_xm, codes, mask_g, gs, offs_b, GROUP, INT4_KIND)
            acc1 += dot * scale + offset * xsum[None, :]
        if ROWS > 2:
            dot, xsum = _group_dot(
                x_ptr + 2 * stride_xm, codes, mask_g, gs, offs_b, GROUP, INT4_KIND
            )
            acc2 += dot * scale + offset * xsum[None, :]
        if ROWS > 3:
            dot, xsum = _group_dot(
                x_ptr + 3 * stride_xm, codes, mask_g, gs, offs_b, GROUP, INT4_KIND
            )
            acc3 += dot * scale + offset * xsum[None, :]
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, tl.sum(acc0, axis=1).to(out_ty), mask=mask_n)
    if ROWS > 1:
        tl.store(y_ptr + stride_ym + offs_n, tl.sum(acc1, axis=1).to(out_ty), mask=mask_n)
    if ROWS > 2:
        tl.store(y_ptr + 2 * stride_ym + offs_n, tl.sum(acc2, axis=1).to(out_ty), mask=mask_n)
    if ROWS > 3:
        tl.store(y_ptr + 3 * stride_ym + offs_n, tl.sum(acc3, axis=1).to(out_ty), mask=mask_n)


@triton.jit
def _dequant_tile(
    q_ptr, s_ptr, o_ptr, offs_n, mask_n, k0, K,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Weights [BLOCK_N, BLOCK_K] (k from k0) dequantized to fp32; zero past K."""
    n64 = offs_n.to(tl.int64)
    groups = K // GROUP
    GPB: tl.constexpr = BLOCK_K // GROUP
    gs = k0 // GROUP + tl.arange(0, GPB)
    mask_ng = mask_n[:, None] & (gs < groups)[None, :]
    meta = n64[:, None] * groups + gs[None, :]
    scale = tl.load(s_ptr + meta, mask=mask_ng, other=0.0).to(tl.float32)
    if INT4_KIND:
        offs_h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = mask_n[:, None] & (offs_h < K // 2)[None, :]
        codes = tl.load(q_ptr + n64[:, None] * (K // 2) + offs_h[None, :], mask=mask, other=0)
        w = tl.reshape(tl.join(codes & 15, codes >> 4), [BLOCK_N, BLOCK_K]).to(tl.float32)
        offset = tl.load(o_ptr + meta, mask=mask_ng, other=0.0).to(tl.float32)
        w3 = tl.reshape(w, [BLOCK_N, GPB, GROUP])
        w3 = w3 * scale[:, :, None] + offset[:, :, None]
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (offs_k < K)[None, :]
        codes = tl.load(q_ptr + n64[:, None] * K + offs_k[None, :], mask=mask, other=0)
        w3 = tl.reshape(codes.to(tl.float32), [BLOCK_N, GPB, GROUP]) * scale[:, :, None]
    return tl.reshape(w3, [BLOCK_N, BLOCK_K])


@triton.jit
def _qgemm_kernel(
    x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0,
        )  # fmt: skip
        w = _dequant_tile(q_ptr, s_ptr, o_ptr, offs_n, mask_n, k0, K, GROUP, INT4_KIND,
                          BLOCK_N, BLOCK_K)  # fmt: skip
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    out_ty = y_ptr.dtype.element_ty
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(out_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dequant_kernel(
    q_ptr, s_ptr, o_ptr, w_ptr, N, K,
    GROUP: tl.constexpr, INT4_KIND: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k0 = pid_k * BLOCK_K
    w = _dequant_tile(q_ptr, s_ptr, o_ptr, offs_n, mask_n, k0, K, GROUP, INT4_KIND,
                      BLOCK_N, BLOCK_K)  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    tl.store(ptrs, w.to(w_ptr.dtype.element_ty), mask=mask_n[:, None] & (offs_k < K)[None, :])


def _check(x: torch.Tensor, qw: QuantizedWeight) -> None:
    if x.dim() != 2 or x.shape[1] != qw.shape[1] or x.stride(1) != 1:
        raise ValueError(f"quantized matmul: x {tuple(x.shape)} against {list(qw.shape)}")


def _offsets(qw: QuantizedWeight) -> torch.Tensor:
    return qw.offsets if qw.offsets is not None else qw.scales  # int8: never read


def qgemv(
    x: torch.Tensor, qw: QuantizedWeight, config: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) @ dequantize(qw)^T -> [M, N] in x's dtype."""
    _check(x, qw)
    rows = x.shape[0]
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"qgemv serves at most {GEMV_MAX_ROWS} rows, got {rows}")
    n, k = qw.shape
    block_n, gpb, num_warps = config or GEMV_CONFIG
    y = torch.empty((rows, n), device=x.device, dtype=x.dtype)
    _qgemv_kernel[(triton.cdiv(n, block_n),)](
        x, qw.qdata, qw.scales, _offsets(qw), y, n, k, x.stride(0), y.stride(0),
        GROUP=qw.group_size, INT4_KIND=qw.kind == INT4, ROWS=rows, BLOCK_N=block_n, GPB=gpb,
        num_warps=num_warps,
    )  # fmt: skip
    return y


def _block_k(qw: QuantizedWeight, wanted: int) -> int:
    """A K tile: a multiple of the group (at least one group), at least 16 for tl.dot."""
    group = qw.group_size
    return max(group, 16) if wanted <= group else wanted - wanted % group


def qgemm(
    x: torch.Tensor, qw: QuantizedWeight, config: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """x [M, K] @ dequantize(qw)^T -> [M, N], dequantizing tiles in registers (tl.dot)."""
    _check(x, qw)
    m = x.shape[0]
    n, k = qw.shape
    block_n, block_k, num_warps = config or GEMM_CONFIG
    block_k = _block_k(qw, block_k)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _qgemm_kernel[grid](
        x, qw.qdata, qw.scales, _offsets(qw), y, m, n, k, x.stride(0), y.stride(0),
        GROUP=qw.group_size, INT4_KIND=qw.kind == INT4,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )  # fmt: skip
    return y


def dequantize_triton(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight [N, K] in ``dtype`` (one kernel; the prefill path's scratch)."""
    n, k = qw.shape
    out = torch.empty((n, k), device=qw.qdata.device, dtype=dtype)
    block_n, block_k = 32, _block_k(qw, 128)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_kernel[grid](
        qw.qdata, qw.scales, _offsets(qw), out, n, k,
        GROUP=qw.group_size, INT4_KIND=qw.kind == INT4, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )  # fmt: skip
    return out


def quant_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, dequantize(qw), bias)`` for x [..., K], by the path that suits M."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if m == 0:
        y = flat.new_empty((0, qw.shape[0]))
    elif m <= GEMV_MAX_ROWS:
        y = qgemv(flat, qw)
    elif m <= GEMM_MAX_ROWS:
        y = qgemm(flat, qw)
    else:
        y = F.linear(flat, dequantize_triton(qw, flat.dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, qw.shape[0])
