"""Decode-sized fp32 matmuls on the CPU: weights in a streaming layout, a small AVX2 kernel.

A decode step multiplies a handful of rows (one per decoding session) by every weight matrix
once, so it is bound by how fast the weights stream from memory. MKL's GEMV/small-M GEMM on a
row-major [N, K] matrix runs well below the copy bandwidth on one core (the 262k x 640 LM head
of Gemma 3 270M: ~80 ms for one row, ~105 ms for four, where 40-50 ms is possible), so
``prepare_for_cpu`` (see ``CausalLM.prepare_for_cpu``) stores each weight as

    packed [N / 4, K / 8, 4, 8]:  packed[n // 4, k // 8, n % 4, k % 8] == weight[n, k]

(four rows interleaved in 8-float groups: one sequential stream per 4 rows) and the kernel
below reads four far-apart 4-row blocks at a time (more streams in flight), each weight
element once per call, whatever the number of rows (up to ``MAX_ROWS``). Sums are fp32 FMAs
in a different order than MKL's: results agree to fp32 rounding, not bit for bit.

The kernel is C compiled once with the system compiler (``cc -O3 -mavx2 -mfma``) into
``$TOKENPIPE_CACHE/kernels`` (default ``~/.cache/tokenpipe/kernels``) and loaded with ctypes;
it is single-threaded. ``kernel()`` is None (and the model keeps its plain weights) without
an x86-64 CPU with AVX2 and FMA, without a compiler, or with ``TOKENPIPE_CPU_GEMV=0``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROW_BLOCK = 4  # weight rows interleaved together
K_GROUP = 8  # floats per AVX2 vector
MAX_ROWS = 16  # input rows up to which the kernel is used; longer inputs unpack the weight

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* S blocks of 4 weight rows (block s at w + s * stride) times MC input rows */
static inline __attribute__((always_inline)) void blocks(
        const int S, const int MC, const float *x, int64_t K, const float *w, int64_t stride,
        float *out, int64_t out_stride, int64_t ldo) {
    __m256 acc[4][4][2];
    for (int s = 0; s < S; s++)
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MC; m++) acc[s][r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv[2];
        for (int m = 0; m < MC; m++) xv[m] = _mm256_loadu_ps(x + m * K + k);
        for (int s = 0; s < S; s++) {
            const float *wk = w + s * stride + k * 4;
            for (int r = 0; r < 4; r++) {
                __m256 wv = _mm256_loadu_ps(wk + r * 8);
                for (int m = 0; m < MC; m++)
                    acc[s][r][m] = _mm256_fmadd_ps(wv, xv[m], acc[s][r][m]);
            }
        }
    }
    for (int s = 0; s < S; s++)
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < MC; m++) out[s * out_stride + m * ldo + r] = hsum(acc[s][r][m]);
}

/* all M input rows against S blocks; pairs of rows, then a last odd one */
static inline __attribute__((always_inline)) void all_rows(
        const int S, int64_t M, const float *x, int64_t K, const float *w, int64_t stride,
        float *out, int64_t out_stride, int64_t N) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) blocks(S, 2, x + m * K, K, w, stride, out + m * N, out_stride, N);
    if (m < M) blocks(S, 1, x + m * K, K, w, stride, out + m * N, out_stride, N);
}

/* out[m * N + n] = sum_k x[m * K + k] * weight[n, k], w packed [N/4][K/8][4][8] */
int tp_packed_gemm(int64_t M, const float *x, const float *w, float *out, int64_t K, int64_t N) {
    if (K % 8 || N % 4 || M < 1) return 1;
    const int64_t nblocks = N / 4, block = 4 * K;
    /* S far-apart blocks at a time: S memory streams; 16 accumulators either way */
    const int64_t per = M == 1 ? nblocks / 4 : nblocks / 2;
    for (int64_t b = 0; b < per; b++) {
        if (M == 1) blocks(4, 1, x, K, w + b * block, per * block, out + b * 4, per * 4, N);
        else all_rows(2, M, x, K, w + b * block, per * block, out + b * 4, per * 4, N);
    }
    for (int64_t b = (M == 1 ? 4 : 2) * per; b < nblocks; b++)
        all_rows(1, M, x, K, w + b * block, 0, out + b * 4, 0, N);
    return 0;
}
"""


def _cache_dir() -> Path:
    base = os.environ.get("TOKENPIPE_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "tokenpipe"
    return root / "kernels"


def _cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((ln for ln in flags.splitlines() if ln.startswith("flags")), "")
    return {"avx2", "fma"} <= set(line.split())


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "gemv.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        compiler = os.environ.get("CC", "cc")
        flags = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(source)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: concurrent workers never load a partial file


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot run (see the module docstring)."""
    if os.environ.get("TOKENPIPE_CPU_GEMV", "1") == "0" or not _cpu_supported():
        return None
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    target = _cache_dir() / f"gemv-{digest}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"cpu_gemv: kernel unavailable, plain matmuls ({exc!r})", file=sys.stderr)
        return None
    fn = lib.tp_packed_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_int64, ctypes.c_int64]
    return lib


def can_pack(weight: torch.Tensor) -> bool:
    """A weight the kernel takes: fp32 [N, K] on the CPU with N % 4 == 0 and K % 8 == 0."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape[0] % ROW_BLOCK == 0
        and weight.shape[1] % K_GROUP == 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 4, K / 8, 4, 8] (a copy)."""
    n, k = weight.shape
    return (
        weight.detach().view(n // ROW_BLOCK, ROW_BLOCK, k // K_GROUP, K_GROUP)
        .transpose(1, 2)
        .contiguous()
    )  # fmt: skip


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[N / 4, K / 8, 4, 8] -> [N, K] (a copy)."""
    nb, kg, rb, g = packed.shape
    return packed.transpose(1, 2).reshape(nb * rb, kg * g)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] of a packed weight: ids [T] int64 -> [T, K]."""
    rows = packed[ids // ROW_BLOCK, :, ids % ROW_BLOCK, :]  # [T, K / 8, 8]
    return rows.reshape(ids.shape[0], -1)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ weight.T -> [M, N], weight stored packed. Needs ``kernel()``."""
    lib = kernel()
    assert lib is not None, "packed weights need the CPU kernel"
    nb, kg, rb, g = packed.shape
    n, k = nb * rb, kg * g
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    status = lib.tp_packed_gemm(x.shape[0], x.data_ptr(), packed.data_ptr(), out.data_ptr(), k, n)
    if status != 0:
        raise ValueError(f"tp_packed_gemm failed ({status}) for x {tuple(x.shape)}, [{n}, {k}]")
    return out


class PackedLinear(nn.Module):
    """A bias-optional linear layer whose weight [out, in] is stored packed: the kernel for up
    to ``MAX_ROWS`` rows, the plain layout (unpacked per call) for prefill-sized inputs."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("packed", packed)  # [out / 4, in / 8, 4, 8]
        self.bias = bias

    @staticmethod
    def from_linear(linear: nn.Linear) -> PackedLinear:
        """Packs ``linear.weight`` (a copy: drop the Linear afterwards to free the original)."""
        return PackedLinear(pack(linear.weight), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        if x.shape[0] <= MAX_ROWS:
            out = packed_matmul(x, self.packed)
            return out if self.bias is None else out + self.bias
        return F.linear(x, unpack(self.packed), self.bias)


class PackedEmbedding(nn.Module):
    """An embedding table stored packed (it is the packed LM head too when they are tied)."""

    def __init__(self, packed: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", packed)  # [vocab / 4, hidden / 8, 4, 8]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, hidden]
        return packed_rows(self.packed, ids)
