"""Decode-sized fp32 matmuls on the CPU: weights in a streaming layout, a small AVX2 kernel.

A decode step multiplies a handful of rows (one per decoding session) by every weight matrix
once, so it is bound by how fast the weights stream from memory. MKL's GEMV/small-M GEMM on a
row-major [N, K] matrix runs well below that on one core (the 262k x 640 LM head of Gemma 3
270M: ~80 ms for one row, ~105 ms for four), so ``CausalLM.prepare_for_cpu`` stores each
weight as

    packed [N / 8, K, 8]:  packed[n // 8, k, n % 8] == weight[n, k]

(eight rows interleaved: one AVX2 vector holds column k of eight rows, and a group of eight
rows is one sequential stream). The kernel below keeps up to four input rows in flight against
a few groups at once (outer products: a weight vector times a broadcast x[m, k]), so every
weight element is read from memory once per call and used for all those rows: ~40 ms for one
row and ~50 ms for four on that head (one Zen 3 core). Each output is one fp32 FMA chain over
k in order: it agrees with MKL to fp32 rounding, not bit for bit.

The kernel is C compiled once with the system compiler (``cc -O3 -mavx2 -mfma -fopenmp``) into
``$TOKENPIPE_CACHE/kernels`` (default ``~/.cache/tokenpipe/kernels``) and loaded with ctypes.
With more than one torch thread it splits the weight groups of a matmul between them (one
contiguous share each, so each thread streams its own part of the weight): the OpenMP build
binds to the libgomp.so.1 torch already loaded (same soname), so it runs on torch's own thread
pool, never a second one. Where torch does not use libgomp or the compiler has no OpenMP, the
one-thread build is used instead (and prefill-sized inputs with more torch threads go to MKL:
``PackedLinear``). ``kernel()`` is None (and the model keeps its plain weights) without an
x86-64 CPU with AVX2 and FMA, without a compiler, or with ``TOKENPIPE_CPU_GEMV=0``.
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

ROW_BLOCK = 8  # weight rows interleaved together: one AVX2 vector holds one k of 8 rows

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* G groups of 8 weight rows (group g: w + g * K * 8, [K][8]) times MC <= 4 input rows:
   out[m * ldo + g * 8 + i] = sum_k x[m * K + k] * w[g * K * 8 + k * 8 + i] */
static inline __attribute__((always_inline)) void groups(
        const int G, const int MC, const float *x, int64_t K, const float *w, float *out,
        int64_t ldo) {
    __m256 acc[8][4];
    for (int g = 0; g < G; g++)
        for (int m = 0; m < MC; m++) acc[g][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 wv[8];
        for (int g = 0; g < G; g++) wv[g] = _mm256_loadu_ps(w + g * K * 8 + k * 8);
        for (int m = 0; m < MC; m++) {
            __m256 xb = _mm256_broadcast_ss(x + m * K + k);
            for (int g = 0; g < G; g++) acc[g][m] = _mm256_fmadd_ps(wv[g], xb, acc[g][m]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int m = 0; m < MC; m++) _mm256_storeu_ps(out + m * ldo + g * 8, acc[g][m]);
}

/* 3 groups against input rows [0, M) in chunks of 4: the groups stay in cache between chunks */
static void groups3_all_rows(int64_t M, const float *x, int64_t K, const float *w, float *out,
                             int64_t N) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float *xm = x + m0 * K;
        float *om = out + m0 * N;
        switch (M - m0 < 4 ? M - m0 : 4) {
        case 1: groups(3, 1, xm, K, w, om, N); break;
        case 2: groups(3, 2, xm, K, w, om, N); break;
        case 3: groups(3, 3, xm, K, w, om, N); break;
        default: groups(3, 4, xm, K, w, om, N); break;
        }
    }
}

/* G groups at a time: G * MC accumulators + G weight vectors + 1 broadcast <= 16 registers */
/* G groups at a time over groups [g, gend): G * MC accumulators + G weight vectors + 1 broadcast
   <= 16 registers */
#define SWEEP(G, MC) do { \
        for (; g + G <= gend; g += G) groups(G, MC, x, K, w + g * K * 8, out + g * 8, N); \
    } while (0)

/* out[:, g0 * 8 : gend * 8] of the product: weight groups [g0, gend) */
static void gemm_part(int64_t M, const float *x, const float *w, float *out, int64_t K, int64_t N,
                      int64_t g0, int64_t gend) {
    int64_t g = g0;
    switch (M) {
    case 1: SWEEP(8, 1); break;
    case 2: SWEEP(4, 2); break;
    case 3: SWEEP(3, 3); break;
    case 4: SWEEP(3, 4); break;
    default:
        for (; g + 3 <= gend; g += 3) groups3_all_rows(M, x, K, w + g * K * 8, out + g * 8, N);
    }
    for (; g < gend; g++)
        for (int64_t m = 0; m < M; m++)
            groups(1, 1, x + m * K, K, w + g * K * 8, out + m * N + g * 8, N);
}

#define SPLIT_ALIGN 24    /* thread shares are whole sweeps of 8, 4 and 3 groups */
#define MIN_SPLIT_BYTES (64 * 1024)  /* smaller weights are not worth waking a thread */

/* 1 when built with OpenMP (the groups are split between torch's OpenMP threads) */
int tp_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int tp_packed_gemm(int64_t M, const float *x, const float *w, float *out, int64_t K, int64_t N,
                   int threads) {
    if (N % 8 || M < 1 || threads < 1) return 1;
    const int64_t ngroups = N / 8;
#ifdef _OPENMP
    if (threads > 1 && ngroups >= 2 * SPLIT_ALIGN && N * K * 4 >= MIN_SPLIT_BYTES) {
        /* torch's own OpenMP runtime (the same libgomp.so.1): its pool, not a second one */
        #pragma omp parallel num_threads(threads)
        {
            const int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t share =
                (ngroups + parts - 1) / parts + SPLIT_ALIGN - 1;
            const int64_t per = share / SPLIT_ALIGN * SPLIT_ALIGN;
            const int64_t g0 = t * per, g1 = g0 + per < ngroups ? g0 + per : ngroups;
            if (g0 < g1) gemm_part(M, x, w, out, K, N, g0, g1);
        }
        return 0;
    }
#endif
    gemm_part(M, x, w, out, K, N, 0, ngroups);
    return 0;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * scale (scale may be NULL), rows of dim floats */
void tp_rms_norm(const float *x, const float *scale, float *out, int64_t rows, int64_t dim,
                 float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
        lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
        float sum = _mm_cvtss_f32(lo);
        for (; i < dim; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (i = 0; i < dim; i++) o[i] = scale ? xr[i] * inv * scale[i] : xr[i] * inv;
    }
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


def _torch_uses_libgomp() -> bool:
    """torch's parallel backend is OpenMP and a libgomp.so.1 is loaded: a kernel built with
    -fopenmp then binds to that same runtime (same soname) and shares torch's thread pool."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _compile(target: Path, openmp: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "gemv.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        compiler = os.environ.get("CC", "cc")
        flags = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"] + (["-fopenmp"] if openmp else [])
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(source), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: concurrent workers never load a partial file


def load_library(openmp: bool) -> ctypes.CDLL:
    """The kernel library (compiled on first use), OpenMP build or one-thread build."""
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    target = _cache_dir() / f"gemv-{digest}{'-omp' if openmp else ''}.so"
    if not target.exists():
        _compile(target, openmp)
    lib = ctypes.CDLL(str(target))
    fn = lib.tp_packed_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.tp_threaded.restype = ctypes.c_int
    lib.tp_threaded.argtypes = []
    norm = lib.tp_rms_norm
    norm.restype = None
    norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    norm.argtypes += [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    return lib


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot run (see the module docstring)."""
    if os.environ.get("TOKENPIPE_CPU_GEMV", "1") == "0" or not _cpu_supported():
        return None
    if _torch_uses_libgomp():
        try:
            return load_library(openmp=True)
        except (OSError, subprocess.SubprocessError):
            pass  # a compiler without OpenMP: the one-thread build
    try:
        return load_library(openmp=False)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"cpu_gemv: kernel unavailable, plain matmuls ({exc!r})", file=sys.stderr)
        return None


def threaded() -> bool:
    """Whether the kernel splits a matmul between torch's threads (an OpenMP build)."""
    lib = kernel()
    return lib is not None and bool(lib.tp_threaded())


def can_pack(weight: torch.Tensor) -> bool:
    """A weight the kernel takes: fp32 [N, K] on the CPU with N % 8 == 0."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape[0] % ROW_BLOCK == 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 8, K, 8] (a copy)."""
    n, k = weight.shape
    return weight.detach().view(n // ROW_BLOCK, ROW_BLOCK, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[N / 8, K, 8] -> [N, K] (a copy)."""
    groups, k, rows = packed.shape
    return packed.transpose(1, 2).reshape(groups * rows, k)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] of a packed weight: ids [T] int64 -> [T, K]."""
    return packed[ids // ROW_BLOCK, :, ids % ROW_BLOCK]


def packed_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ weight.T -> [M, N], weight stored packed. Needs ``kernel()``."""
    lib = kernel()
    assert lib is not None, "packed weights need the CPU kernel"
    groups, k, rows = packed.shape
    n = groups * rows
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    threads = torch.get_num_threads()
    status = lib.tp_packed_gemm(
        x.shape[0], x.data_ptr(), packed.data_ptr(), out.data_ptr(), k, n, threads
    )
    if status != 0:
        raise ValueError(f"tp_packed_gemm failed ({status}) for x {tuple(x.shape)}, [{n}, {k}]")
    return out


def rms_norm(x: torch.Tensor, scale: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x², -1) + eps) * scale for fp32 x [..., dim] (scale [dim] or None), in
    one call: torch's rms_norm is ~6 ops (~40 µs) on a decode-sized row. Needs ``kernel()``."""
    lib = kernel()
    assert lib is not None, "rms_norm needs the CPU kernel"
    x = x.contiguous()
    dim = x.shape[-1]
    out = torch.empty_like(x)
    if scale is not None:
        scale = scale.contiguous()
    scale_ptr = None if scale is None else scale.data_ptr()
    lib.tp_rms_norm(x.data_ptr(), scale_ptr, out.data_ptr(), x.numel() // dim, dim, eps)
    return out


PREFILL_ROWS = 64  # with the one-thread build and more torch threads, inputs this long go to MKL


class PackedLinear(nn.Module):
    """A bias-optional linear layer whose weight [out, in] is stored packed. The kernel serves
    prefill-sized inputs too (at 64 and 512 rows it matched or beat MKL on the plain weight,
    with one thread and with two). Only a one-thread build with more torch threads sends inputs
    of ``PREFILL_ROWS`` rows or more to MKL's threaded GEMM, on an unpacked copy of the weight."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("packed", packed)  # [out / 8, in, 8]
        self.bias = bias

    @staticmethod
    def from_linear(linear: nn.Linear) -> PackedLinear:
        """Packs ``linear.weight`` (a copy: drop the Linear afterwards to free the original)."""
        return PackedLinear(pack(linear.weight), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        if x.shape[0] >= PREFILL_ROWS and torch.get_num_threads() > 1 and not threaded():
            return F.linear(x, unpack(self.packed), self.bias)
        out = packed_matmul(x, self.packed)
        return out if self.bias is None else out + self.bias


class PackedEmbedding(nn.Module):
    """An embedding table stored packed (it is the packed LM head too when they are tied)."""

    def __init__(self, packed: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", packed)  # [vocab / 8, hidden, 8]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, hidden]
        return packed_rows(self.packed, ids)
