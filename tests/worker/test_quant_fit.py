"""`worker/device/kernels/quant_fit.py`: `--quantize`'s int4 and int8 fits in one Triton launch a
weight, against the torch form in `worker.layers.quant` (the reference). On the CPU the
kernels run in Triton's interpreter; on a GPU the same tests compile them."""

from __future__ import annotations

import pytest
import torch

from worker.layers import quant as Q

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _weight(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A weight with the groups a fit must not trip on: all zero, constant, one outlier."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, -1, n)[:, None]
    w[1, :64] = 0.0
    w[2, 32:96] = 0.0125
    w[3, 5] = 0.9
    return w.to(DEVICE, dtype)


def _error(w: torch.Tensor, qw: Q.QuantizedWeight, importance: torch.Tensor | None) -> torch.Tensor:
    """Each group's (weighted) squared error [N, K / g]."""
    n, k = qw.shape
    err = (Q.dequantize(qw) - w.float()).square().reshape(n, k // qw.group_size, qw.group_size)
    if importance is not None:
        err = err * Q._group_weights(importance, k, qw.group_size, w)
    return err.sum(-1)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_fit_gives_the_torch_fits_codes(
    triton_ready: None, group: int, dtype: torch.dtype
) -> None:
    """Codes, scales and offsets as the torch passes give them, searched and min/max; a row
    count whose groups leave the last program part empty."""
    from worker.device.kernels.quant_fit import fit_int4

    w = _weight(37, 256, dtype)
    for search in (True, False):
        want = Q.quantize_int4(w.cpu(), group, search=search)
        packed, scales, offsets = fit_int4(w, group, search, None)
        assert packed.dtype == torch.uint8 and scales.dtype == offsets.dtype == torch.float16
        assert torch.equal(packed.cpu(), want.qdata)
        assert torch.equal(scales.cpu(), want.scales)
        assert offsets is not None and want.offsets is not None
        assert torch.equal(offsets.cpu(), want.offsets)


def test_int4_fit_weighted_by_importance(triton_ready: None) -> None:
    """With input-channel importance the weighted sums add in another order than torch's: almost
    every group the same, and none with more than 1e-5 more error than the torch fit's."""
    from worker.device.kernels.quant_fit import fit_int4

    w = _weight(48, 256, torch.bfloat16, seed=1)
    importance = torch.rand(256, generator=torch.Generator().manual_seed(2)) ** 4 + 1e-3
    want = Q.quantize_int4(w.cpu(), 32, importance=importance)
    factors = Q._group_weights(importance, 256, 32, w).reshape(256)
    packed, scales, offsets = fit_int4(w, 32, True, factors)
    got = Q.QuantizedWeight(Q.INT4, (48, 256), 32, packed.cpu(), scales.cpu(), offsets.cpu())
    assert (scales.cpu() == want.scales).float().mean() >= 0.99
    mine, theirs = _error(w.cpu(), got, importance), _error(w.cpu(), want, importance)
    assert torch.all(mine <= theirs * (1 + 1e-5) + 1e-12)


@pytest.mark.parametrize("kind, group", [(Q.INT8, 32), (Q.INT8, 128), (Q.INT6, 16)])
def test_int8_fit_gives_the_torch_fits_codes(triton_ready: None, kind: str, group: int) -> None:
    """int8 (divisors 64-127) and int6 (16-31) searched, and round to nearest: the same bits."""
    from worker.device.kernels.quant_fit import fit_int8

    w = _weight(29, 256, torch.bfloat16, seed=3)
    limit = Q.CODE_LIMIT[kind]
    for search, low in ((True, (limit + 1) // 2), (False, limit)):
        want = Q.quantize_int8(w.cpu(), group, search=search, kind=kind)
        codes, scales = fit_int8(w, group, low, limit)
        assert torch.equal(codes.cpu(), want.qdata) and torch.equal(scales.cpu(), want.scales)


def test_quantize_takes_the_kernel_where_it_fits(
    triton_ready: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`quantize` sends a device weight in groups of 16-256 through one launch (on the CPU: with
    TOKENPIPE_TRITON_CPU=1 and TOKENPIPE_QUANT_FIT=kernel) and other groups through the torch
    passes; with TOKENPIPE_QUANT_FIT=torch every weight takes the torch passes; both give the
    same weight. (That a CUDA weight takes the kernel with nothing set: the GPU test below.)"""
    from worker.device.kernels import quant_fit

    w = _weight(8, 64, torch.bfloat16, seed=4)
    monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
    monkeypatch.setenv("TOKENPIPE_QUANT_FIT", "kernel")
    calls: list[str] = []
    for name in ("fit_int4", "fit_int8"):
        real = getattr(quant_fit, name)
        monkeypatch.setattr(
            quant_fit, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a)
        )
    kernel = {
        fmt: Q.quantize(w, Q.QuantFormat(fmt, 32)) for fmt in (Q.INT4, Q.INT8)
    }  # fmt: skip
    assert calls == ["fit_int4", "fit_int8"]
    Q.quantize(w, Q.QuantFormat(Q.INT8, 0))  # per channel: a 64-weight row is one group of 64
    assert calls == ["fit_int4", "fit_int8", "fit_int8"]
    Q.quantize(w[:, :48].contiguous(), Q.QuantFormat(Q.INT8, 0))  # a 48-weight row: torch's
    assert len(calls) == 3
    monkeypatch.setenv("TOKENPIPE_QUANT_FIT", "torch")
    for fmt, got in kernel.items():
        want = Q.quantize(w, Q.QuantFormat(fmt, 32))
        assert torch.equal(got.qdata, want.qdata) and torch.equal(got.scales, want.scales)
    assert len(calls) == 3
    monkeypatch.delenv("TOKENPIPE_QUANT_FIT")  # a CPU weight, nothing asked: the torch passes
    Q.quantize(w.cpu(), Q.QuantFormat(Q.INT4, 32))  # (w is a CUDA weight on a GPU machine)
    assert len(calls) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's compiled kernel")
def test_a_31b_matrix_on_the_gpu_matches_the_torch_fit(
    triton_ready: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 4 31B's down_proj [5376, 21504] in bf16: the compiled kernel against the torch fit
    on the same GPU (the GPU's own reduction order): every group's error within 1e-5. With
    nothing set, `quantize_int4` of a CUDA weight is the kernel's fit."""
    from worker.device.kernels.quant_fit import fit_int4

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.empty(5376, 21504, device="cuda", dtype=torch.bfloat16).normal_(
        0, 0.02, generator=gen
    )
    monkeypatch.setenv("TOKENPIPE_QUANT_FIT", "torch")
    want = Q.quantize_int4(w, 32)
    packed, scales, offsets = fit_int4(w, 32, True, None)
    got = Q.QuantizedWeight(Q.INT4, tuple(w.shape), 32, packed, scales, offsets)
    assert (scales == want.scales).float().mean() >= 0.999
    mine, theirs = _error(w, got, None), _error(w, want, None)
    assert torch.all(mine <= theirs * (1 + 1e-5) + 1e-12)
    monkeypatch.delenv("TOKENPIPE_QUANT_FIT")
    default = Q.quantize_int4(w, 32)
    assert torch.equal(default.qdata, packed) and torch.equal(default.scales, scales)
