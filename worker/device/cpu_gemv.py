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

The kernel is C compiled once with the system compiler (``cc -O3 -mavx2 -mfma``) into
``$TOKENPIPE_CACHE/kernels`` (default ``~/.cache/tokenpipe/kernels``) and loaded with ctypes.
With ``torch.get_num_threads()`` > 1 a matmul is split between the calling thread and helper
threads of the kernel's own pool: the weight groups are cut into chunks that any thread
claims, so the caller never waits for a helper the OS has not run yet (OpenMP's static split
made a 2-thread step ~10x slower while another process held a core). Without pthreads it is
one thread (and prefill-sized inputs with more torch threads go to MKL: ``PackedLinear``).
``kernel()`` is None (and the model keeps its plain weights) without an x86-64 Linux CPU with
AVX2 and FMA, without a compiler, or with ``TOKENPIPE_CPU_GEMV=0``.
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

from worker.device.cpu_kernel_source import SOURCE
from worker.device.cpu_quant_source import QUANT_SOURCE

LIBRARY_SOURCE = SOURCE + QUANT_SOURCE

ROW_BLOCK = 8  # weight rows interleaved together: one AVX2 vector holds one k of 8 rows


def _cache_dir() -> Path:
    from worker import cache_dir

    return cache_dir("kernels")


def _cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split())


AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def _flags(threaded: bool) -> list[str]:
    # no FMA contraction outside the intrinsics: the norm and rotary helpers round like the
    # torch ops they replace; AVX-512 (the quantized matmuls' 16-row vectors) where the CPU has it
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC"]
    if set(AVX512) <= _cpu_flags() and os.environ.get("TOKENPIPE_CPU_AVX512", "1") != "0":
        flags += [f"-m{name}" for name in AVX512]
        if {"avx512_vnni", "avx512vbmi"} <= _cpu_flags():  # cpu_quant's integer activations
            flags += ["-mavx512vnni", "-mavx512vbmi"]
    return flags + (["-pthread", "-DTP_POOL"] if threaded else [])


def _compile(target: Path, threaded: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "gemv.c"
        source.write_text(LIBRARY_SOURCE)
        built = Path(tmp) / target.name
        compiler = os.environ.get("CC", "cc")
        subprocess.run(
            [compiler, *_flags(threaded), "-o", str(built), str(source), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: concurrent workers never load a partial file


def load_library(threaded: bool) -> ctypes.CDLL:
    """The kernel library (compiled on first use): with its thread pool, or one-thread."""
    key = LIBRARY_SOURCE + " ".join(_flags(threaded))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = _cache_dir() / f"gemv-{digest}.so"
    if not target.exists():
        _compile(target, threaded)
    lib = ctypes.CDLL(str(target))
    fn = lib.tp_packed_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.tp_threaded.restype = ctypes.c_int
    lib.tp_threaded.argtypes = []
    lib.tp_pool_stats.restype = ctypes.c_int
    lib.tp_pool_stats.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    norm = lib.tp_rms_norm
    norm.restype = None
    norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    norm.argtypes += [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    rope = lib.tp_norm_rope
    rope.restype = None
    rope.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    rope.argtypes += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
    rope.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    add = lib.tp_add_rms_norm
    add.restype = None
    add.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    add.argtypes += [ctypes.c_float, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
    add.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    attn = lib.tp_decode_attention
    attn.restype = None
    attn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    attn.argtypes += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    attn.argtypes += [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    attn.argtypes += [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    attn.argtypes += [ctypes.c_int]
    quant = lib.tp_quant_gemm
    quant.restype = ctypes.c_int
    quant.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    quant.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    quant.argtypes += [ctypes.c_int64, ctypes.c_int]
    q8act = lib.tp_quant_gemv_q8act
    q8act.restype = ctypes.c_int
    q8act.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tp_quant_gemm_a16.restype = ctypes.c_int
    lib.tp_quant_gemm_a16.argtypes = quant.argtypes
    rows = lib.tp_quant_rows
    rows.restype = ctypes.c_int
    rows.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4
    rows.argtypes += [ctypes.c_int64] * 3
    lib.tp_vector_rows.restype = ctypes.c_int
    lib.tp_vector_rows.argtypes = []
    lib.tp_argmax.restype = None
    lib.tp_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot run (see the module docstring)."""
    if os.environ.get("TOKENPIPE_CPU_GEMV", "1") == "0" or not _cpu_supported():
        return None
    try:
        return load_library(threaded=True)
    except (OSError, subprocess.SubprocessError):
        pass  # e.g. no pthreads or futex headers: the one-thread build
    try:
        return load_library(threaded=False)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"cpu_gemv: kernel unavailable, plain matmuls ({exc!r})", file=sys.stderr)
        return None


_kernel_threads: int | None = None


def set_kernel_threads(threads: int | None) -> None:
    """The thread count the kernels split a matmul over (None: ``torch.get_num_threads()``).
    The engine runs decode steps' torch ops on one thread (an OpenMP region over a vocabulary
    of logits waits for a preempted thread as the kernels used to) while the kernels keep
    this many."""
    global _kernel_threads
    _kernel_threads = threads


def kernel_threads() -> int:
    return _kernel_threads or torch.get_num_threads()


def configured_kernel_threads() -> int:
    """What ``set_kernel_threads`` set (0: nothing; the kernels follow torch)."""
    return _kernel_threads or 0


def threaded() -> bool:
    """Whether the kernel splits a matmul between threads (``torch.get_num_threads()`` of
    them: the caller and helpers of the kernel's own pool)."""
    lib = kernel()
    return lib is not None and bool(lib.tp_threaded())


def pool_stats() -> dict[str, int | bool]:
    """The thread pool's view of a busy machine: calls that waited on a stalled helper, the
    periods it then ran on the caller alone, and whether it does now (the C source's
    STALL_* constants)."""
    lib = kernel()
    if lib is None:
        return {"stalled_calls": 0, "solo_periods": 0, "solo_now": False}
    stalls, periods = ctypes.c_int64(0), ctypes.c_int64(0)
    solo = lib.tp_pool_stats(ctypes.byref(stalls), ctypes.byref(periods))
    return {"stalled_calls": stalls.value, "solo_periods": periods.value, "solo_now": bool(solo)}


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
    threads = kernel_threads()
    status = lib.tp_packed_gemm(
        x.shape[0], x.data_ptr(), packed.data_ptr(), out.data_ptr(), k, n, threads
    )
    if status != 0:
        raise ValueError(f"tp_packed_gemm failed ({status}) for x {tuple(x.shape)}, [{n}, {k}]")
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """``torch.argmax(logits, dim=-1)`` for fp32 CPU logits [B, V] in one call (the same
    index: the first maximum, a NaN the largest); None where the kernel cannot take them.
    torch's takes ~0.4 ms over a 262,144-token vocabulary, a tenth of the default model's
    decode step outside its matmuls."""
    lib = kernel()
    takes = logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu"
    if lib is None or not takes:
        return None
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.tp_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
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


def norm_rope(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: bool = True,
) -> torch.Tensor:
    """rotary(rms_norm(x) * scale) in one call (``norm=False``: rotary only), rotate-half
    layout. x [T, H, D] fp32 whose heads are D contiguous floats (a view into a fused q/k/v
    projection is fine); cos, sin [T, D]. -> a new [T, H, D]. Needs ``kernel()``."""
    lib = kernel()
    assert lib is not None, "norm_rope needs the CPU kernel"
    t, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or d % 2:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(t, h, d, dtype=torch.float32)
    scale_ptr = None if scale is None else scale.contiguous().data_ptr()
    lib.tp_norm_rope(
        x.data_ptr(), x.stride(0), t, h, d, scale_ptr, eps, int(norm),
        cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out


def add_rms_norm(
    resid: torch.Tensor,
    y: torch.Tensor,
    y_scale: torch.Tensor | None,
    y_eps: float | None,
    h_scale: torch.Tensor | None,
    h_eps: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A residual step in one call, fp32 [T, dim] rows: ``resid + rms_norm(y) * y_scale``
    (``y_eps`` None: ``resid + y``, no norm), and, when ``h_eps`` is given, the rms norm of that
    sum times ``h_scale`` (scales may be None: no weight). -> (sum, normed sum or None)."""
    lib = kernel()
    assert lib is not None, "add_rms_norm needs the CPU kernel"
    resid, y = resid.contiguous(), y.contiguous()
    rows, dim = resid.shape
    out = torch.empty_like(resid)
    h = None if h_eps is None else torch.empty_like(resid)

    def ptr(tensor: torch.Tensor | None) -> int | None:
        return None if tensor is None else tensor.data_ptr()

    lib.tp_add_rms_norm(
        resid.data_ptr(), y.data_ptr(), int(y_eps is not None), ptr(y_scale), y_eps or 0.0,
        ptr(h_scale), h_eps or 0.0, out.data_ptr(), ptr(h), rows, dim,
    )  # fmt: skip
    return out, h


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slot: int,
    write_index: int | None,
    first: int,
    end: int,
    mask: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One decoding sequence's attention step in one call. Writes its new key and value
    (k_new, v_new [KVH, D]; rounded into an fp8 cache as ``kv.as_cache`` does) at
    ``write_index`` of cache slot ``slot`` (cache_k, cache_v [slots, KVH, R, D], float32 or
    float8_e4m3fn; no write when None), then writes softmax(q k^T * scale + mask) v over the
    slot's entries [first, end) into ``out`` [H, D]; q [H, D]; mask None or additive [L]
    (0 / -inf); query head h reads KV head h // (H / KVH). Check ``can_decode_attention``
    first. Needs ``kernel()``."""
    from worker.layers.kv import as_cache

    lib = kernel()
    assert lib is not None, "decode_attention needs the CPU kernel"
    heads, dim = q.shape
    length = end - first
    fp8 = cache_k.dtype == torch.float8_e4m3fn
    if fp8 and write_index is not None:  # the bytes the cache holds, [KVH, D] contiguous
        k_new, v_new = as_cache(k_new, cache_k).contiguous(), as_cache(v_new, cache_v).contiguous()
    scores = torch.empty(min(heads, 4) * length, dtype=torch.float32)  # HB heads at a time
    slot_offset = slot * cache_k.stride(0) * cache_k.element_size()
    mask_ptr = None if mask is None else mask.contiguous().data_ptr()
    lib.tp_decode_attention(
        q.data_ptr(), cache_k.data_ptr() + slot_offset, cache_v.data_ptr() + slot_offset,
        cache_k.stride(1), -1 if write_index is None else write_index, k_new.data_ptr(),
        v_new.data_ptr(), first, length, heads, cache_k.shape[1], dim, mask_ptr, scale,
        out.data_ptr(), scores.data_ptr(), int(fp8),
    )  # fmt: skip


CACHE_DTYPES = (torch.float32, torch.float8_e4m3fn)  # the caches ``decode_attention`` reads


def can_decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    out: torch.Tensor,
) -> bool:
    """``decode_attention`` takes these: the kernel is there; fp32 on the CPU; q, k_new, v_new
    rows of D % 8 == 0 contiguous floats; whole head groups; contiguous caches of one shape,
    float32 or fp8 (``CACHE_DTYPES``)."""
    heads, dim = q.shape

    def rows(t: torch.Tensor) -> bool:
        return t.dtype == torch.float32 and t.stride(-1) == 1 and t.stride(-2) == dim

    return (
        kernel() is not None
        and q.device.type == "cpu"
        and dim % 8 == 0
        and rows(q)
        and rows(k_new)
        and rows(v_new)
        and out.is_contiguous()
        and cache_k.dtype in CACHE_DTYPES
        and cache_v.dtype == cache_k.dtype
        and cache_k.shape == cache_v.shape
        and cache_k.is_contiguous()
        and cache_v.is_contiguous()
        and heads % cache_k.shape[1] == 0
    )


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
        if x.shape[0] >= PREFILL_ROWS and kernel_threads() > 1 and not threaded():
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
