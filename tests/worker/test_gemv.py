"""The decode GEMV kernel (Triton's CPU interpreter here, CUDA on the GPU box) against
F.linear, and its installation on a model's linears (one-row inputs go through it, longer
ones through F.linear; logits unchanged). Every test needs the `triton_ready` fixture
(tests/conftest.py: a skip without triton, a failure in CI)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("triton_ready")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gemv_matches_linear(rows: int) -> None:
    from worker.device.kernels.gemv import gemv_triton

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 300, generator=gen).to(DEVICE)
    w = torch.randn(70, 300, generator=gen).to(DEVICE)  # N and K not multiples of the tiles
    y = gemv_triton(x, w, config=(16, 64, 4, 1))
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        gemv_triton(torch.randn(5, 300).to(DEVICE), w)


@pytest.mark.parametrize("config", [(4, 512, 4, 4), (2, 1024, 2, 3)])
def test_narrow_row_blocks_match_linear(config: tuple[int, int, int, int]) -> None:
    """The few-output candidates (2 or 4 rows a program, wide K tiles) against F.linear, and
    only matrices of few outputs are timed with them."""
    from worker.device.kernels.gemv import (
        CANDIDATES,
        FEW_OUTPUT_CANDIDATES,
        FEW_OUTPUTS,
        candidates_for,
        gemv_triton,
    )

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 600, generator=gen).to(DEVICE)
    w = torch.randn(37, 600, generator=gen).to(DEVICE)  # N and K not multiples of the tiles
    torch.testing.assert_close(gemv_triton(x, w, config), x @ w.T, rtol=1e-4, atol=1e-4)
    assert config in FEW_OUTPUT_CANDIDATES
    assert candidates_for(w) == CANDIDATES + FEW_OUTPUT_CANDIDATES
    assert candidates_for(torch.empty(FEW_OUTPUTS, 8, device="meta")) == CANDIDATES
    assert candidates_for(w, [config]) == [config]


@pytest.mark.parametrize("act_name", ["silu", "gelu_pytorch_tanh"])
def test_gated_gemv_equals_the_activation_then_the_gemv(act_name: str) -> None:
    """down(act(gate) * up) in one launch, from the halves of one gate_up row, equals the
    activation kernel's rounding followed by the GEMV (bf16 rounding of act and the product)."""
    import torch.nn.functional as F

    from worker.device.kernels.gemv import gated_gemv_triton, gemv_triton
    from worker.device.kernels.rmsnorm import GATED_ACTIVATIONS

    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(1, 2 * 300, generator=gen).to(DEVICE)
    w = torch.randn(70, 300, generator=gen).to(DEVICE)
    gate, up = gate_up[:, :300], gate_up[:, 300:]
    act = F.silu if act_name == "silu" else (lambda g: F.gelu(g, approximate="tanh"))
    config = (16, 64, 4, 1)
    got = gated_gemv_triton(gate, up, w, GATED_ACTIVATIONS[act_name], config)
    want = gemv_triton((act(gate) * up).contiguous(), w, config)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bf16 (the activation kernel's roundings) on a GPU only: the interpreter rounds bf16 its
    # own way (COMMON: kernels are tested in fp32 there)
    for dtype in (torch.bfloat16,) if DEVICE == "cuda" else ():
        g, u, wd = gate.to(dtype), up.to(dtype), w.to(dtype)
        h = (act(g.float()).to(dtype).float() * u.float()).to(dtype)
        ref = gemv_triton(h, wd, config).float()
        out = gated_gemv_triton(g, u, wd, GATED_ACTIVATIONS[act_name], config)
        assert out.dtype == dtype
        # torch's silu / gelu and the kernel's may round an element of h the other way
        assert (out.float() - ref).norm() / ref.norm() < 4e-3
    with pytest.raises(ValueError):
        gated_gemv_triton(torch.randn(2, 300).to(DEVICE), torch.randn(2, 300).to(DEVICE), w, 0)


def test_installed_gemv_serves_one_row_and_leaves_logits_alone() -> None:
    from test_cuda_graphs import tiny_model

    from worker.device.kernels import gemv
    from worker.models.step import StepInput

    ref, fast = tiny_model(DEVICE), tiny_model(DEVICE)
    shapes = []

    def choose(weight: torch.Tensor) -> tuple[int, int, int, int]:
        shapes.append(tuple(weight.shape))
        return (16, 32, 4, 1)

    chosen = gemv.install_decode_gemv(fast, choose=choose)
    assert len(shapes) == len(set(shapes)) == len(chosen) > 0  # once per shape
    calls = []
    real = gemv.gemv_triton
    gemv.gemv_triton = lambda *a, **k: calls.append(1) or real(*a, **k)  # type: ignore[assignment]
    try:
        kv_ref, kv_fast = ref.make_kv_cache(1, 32), fast.make_kv_cache(1, 32)
        prompt = StepInput.single([5, 6, 7], 0, 0, device=DEVICE)
        torch.testing.assert_close(fast(prompt, kv_fast), ref(prompt, kv_ref))
        assert not calls  # three rows: F.linear
        one = StepInput.single([9], 0, 3, device=DEVICE)
        torch.testing.assert_close(fast(one, kv_fast), ref(one, kv_ref), rtol=1e-4, atol=1e-4)
        assert calls  # one row: the kernel
    finally:
        gemv.gemv_triton = real  # type: ignore[assignment]
