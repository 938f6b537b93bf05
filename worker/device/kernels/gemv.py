"""Triton GEMV for decode-sized matmuls on CUDA: y = x @ W^T for a few rows of x.

At batch 1 a decode step is one pass over the weights, so its speed is the bandwidth these
matmuls reach. Each program owns BLOCK_N output features and streams their rows of W (row
major [N, K], contiguous along K; K is a compile-time constant, one compile per matrix
width) in BLOCK_K chunks, with every row of x (at most MAX_ROWS)
held against each chunk: W is read once whatever the number of rows. Accumulation is fp32.

This module imports Triton: import it only after `worker.device.kernels.triton_available()`.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker.device.kernels.rmsnorm import gated_activation

MAX_ROWS = 4


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, N, stride_xm, stride_wn, stride_ym,
    K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        w = w.to(tl.float32)
        x0 = tl.load(x_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
        acc0 += w * x0[None, :]
        if ROWS > 1:
            x1 = tl.load(x_ptr + stride_xm + ks, mask=mask_k, other=0.0).to(tl.float32)
            acc1 += w * x1[None, :]
        if ROWS > 2:
            x2 = tl.load(x_ptr + 2 * stride_xm + ks, mask=mask_k, other=0.0).to(tl.float32)
            acc2 += w * x2[None, :]
        if ROWS > 3:
            x3 = tl.load(x_ptr + 3 * stride_xm + ks, mask=mask_k, other=0.0).to(tl.float32)
            acc3 += w * x3[None, :]
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, tl.sum(acc0, axis=1).to(out_ty), mask=mask_n)
    if ROWS > 1:
        tl.store(y_ptr + stride_ym + offs_n, tl.sum(acc1, axis=1).to(out_ty), mask=mask_n)
    if ROWS > 2:
        tl.store(y_ptr + 2 * stride_ym + offs_n, tl.sum(acc2, axis=1).to(out_ty), mask=mask_n)
    if ROWS > 3:
        tl.store(y_ptr + 3 * stride_ym + offs_n, tl.sum(acc3, axis=1).to(out_ty), mask=mask_n)


@triton.jit
def _gated_gemv_kernel(
    g_ptr, u_ptr, w_ptr, y_ptr, N, stride_wn,
    K: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[n] = sum_k W[n, k] * h[k] for one row, h = act(g) * u rounded to y's dtype by
    ``rmsnorm.gated_activation``, as ``rmsnorm._gated_act_kernel`` rounds it."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dt = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        g = tl.load(g_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
        h = gated_activation(g, u, ACT, dt).to(tl.float32)
        acc += w.to(tl.float32) * h[None, :]
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(dt), mask=mask_n)


# (BLOCK_N, BLOCK_K, num_warps, num_stages); see tools/bench_gpu_kernels.py --gemv
DEFAULT_CONFIG = (16, 256, 4, 4)


def gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, contiguous last dim) @ weight[N, K]^T -> [M, N] in x's dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows > MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"unsupported gemv: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    y = torch.empty((rows, n), device=x.device, dtype=x.dtype)
    block_n, block_k, num_warps, num_stages = config or DEFAULT_CONFIG
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, n, x.stride(0), weight.stride(0), y.stride(0),
        K=k, ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


def gated_gemv_triton(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, act: int,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """down(act(gate) * up) of one row in one launch: gate, up [1, K] (contiguous last dim;
    halves of one gate_up row, say) @ weight[N, K]^T -> [1, N] in gate's dtype, equal to
    ``rmsnorm.gated_act_triton`` then ``gemv_triton`` (``act``: its GATED_ACTIVATIONS code)."""
    k = gate.shape[1]
    n = weight.shape[0]
    if (
        gate.shape[0] != 1
        or up.shape != gate.shape
        or weight.shape[1] != k
        or weight.stride(1) != 1
    ):
        raise ValueError(f"unsupported gated gemv: gate {tuple(gate.shape)}, weight "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("gated gemv: gate and up need a contiguous last dimension")
    y = torch.empty((1, n), device=gate.device, dtype=gate.dtype)
    block_n, block_k, num_warps, num_stages = config or DEFAULT_CONFIG
    _gated_gemv_kernel[(triton.cdiv(n, block_n),)](
        gate, up, weight, y, n, weight.stride(0), K=k, ACT=act, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


# -- choosing per matrix ----------------------------------------------------------------------

# a few configs that were fastest on some 31B matrix on an H200 (tools/bench_gpu_kernels.py)
CANDIDATES = [(16, 256, 4, 4), (8, 512, 4, 4), (8, 256, 4, 6), (16, 512, 8, 3)]
# matrices of few outputs (N < FEW_OUTPUTS) also try narrower row blocks: at 16 rows a block,
# qwen3_5_moe's [2048, 4096] out_proj / o_proj (40 a step) and [2048, 512] shared down are 128
# programs on 132 SMs, each streaming its rows' whole K alone
FEW_OUTPUTS = 4096
FEW_OUTPUT_CANDIDATES = [(4, 512, 4, 4), (4, 1024, 4, 3), (2, 1024, 2, 3)]


def candidates_for(
    weight: torch.Tensor, candidates: list[tuple[int, int, int, int]] | None = None
) -> list[tuple[int, int, int, int]]:
    """The configs timed for ``weight`` [N, K]: ``candidates`` when given, else CANDIDATES (and
    FEW_OUTPUT_CANDIDATES when N < FEW_OUTPUTS)."""
    if candidates is not None:
        return candidates
    return CANDIDATES + (FEW_OUTPUT_CANDIDATES if weight.shape[0] < FEW_OUTPUTS else [])


def graph_seconds(fn: Any, calls: int = 8, reps: int = 5) -> float:
    """Seconds per call of `fn` replayed from a CUDA graph (the way decode runs it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (calls * reps)


def choose_config(
    weight: torch.Tensor, candidates: list[tuple[int, int, int, int]] | None = None,
    margin: float = 0.02,
) -> tuple[int, int, int, int] | None:  # fmt: skip
    """The candidate that beats `F.linear` on one row by more than `margin` on this GPU and
    matrix, timed inside CUDA graphs; None when cuBLAS is as fast (CUDA only)."""
    x = torch.randn(1, weight.shape[1], device=weight.device, dtype=weight.dtype)
    with torch.inference_mode():
        base = graph_seconds(lambda: F.linear(x, weight))
        best: tuple[float, tuple[int, int, int, int]] | None = None
        for config in candidates_for(weight, candidates):
            try:
                seconds = graph_seconds(lambda c=config: gemv_triton(x, weight, c))
            except Exception:  # noqa: BLE001 - a config this GPU cannot run
                continue
            if seconds < base * (1 - margin) and (best is None or seconds < best[0]):
                best = (seconds, config)
    return None if best is None else best[1]


def launch_candidates(
    weights: list[torch.Tensor], candidates: list[tuple[int, int, int, int]] | None = None
) -> None:
    """Every candidate once on a row of zeros per matrix: the kernel variants `choose_config`
    times (worker/device/compile_ahead.py records them to compile ahead)."""
    for weight in weights:
        x = torch.zeros(1, weight.shape[1], device=weight.device, dtype=weight.dtype)
        for config in candidates_for(weight, candidates):
            gemv_triton(x, weight, config)


def linear_for_decode(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None
) -> torch.Tensor:
    """`F.linear(x, weight)`, through the GEMV kernel for a single contiguous row when a
    config was chosen for this matrix."""
    if config is not None and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1:
        return gemv_triton(x, weight, config)
    return F.linear(x, weight)


def gemv_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """One weight per (out, in) shape among the matrices `install_decode_gemv` considers."""
    shapes: dict[tuple[int, int], torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.bias is None:
            shapes.setdefault((module.weight.shape[0], module.weight.shape[1]), module.weight)
    return list(shapes.values())


def install_decode_gemv(
    model: torch.nn.Module, choose: Any = choose_config
) -> dict[tuple[int, int], tuple[int, int, int, int] | None]:
    """Route every bias-free `nn.Linear` of `model` whose matrix the GEMV kernel serves
    faster (per `choose`, once per shape) through it for one-row inputs (batch-1 decode
    and one-token prefills). Returns the choice per (out, in) shape."""
    chosen: dict[tuple[int, int], tuple[int, int, int, int] | None] = {}
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.bias is not None:
            continue
        shape = (module.weight.shape[0], module.weight.shape[1])
        if shape not in chosen:
            chosen[shape] = choose(module.weight)
        config = chosen[shape]
        if config is not None:
            module.forward = functools.partial(  # type: ignore[method-assign]
                linear_for_decode, weight=module.weight, config=config
            )
            module.decode_gemv_config = config  # a gated MLP's down: gated_gemv_triton
    return chosen
