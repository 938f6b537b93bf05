"""The packed CPU matmul (worker/device/cpu_gemv.py) against plain torch."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker.device import cpu_gemv

needs_kernel = pytest.mark.skipif(cpu_gemv.kernel() is None, reason="no AVX2/FMA CPU kernel")


def test_pack_layout_and_rows() -> None:
    weight = torch.arange(24 * 12, dtype=torch.float32).view(24, 12)
    packed = cpu_gemv.pack(weight)
    assert packed.shape == (3, 12, 8)
    assert packed[1, 5, 3] == weight[1 * 8 + 3, 5]
    assert torch.equal(cpu_gemv.unpack(packed), weight)
    ids = torch.tensor([0, 5, 23, 5])
    assert torch.equal(cpu_gemv.packed_rows(packed, ids), weight[ids])


def test_can_pack() -> None:
    assert cpu_gemv.can_pack(torch.zeros(8, 12))
    assert not cpu_gemv.can_pack(torch.zeros(12, 16))  # rows not a multiple of 8
    assert not cpu_gemv.can_pack(torch.zeros(8, 16, dtype=torch.bfloat16))


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's thread count for the test (the kernel splits a matmul between that many)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _check_packed_matmul(rows: int, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + shape[0])
    weight = torch.randn(shape, generator=gen)
    x = torch.randn(rows, shape[1], generator=gen)
    out = cpu_gemv.packed_matmul(x, cpu_gemv.pack(weight))
    ref = x.double() @ weight.double().T
    assert out.shape == (rows, shape[0])
    # the error bound of a float32 sum of K products: K * eps * sum |x_k * w_k|
    bound = shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    assert bool(((out.double() - ref).abs() <= bound).all())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 70])
@pytest.mark.parametrize("shape", [(8, 5), (40, 24), (1048, 640), (640, 2048), (1544, 13)])
def test_packed_matmul_matches_linear(rows: int, shape: tuple[int, int], threads: int) -> None:
    # 5, 131, 193 groups of 8 rows: sweeps of 8, 4 and 3 groups leave a tail of single groups,
    # and with 2 threads the last chunk is not a whole number of sweeps
    _check_packed_matmul(rows, shape)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [47, 48, 49, 50, 71, 72, 73, 97, 1025])
def test_packed_matmul_thread_shares(rows: int, groups: int, threads: int) -> None:
    # group counts around the thread split (chunks of whole 24-group sweeps; the split needs
    # >= 48 groups and 64 KiB of weight), with an odd K
    _check_packed_matmul(rows, (groups * 8, 67))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 70])
def test_thread_counts_give_the_same_bits(rows: int) -> None:
    # every output element is computed by one thread in the same order: no rounding drift
    if not cpu_gemv.threaded():
        pytest.skip("one-thread build")
    gen = torch.Generator().manual_seed(rows)
    packed = cpu_gemv.pack(torch.randn(8 * 1000, 96, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    before = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3, 2):
            torch.set_num_threads(count)
            outs.append(cpu_gemv.packed_matmul(x, packed))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@needs_kernel
def test_concurrent_callers(threads: int) -> None:
    # the pool takes one caller at a time; another runs its matmul alone, still correct
    gen = torch.Generator().manual_seed(3)
    packed = cpu_gemv.pack(torch.randn(8 * 600, 64, generator=gen))
    xs = [torch.randn(r, 64, generator=gen) for r in (1, 2, 3, 4) * 3]
    want = [cpu_gemv.packed_matmul(x, packed) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(lambda x: cpu_gemv.packed_matmul(x, packed), xs))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 4, 37, cpu_gemv.PREFILL_ROWS])
@pytest.mark.parametrize("one_thread_build", [False, True])
def test_packed_linear(
    tokens: int, threads: int, one_thread_build: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a one-thread build with more threads: prefill-sized inputs take MKL on an unpacked copy
    if one_thread_build:
        monkeypatch.setattr(cpu_gemv, "threaded", lambda: False)
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True)
    packed = cpu_gemv.PackedLinear.from_linear(linear)
    x = torch.randn(tokens, 64)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias))


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 640), (3, 4, 256), (2, 13)])
@pytest.mark.parametrize("with_scale", [True, False])
def test_rms_norm_matches_torch(shape: tuple[int, ...], with_scale: bool) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen) * 3
    scale = torch.randn(shape[-1], generator=gen) + 1 if with_scale else None
    ref = F.rms_norm(x.double(), (shape[-1],), None if scale is None else scale.double(), 1e-6)
    out = cpu_gemv.rms_norm(x, scale, 1e-6)
    assert out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_argmax_is_torchs() -> None:
    """tp_argmax gives torch.argmax's index on every row: the first of tied maxima (within a
    vector of 8 and across vectors), a maximum in the scalar tail, the first NaN, all -inf,
    +-0 ties, and widths below, at and past a vector; greedy sampling on the CPU takes it."""
    from worker.engine.sampling import SamplingParams, sample

    gen = torch.Generator().manual_seed(5)
    for n in (1, 7, 8, 9, 64, 1003, 262_144):
        x = torch.randn(6, n, generator=gen)
        if n > 2:
            x[1, n // 3] = x[1, n - 1] = 50.0  # a tie: the first wins
            x[2, n - 1] = 60.0  # the maximum in the scalar tail (n % 8 != 0)
            x[3, n // 2] = float("nan")
            x[3, n - 1] = float("nan")
            x[3, 0] = 70.0  # a NaN beats any number
        x[4] = float("-inf")
        x[5] = 0.0
        x[5, n - 1] = -0.0
        got = cpu_gemv.argmax(x)
        assert got is not None and got.dtype == torch.int64
        assert got.tolist() == torch.argmax(x, dim=-1).tolist(), n
    assert cpu_gemv.argmax(x.double()) is None and cpu_gemv.argmax(x[0]) is None
    ids = sample(x, [SamplingParams()] * 6, [None] * 6)
    assert ids.tolist() == torch.argmax(x, dim=-1).tolist()


@needs_kernel
def test_one_thread_build(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    # the build without the thread pool: same results, one thread
    lib = cpu_gemv.load_library(threaded=False)
    assert lib.tp_threaded() == 0
    monkeypatch.setattr(cpu_gemv, "kernel", lambda: lib)
    for rows in (1, 4, 9):
        _check_packed_matmul(rows, (1048, 640))


def test_no_compiler_means_no_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_gemv.kernel.cache_clear()
    try:
        assert cpu_gemv.kernel() is None
        assert not cpu_gemv.threaded()
    finally:
        cpu_gemv.kernel.cache_clear()


def test_opt_out_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENPIPE_CPU_GEMV", "0")
    cpu_gemv.kernel.cache_clear()
    try:
        assert cpu_gemv.kernel() is None
    finally:
        cpu_gemv.kernel.cache_clear()


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("with_scale", [True, False])
def test_norm_rope_matches_torch(tokens: int, norm: bool, with_scale: bool) -> None:
    from worker.layers.rope import apply_rotary

    gen = torch.Generator().manual_seed(tokens)
    heads, dim = 3, 20
    # q of a fused projection: a strided view [T, H, D] of [T, (H + 2) * D]
    fused = torch.randn(tokens, (heads + 2) * dim, generator=gen) * 2
    x = fused[:, : heads * dim].view(tokens, heads, dim)
    scale = torch.randn(dim, generator=gen) + 1 if with_scale else None
    angles = torch.randn(tokens, dim // 2, generator=gen).repeat(1, 2) * 5
    cos, sin = angles.cos(), angles.sin()
    normed = cpu_gemv.rms_norm(x, scale, 1e-6) if norm else x
    ref = apply_rotary(normed, cos, sin)
    out = cpu_gemv.norm_rope(x, scale, 1e-6, cos, sin, norm=norm)
    assert out.shape == (tokens, heads, dim) and out.is_contiguous()
    assert torch.equal(out, ref)  # the same roundings as the two-step path
    full = F.rms_norm(x.double(), (dim,), None if scale is None else scale.double(), 1e-6)
    ref64 = apply_rotary(full if norm else x.double(), cos.double(), sin.double())
    torch.testing.assert_close(out.double(), ref64, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("norm_y", [True, False])
@pytest.mark.parametrize("with_h", [True, False])
def test_add_rms_norm_matches_two_steps(rows: int, norm_y: bool, with_h: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    dim = 644
    resid = torch.randn(rows, dim, generator=gen)
    y = torch.randn(rows, dim, generator=gen) * 4
    wy, wh = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)
    out, h = cpu_gemv.add_rms_norm(
        resid, y, wy if norm_y else None, 1e-6 if norm_y else None, wh, 1e-5 if with_h else None
    )
    expected = resid + (cpu_gemv.rms_norm(y, wy, 1e-6) if norm_y else y)
    assert torch.equal(out, expected)
    if with_h:
        assert h is not None and torch.equal(h, cpu_gemv.rms_norm(expected, wh, 1e-5))
    else:
        assert h is None


@needs_kernel
@pytest.mark.parametrize("length", [1, 7, 300])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 1, 256), (4, 2, 72), (3, 3, 8), (8, 1, 64), (12, 2, 24)]
)
@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_matches_sdpa(
    length: int, heads: int, kv_heads: int, dim: int, masked: bool
) -> None:
    gen = torch.Generator().manual_seed(length + dim)
    # a cache of 3 slots [3, KVH, R, D]; slot 1 is read from index 3 and written at index 5
    ring = length + 5
    cache_k = torch.randn(3, kv_heads, ring, dim, generator=gen)
    cache_v = torch.randn(3, kv_heads, ring, dim, generator=gen)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    # the new key and value: views of a fused projection [2, (H + 2 KVH) D], as the model has
    fused = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=gen)
    q = fused[1, : heads * dim].view(heads, dim)
    k_new = fused[1, heads * dim : (heads + kv_heads) * dim].view(kv_heads, dim)
    v_new = fused[1, (heads + kv_heads) * dim :].view(kv_heads, dim)
    mask = None
    if masked:  # some entries hidden, never all of them
        allowed = torch.rand(length, generator=gen) < 0.6
        allowed[length // 2] = True
        mask = torch.zeros(length).masked_fill_(~allowed, float("-inf"))
    out = torch.empty(heads, dim)
    assert cpu_gemv.can_decode_attention(q, k_new, v_new, cache_k, cache_v, out)
    cpu_gemv.decode_attention(
        q, k_new, v_new, cache_k, cache_v, 1, 5, 3, 3 + length, mask, 0.3, out
    )
    before_k[1, :, 5], before_v[1, :, 5] = k_new, v_new
    assert torch.equal(cache_k, before_k) and torch.equal(cache_v, before_v)
    keys, values = before_k[1, :, 3 : 3 + length], before_v[1, :, 3 : 3 + length]
    group = heads // kv_heads
    ref = F.scaled_dot_product_attention(
        q.double()[:, None, :],  # [H, 1, D]
        keys.double().repeat_interleave(group, 0),
        values.double().repeat_interleave(group, 0),
        attn_mask=None if mask is None else mask.double()[None, :],
        scale=0.3,
    )[:, 0, :]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_can_decode_attention_refuses_what_it_cannot_take() -> None:
    q, kv, cache, out = (
        torch.zeros(4, 16),
        torch.zeros(2, 16),
        torch.zeros(1, 2, 8, 16),
        torch.zeros(4, 16),
    )
    if cpu_gemv.kernel() is None:
        assert not cpu_gemv.can_decode_attention(q, kv, kv, cache, cache, out)
        return
    assert cpu_gemv.can_decode_attention(q, kv, kv, cache, cache, out)
    assert not cpu_gemv.can_decode_attention(q[:, :12], kv[:, :12], kv[:, :12], cache, cache, out)
    assert not cpu_gemv.can_decode_attention(q.double(), kv, kv, cache, cache, out)
    assert not cpu_gemv.can_decode_attention(q, kv, kv, cache.transpose(1, 2), cache, out)
    assert not cpu_gemv.can_decode_attention(q[:3], kv, kv, cache, cache, out[:3])  # 3 of 2 groups
    assert not cpu_gemv.can_decode_attention(q, kv, kv, cache, cache, out.t().contiguous().t())


POOL_UNDER_LOAD = r"""
import os, subprocess, sys, time
import torch
from worker.device import cpu_gemv
cpus = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, cpus)  # our two threads on two CPUs, a busy process on one of them
torch.set_num_threads(2)
weights = [cpu_gemv.pack(torch.randn(2048, 640, generator=torch.Generator().manual_seed(i)))
           for i in range(8)]
x = torch.randn(1, 640, generator=torch.Generator().manual_seed(99))
want = [cpu_gemv.packed_matmul(x, w) for w in weights]
hog = subprocess.Popen([sys.executable, "-c",
                        f"import os; os.sched_setaffinity(0, {{{cpus[1]}}})\nwhile True: pass"])
try:
    deadline = time.monotonic() + 20
    while not cpu_gemv.pool_stats()["solo_now"] and time.monotonic() < deadline:
        for w, ref in zip(weights, want):
            assert torch.equal(cpu_gemv.packed_matmul(x, w), ref)  # same bits, any mode
finally:
    hog.kill()
stats = cpu_gemv.pool_stats()
print(stats)
assert stats["solo_now"] and stats["solo_periods"] >= 1 and stats["stalled_calls"] >= 2, stats
for w, ref in zip(weights, want):
    assert torch.equal(cpu_gemv.packed_matmul(x, w), ref)
"""


def test_pool_runs_alone_when_a_busy_process_stalls_its_helpers() -> None:
    """Two threads on two CPUs, a busy process pinned to one of them: the helper is preempted
    mid-chunk, the caller's waits are seen as stalls, and the pool runs on the caller alone
    (same bits throughout). In a subprocess: the affinity must not leak into pytest."""
    import subprocess
    import sys

    if not cpu_gemv.threaded() or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs the threaded kernel and two CPUs")
    done = subprocess.run([sys.executable, "-c", POOL_UNDER_LOAD], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
