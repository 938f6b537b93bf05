"""int6 (a GGUF's Q6_K kept at 6 bits on a GPU): the format (worker/layers/quant.py), its CPU
path (the int8 kernel), and the 6-bit planes and kernels of worker/device/kernels/int6_matmul.py
(Triton's CPU interpreter here, CUDA on the GPU box) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker.layers import quant as Q

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _int6(n: int, k: int, group: int = 16, seed: int = 0) -> Q.QuantizedWeight:
    """Random codes over the whole range [-32, 31] (a Q6_K's, -32 included)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3).half()
    return Q.QuantizedWeight(Q.INT6, (n, k), group, codes, scales).to(DEVICE)


def test_int6_fit_keeps_codes_in_six_bits_and_beats_nothing_else() -> None:
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    six = Q.quantize(weight, Q.QuantFormat(Q.INT6, 16))
    eight = Q.quantize(weight, Q.QuantFormat(Q.INT8, 16))
    assert six.kind == Q.INT6 and six.qdata.dtype == torch.int8
    assert int(six.qdata.abs().max()) <= 31
    err6 = (six.dequantize() - weight).square().mean()
    err8 = (eight.dequantize() - weight).square().mean()
    # a 6-bit grid: about 16x the int8 error, far below the weights' own spread
    assert err8 < err6 < weight.square().mean() * 1e-2
    assert six.format.describe() == "int6 g16"


def test_int6_on_the_cpu_runs_the_int8_kernel() -> None:
    from worker.device import cpu_quant

    if not cpu_quant.available():
        pytest.skip("no C kernel on this machine")
    qw = _int6(32, 64).to("cpu")
    layer = Q.QuantLinear.from_weight(qw)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    want = x @ qw.dequantize().T
    assert cpu_quant.can_pack(qw)
    layer.cpu_packed = cpu_quant.pack(qw)
    torch.testing.assert_close(layer(x), want, rtol=2e-3, atol=2e-3)


# -- the GPU's planes and kernels (Triton) ------------------------------------------------------


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize(("n", "k", "group"), [(5, 16, 16), (37, 208, 16), (40, 256, 32),
                                               (3, 384, 16)])  # fmt: skip
def test_planes_hold_every_code(n: int, k: int, group: int) -> None:
    """N not a multiple of a word's 8 outputs (padded), groups of 16 and 32."""
    from worker.device.kernels.int6_matmul import SixBitWeight

    qw = _int6(n, k, group)
    packed = SixBitWeight.pack(qw)
    columns = -(-n // 8)  # N padded to whole words of 8 outputs
    assert packed.low.shape == (k, columns) and packed.high.shape == (k // 2, columns)
    assert packed.scales.shape == (k // group, 8, columns)
    assert torch.equal(packed.codes(), qw.qdata.int())
    torch.testing.assert_close(packed.dequantize(), qw.dequantize(), rtol=0, atol=0)
    ids = torch.tensor([n - 1, 0, n // 2], device=DEVICE)
    torch.testing.assert_close(packed.rows(ids, torch.float32), qw.dequantize()[ids], rtol=0,
                               atol=0)  # fmt: skip
    # 6 bits a weight and a 16-bit scale a group when N fills the words (g16: 7; int8 g16: 9)
    if n % 8 == 0:
        assert packed.nbytes * 8 == n * k * 6 + n * (k // group) * 16


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize("rows", [1, 2, 17, 70])
@pytest.mark.parametrize(("k", "group"), [(208, 16), (256, 32)])
def test_int6_linear_matches_the_reference(rows: int, k: int, group: int) -> None:
    """Every path: the GEMV (1 row, K split), the GEMM (2-64 rows), the dequantized scratch
    (more rows), with a bias."""
    from worker.device.kernels.int6_matmul import SixBitWeight, int6_linear

    qw = _int6(70, k, group, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    bias = torch.randn(70, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    want = x @ qw.dequantize().T + bias
    got = int6_linear(x, SixBitWeight.pack(qw), bias)
    assert got.shape == (rows, 70) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("triton_ready")
def test_gemv_splits_add_up_and_the_scratch_goes_in_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.device.kernels import int6_matmul as M
    from worker.device.kernels import quant_matmul

    qw = _int6(300, 384, 16, seed=3)
    packed = M.SixBitWeight.pack(qw)
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = x @ qw.dequantize().T
    for split in (1, 2, 3):
        torch.testing.assert_close(M.int6_gemv(x, packed, split), want, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(quant_matmul, "SCRATCH_BYTES", 256 * 384 * 4)  # 256 rows a range
    xs = torch.randn(65, 384, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    torch.testing.assert_close(M.int6_linear(xs, packed), xs @ qw.dequantize().T, rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    # through a reserved scratch (a worker's): both ranges are dequantized into it
    monkeypatch.setattr(quant_matmul, "_SCRATCH", {})
    quant_matmul.reserve_scratch(DEVICE)
    next(iter(quant_matmul._SCRATCH.values())).fill_(255)
    real, written = M.dequantize_t, []
    monkeypatch.setattr(
        M, "dequantize_t", lambda *args: written.append(args[-1].data_ptr()) or real(*args)
    )
    torch.testing.assert_close(M.int6_linear(xs, packed), xs @ qw.dequantize().T, rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    assert written == [next(iter(quant_matmul._SCRATCH.values())).data_ptr()] * 2


@pytest.mark.usefixtures("triton_ready")
def test_pack_for_device_puts_int6_in_planes_and_shares_a_tied_table() -> None:
    """A model with an int6 tied embedding / head and an int4 matmul: the table is packed once
    in 6 bits, the embedding gathers its rows from it, and forward matches the reference."""
    from worker.device.kernels.int6_matmul import SixBitWeight
    from worker.device.kernels.quant_matmul import KMajorWeight

    table = _int6(48, 128)
    body = Q.quantize(torch.randn(128, 128) * 0.05, Q.QuantFormat(Q.INT4, 32)).to(DEVICE)
    model = nn.Module()
    model.embed = Q.QuantEmbedding(48, 128, Q.QuantFormat(Q.INT6, 16), torch.float32)
    model.embed.quantized = table
    model.head = Q.QuantLinear.from_weight(table)
    model.body = Q.QuantLinear.from_weight(body)
    ids = torch.tensor([3, 47, 0], device=DEVICE)
    want_rows = table.dequantize()[ids]
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    want = (x @ body.dequantize().T) @ table.dequantize().T
    assert Q.pack_for_device(model) == (2, 0)
    assert isinstance(model.head.device_packed, SixBitWeight)
    assert model.embed.device_packed is model.head.device_packed
    assert isinstance(model.body.device_packed, KMajorWeight)
    assert model.head.quantized is None and model.embed.quantized is None
    assert model.head.gated(x, "silu") is None  # no fused gated path for 6 bits
    torch.testing.assert_close(model.embed(ids), want_rows, rtol=0, atol=0)
    torch.testing.assert_close(model.head(model.body(x)), want, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize("wide", [0, 8, 16])
def test_both_gemm_kernels_match_the_reference(monkeypatch: pytest.MonkeyPatch, wide: int) -> None:
    """One dot a code position (0), or all positions' weights in one dot (8 or 16 columns)."""
    from worker.device.kernels import int6_matmul as M

    monkeypatch.setattr(M, "GEMM_WIDE", wide)
    qw = _int6(90, 96, 32, seed=wide)
    packed = M.SixBitWeight.pack(qw)
    for rows in (2, 40):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        torch.testing.assert_close(M.int6_gemm(x, packed), x @ qw.dequantize().T, rtol=1e-4,
                                   atol=1e-4)  # fmt: skip


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize(("n", "k", "group"), [(37, 208, 16), (64, 256, 32)])
def test_info_counts_the_bytes_the_planes_hold(n: int, k: int, group: int) -> None:
    from worker.device.kernels.int6_matmul import SixBitWeight
    from worker.loading.quantize import _stored

    name, nbytes = _stored(Q.QuantFormat(Q.INT6, group), n, k, 2, torch.bfloat16)
    assert name == f"int6 g{group}"
    assert nbytes == SixBitWeight.pack(_int6(n, k, group)).nbytes


@pytest.mark.usefixtures("triton_ready")
def test_int6_off_packs_the_same_codes_for_the_int8_kernels() -> None:
    """``six_bit`` False (a card with room to spare, or TOKENPIPE_INT6=0): the int8 kernels
    (faster decode batches, 9 bits a weight)."""
    from worker.device.kernels.quant_matmul import KMajorWeight

    qw = _int6(40, 64)
    want = qw.dequantize()
    model = nn.Module()
    model.head = Q.QuantLinear.from_weight(qw)
    assert Q.pack_for_device(model, six_bit=False) == (1, 0)
    assert isinstance(model.head.device_packed, KMajorWeight)
    assert model.head.device_packed.kind == Q.INT8 and model.head.format.kind == Q.INT6
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    torch.testing.assert_close(model.head(x), x @ want.T, rtol=1e-4, atol=1e-4)


def test_six_bit_planes_where_the_weights_take_more_than_half_the_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 31B Q4_K_M (20.4 GiB held as int8) under a 24 GB card's limit: 6-bit planes; on an
    80 GB card: the int8 kernels; TOKENPIPE_INT6 decides when set."""
    from worker.device import cuda_setup, memory

    held = {"allocated": int(20.4 * memory.GIB), "free": int(3.1 * memory.GIB)}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held["allocated"])
    monkeypatch.setattr(memory, "unallocated_bytes", lambda device: held["free"])
    monkeypatch.delenv("TOKENPIPE_INT6", raising=False)
    planes, why = cuda_setup.six_bit_planes("cuda:0")
    assert planes
    assert "20.40 GiB of weights, 3.10 GiB free" in why
    held["free"] = int(58 * memory.GIB)
    assert not cuda_setup.six_bit_planes("cuda:0")[0]
    for setting, chosen in (("1", True), ("0", False)):
        monkeypatch.setenv("TOKENPIPE_INT6", setting)
        planes, why = cuda_setup.six_bit_planes("cuda:0")
        assert planes is chosen
        assert why == f"TOKENPIPE_INT6={setting}"


@pytest.mark.usefixtures("triton_ready")
@pytest.mark.parametrize("planes", [True, False])
def test_cuda_setup_packs_int6_as_chosen_and_says_so(
    monkeypatch: pytest.MonkeyPatch, planes: bool
) -> None:
    """``cuda_setup._pack_quantized`` (the worker's start-up) passes the choice on and logs it."""
    from worker.device import cuda_setup
    from worker.device.kernels.int6_matmul import SixBitWeight
    from worker.device.kernels.quant_matmul import KMajorWeight

    lines: list[str] = []
    monkeypatch.setattr(cuda_setup, "_log", lines.append)
    monkeypatch.setattr(cuda_setup, "six_bit_planes", lambda device: (planes, "because"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    inner = nn.Module()
    inner.model = nn.Module()
    inner.model.norm = nn.LayerNorm(64).to(DEVICE)
    inner.model.head = Q.QuantLinear.from_weight(_int6(40, 64))
    assert cuda_setup._pack_quantized(inner) == (1, 0)
    kind = SixBitWeight if planes else KMajorWeight
    assert isinstance(inner.model.head.device_packed, kind)
    assert lines == [
        "cuda_setup: int6 weights (a GGUF's Q6_K) in "
        + ("6-bit planes (7 bits a weight)" if planes else "the int8 kernels' layout (9 bits a "
           "weight, faster decode batches)")
        + ": because"
    ]  # fmt: skip
