"""The packed CPU matmul (worker/models/cpu_gemv.py) against plain torch."""

from __future__ import annotations

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


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 70])
@pytest.mark.parametrize("shape", [(8, 5), (40, 24), (1048, 640), (640, 2048)])
def test_packed_matmul_matches_linear(rows: int, shape: tuple[int, int]) -> None:
    # 5, 131 groups of 8 rows: sweeps of 8, 4 and 3 groups leave a tail of single groups
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
@pytest.mark.parametrize("tokens", [1, 4, 37, cpu_gemv.PREFILL_ROWS])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_linear(tokens: int, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # more threads: prefill-sized inputs take MKL on an unpacked copy (the count is faked)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
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
