"""The packed CPU matmul (worker/models/cpu_gemv.py) against plain torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker.models import cpu_gemv

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
    """torch's thread count for the test (the kernel splits its groups between them)."""
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
    # and with 2 threads the second share is not a whole number of sweeps
    _check_packed_matmul(rows, shape)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [47, 48, 49, 50, 71, 72, 73, 97, 1025])
def test_packed_matmul_thread_shares(rows: int, groups: int, threads: int) -> None:
    # group counts around the 2-thread split (shares of whole 24-group sweeps; the split needs
    # >= 48 groups and 64 KiB of weight), with an odd K
    _check_packed_matmul(rows, (groups * 8, 67))


@needs_kernel
def test_threaded_build_shares_torchs_openmp() -> None:
    # the OpenMP build must bind to the libgomp torch loaded, never a second runtime
    if not cpu_gemv.threaded():
        pytest.skip("one-thread build (torch without libgomp, or cc without OpenMP)")
    maps = Path("/proc/self/maps").read_text().splitlines()
    libgomps = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(libgomps) == 1, libgomps


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
def test_one_thread_build(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    # the build for a compiler without OpenMP (or torch without libgomp): same results, serial
    lib = cpu_gemv.load_library(openmp=False)
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
