"""The quantized matmul kernels of worker/device/kernels/quant_matmul.py (Triton's CPU
interpreter here, CUDA on the GPU box) against the torch reference (``dequantize``, then
``F.linear``), and the quantized load that the CUDA path uses: built on the meta device,
float checkpoints streamed through transient targets, random weights drawn quantized. Every
test needs the `triton_ready` fixture (tests/conftest.py: a skip without triton, a failure in
CI)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.layers import quant as Q

pytestmark = pytest.mark.usefixtures("triton_ready")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qw(kind: str, group: int, n: int, k: int, seed: int = 0) -> Q.QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    return Q.quantize(weight, Q.QuantFormat(kind, group), search=False).to(DEVICE)


FORMATS = [("int4", 32), ("int4", 64), ("int8", 32), ("int8", 16)]


@pytest.mark.parametrize(("kind", "group"), FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 40, 70])
def test_quant_linear_matches_the_reference(kind: str, group: int, rows: int) -> None:
    from worker.device.kernels.quant_matmul import KMajorWeight, quant_linear

    # N not a multiple of any tile; K a multiple of the group but not of the K tiles
    qw = _qw(kind, group, n=70, k=group * 5, seed=rows)
    x = torch.randn(rows, group * 5, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    want = x @ qw.dequantize().T
    got = quant_linear(x, KMajorWeight.pack(qw))
    assert got.shape == (rows, 70) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("kind", "group"), FORMATS)
@pytest.mark.parametrize("n", [37, 40])
@pytest.mark.parametrize("block", [0, 2, 32])
def test_k_major_rows_and_dequantize_match_the_reference(
    kind: str, group: int, n: int, block: int
) -> None:
    """Both layouts: plain [K, C] words, and blocks of ``block`` word columns (C padded to
    whole blocks: several blocks at 2, one partly empty block at 32)."""
    from worker.device.kernels.quant_matmul import KMajorWeight, dequantize_triton

    qw = _qw(kind, group, n=n, k=group * 3)
    packed = KMajorWeight.pack(qw, block=block)
    per_word = packed.per_word
    columns = -(-n // per_word)  # N padded to whole words: 37 -> 40
    assert packed.block == block and packed.columns == columns
    if block:  # and the storage to whole blocks
        blocks = -(-columns // block)
        words, meta = (blocks, group * 3, block), (blocks, 3, per_word, block)
        stored = blocks * block
    else:
        words, meta, stored = (group * 3, columns), (3, per_word, columns), columns
    assert packed.words.dtype == torch.int32 and packed.words.shape == words
    assert packed.scales.shape == meta
    assert (packed.nbytes == qw.nbytes) == (n == stored * per_word)
    ids = torch.tensor([0, n - 1, 5, 5]).to(DEVICE)
    torch.testing.assert_close(packed.rows(ids, torch.float32), qw.rows(ids).dequantize())
    torch.testing.assert_close(dequantize_triton(packed, torch.float32), qw.dequantize().T)


def test_gemv_codes_at_every_bit_position_and_extreme_inputs() -> None:
    """The GEMV reads each code as a denormal fp32 (word & mask) times x scaled by 2^64: every
    code value at every position of a word, int8's most negative and positive codes, and x
    values from tiny to large must give the reference exactly (to fp32 rounding)."""
    from worker.device.kernels import quant_matmul as qm

    for kind, levels in (("int4", 16), ("int8", 256)):
        qw = _qw(kind, 32, n=64, k=64)
        codes = torch.arange(64 * 64).reshape(64, 64) % levels  # every value, every position
        if kind == "int4":
            qw.qdata = Q.pack_nibbles(codes.to(torch.uint8)).to(DEVICE)
        else:
            qw.qdata = (codes - 128).to(torch.int8).to(DEVICE)
        packed = qm.KMajorWeight.pack(qw)
        for scale in (1e-15, 1.0, 1e6):  # tiny: products stay normal floats
            x = (torch.randn(1, 64, generator=torch.Generator().manual_seed(3)) * scale).to(DEVICE)
            want = x @ qw.dequantize().T
            for split in (1, 2):
                got = qm.qgemv(x, packed, (16, 1, 1, 8), split=split)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize(("kind", "group"), [("int4", 16), ("int8", 8)])
def test_gemv_k_splits_pipeline_steps_and_arrival_counters(kind: str, group: int) -> None:
    """Tile shapes of the pipelined GEMVs (4 or 8 rows a step in registers, or the cp.async
    pipeline of `_qgemv_staged_kernel`; 1-2 warps sharing out the groups) and K splits that
    leave some programs a partial warp's worth of groups or none at all: the last program of
    each column block adds the partials, and every counter is back at zero after each call
    (the next call, or a CUDA graph replay, starts clean)."""
    from worker.device.kernels import quant_matmul as qm

    k = group * 7  # seven groups: a split of 3 is uneven, one of 6 (span 2) leaves one empty
    qw = _qw(kind, group, n=83, k=k, seed=5)  # 83 outputs: the last word half empty
    packed = qm.KMajorWeight.pack(qw)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    want = x @ qw.dequantize().T
    for block_c, warps, rows in ((4, 1, 8), (16, 2, 4), (8, 2, -2)):  # -2: cp.async, 2 stages
        for split in (1, 3, 6):
            got = qm.qgemv(x, packed, (block_c, 1, warps, rows), split=split)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert packed.arrivals is not None and not packed.arrivals.any()
    for config, split in (((8, 1, 1, 8, 4), 3), ((4, 1, 2, 4, 4), 1)):  # slots: 4, 2 a warp
        got = qm.qgemv(x, packed, config, split=split)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert packed.arrivals is not None and not packed.arrivals.any()
    again = qm.qgemv(x, packed, (8, 1, 2, 4), split=3)
    torch.testing.assert_close(again, qm.qgemv(x, packed, (8, 1, 2, 4), split=3), rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "block"), [("int4", 0), ("int4", 16), ("int8", 16)])
def test_prefill_scratch_a_range_of_outputs_at_a_time(
    kind: str, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill path's dequantized scratch, held to ``SCRATCH_BYTES``: any range of
    outputs dequantizes to the whole weight's columns, and the matmul a range at a time (the
    last one short, N not a whole number of words) gives the whole scratch's result."""
    from worker.device.kernels import quant_matmul as qm

    qw = _qw(kind, 16, n=203, k=16 * 6, seed=5)
    packed = qm.KMajorWeight.pack(qw, block=block)
    whole = qm.dequantize_triton(packed, torch.float32)
    for start, end in [(0, 203), (8, 72), (64, 203), (200, 203) if kind == "int4" else (196, 203)]:
        got = qm.dequantize_triton(packed, torch.float32, (start, end))
        assert torch.equal(got, whole[:, start:end]), (start, end)
    with pytest.raises(AssertionError):
        qm.dequantize_triton(packed, torch.float32, (3, 10))  # not a word's first output
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    want = x @ whole
    monkeypatch.setattr(qm, "SCRATCH_BYTES", 96 * 4 * 64)  # 64 outputs a range: 4 ranges
    calls: list[tuple[int, int] | None] = []
    real = qm.dequantize_triton
    monkeypatch.setattr(
        qm,
        "dequantize_triton",
        lambda p, d, o=None, into=None: calls.append(o) or real(p, d, o, into),
    )
    torch.testing.assert_close(qm.quant_linear(x, packed), want, rtol=1e-5, atol=1e-4)
    assert calls == [(0, 64), (64, 128), (128, 192), (192, 203)]
    # a reserved scratch (a worker's, before its caches): every range is written there
    monkeypatch.setattr(qm, "_SCRATCH", {})
    assert qm.reserve_scratch(DEVICE) == qm.SCRATCH_BYTES and qm.reserve_scratch(DEVICE) == 0
    buffer = next(iter(qm._SCRATCH.values()))
    buffer.fill_(255)  # NaN as float32: a range read before its own write would show
    written: list[int] = []
    monkeypatch.setattr(
        qm,
        "dequantize_triton",
        lambda p, d, o=None, into=None: written.append(into.data_ptr()) or real(p, d, o, into),
    )
    torch.testing.assert_close(qm.quant_linear(x, packed), want, rtol=1e-5, atol=1e-4)
    assert written == [buffer.data_ptr()] * 4


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_blocked_layout_gives_the_plain_layouts_bits(kind: str) -> None:
    """The blocked layout (``KMajorWeight.block``) changes only where the kernels read: the
    GEMV (register and cp.async pipelines, group slots, K splits), the GEMM (joined and
    per-position stores, K split) and the prefill dequantization give the plain layout's
    bits, for tiles narrower than a block, equal to one and spanning several, and a last
    block partly made of padding."""
    from worker.device.kernels import quant_matmul as qm

    qw = _qw(kind, 16, n=200, k=16 * 6, seed=3)  # int4: 25 word columns, int8: 50
    plain = qm.KMajorWeight.pack(qw, block=0)
    one = torch.randn(1, 96, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    many = torch.randn(5, 96, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    blocked = qm.KMajorWeight.pack(qw, block=16)  # int4: 2 blocks, int8: 4; the last padded
    # tiles of 8, 16 and 32 words: half a block, one, two
    gemvs = [((8, 1, 2, 8), 1), ((32, 1, 1, 4), 3), ((8, 1, 2, -2), 2), ((16, 1, 1, 8, 4), 3)]
    for config, split in gemvs:
        want = qm.qgemv(one, plain, config, split=split)
        assert torch.equal(qm.qgemv(one, blocked, config, split=split), want), config
    for config in [(8, 16, 1, 1, 1, 1), (32, 32, 1, 1, 0, 6)]:
        assert torch.equal(qm.qgemm(many, blocked, config), qm.qgemm(many, plain, config))
    got = qm.dequantize_triton(blocked, torch.float32)
    assert torch.equal(got, qm.dequantize_triton(plain, torch.float32))
    ids = torch.tensor([0, 199, 77, 77]).to(DEVICE)
    assert torch.equal(blocked.rows(ids, torch.float32), plain.rows(ids, torch.float32))


@pytest.mark.parametrize("group", [8, 32])
def test_int4_gemm_with_bf16_inputs_makes_bf16_pair_weights(
    group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int4 GEMMs with bf16 x make each weight as code * bf16(scale) + bf16(offset) rounded to
    bf16 once (what the PTX's bf16x2 FMA computes; here Triton's interpreter runs the same
    arithmetic in fp32): equal to that reference, within bf16 error of the exact one, and
    TOKENPIPE_QUANT_BF16_PAIRS=0 is the fp32 dequantization again."""
    from worker.device.kernels import quant_matmul as qm

    monkeypatch.setattr(qm, "PARTIALS_BF16", False)  # the K split's own rounding: next test
    qw = _qw("int4", group, n=72, k=group * 4, seed=2)
    packed = qm.KMajorWeight.pack(qw)
    x = torch.randn(5, group * 4, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    x = x.to(torch.bfloat16)
    codes = Q.unpack_nibbles(qw.qdata).float()
    scales = qw.scales.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
    offsets = qw.offsets.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
    weights = (codes * scales + offsets).to(torch.bfloat16).float()
    got = qm.qgemm(x, packed, (16, 32, 4, 2)).float()
    want = x.float() @ weights.T  # within one bf16 step (the interpreter truncates the output)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)
    exact = x.float() @ qw.dequantize().T
    assert 0 < (got - exact).abs().max() < 0.02 * exact.abs().max()
    monkeypatch.setenv("TOKENPIPE_QUANT_BF16_PAIRS", "0")
    once = qm.qgemm(x.float(), packed, (16, 32, 4, 2))  # fp32: the reference arithmetic
    torch.testing.assert_close(once, exact, rtol=1e-4, atol=1e-4)


def test_gemm_drains_its_wgmma_only_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The K step's ``wgmma.wait_group 0`` (``_wgmma_drain``) is compiled in only where wgmma
    exists (sm_90) and only for tiles of whole warpgroups; TOKENPIPE_QUANT_GEMM_DRAIN=0 turns
    it off. (Its effect, the MMAs no longer serialized by ptxas, shows in the SASS:
    tools/sass_quant_kernels.py --only gemm prints the full waits a loop makes.)"""
    from worker.device.kernels import quant_matmul as qm

    cuda = torch.device("cuda", 0)
    for capability, want in (((9, 0), True), ((8, 0), False), ((10, 0), False)):
        qm._wgmma_drain_on.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        assert qm._wgmma_drain_on(cuda) is want, capability
    qm._wgmma_drain_on.cache_clear()
    monkeypatch.setenv("TOKENPIPE_QUANT_GEMM_DRAIN", "0")
    assert not qm._wgmma_drain_on(cuda)
    qm._wgmma_drain_on.cache_clear()
    monkeypatch.delenv("TOKENPIPE_QUANT_GEMM_DRAIN")
    assert not qm._wgmma_drain_on(torch.device("cpu"))
    qm._wgmma_drain_on.cache_clear()


def test_k_split_partials_are_bf16_for_bf16_x(monkeypatch: pytest.MonkeyPatch) -> None:
    """A K-split GEMM with bf16 x stores its partial sums in bf16 (``PARTIALS_BF16``; summed
    in fp32 by `_reduce_kernel`): unsplit, the same bits as fp32 partials; split 8 ways,
    within a few bf16 steps of them and no further from the exact product (rms); fp32 x
    keeps fp32 partials; TOKENPIPE_QUANT_PARTIALS=fp32 turns it off at import."""
    from worker.device.kernels import quant_matmul as qm

    qw = _qw("int4", 32, n=64, k=32 * 16, seed=12)
    packed = qm.KMajorWeight.pack(qw, torch.bfloat16)
    x = torch.randn(20, 32 * 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    half = x.to(torch.bfloat16)
    exact = half.float() @ qw.dequantize().T
    tile = (8, 32, 2, 2, 1)
    got: dict[tuple[bool, int], torch.Tensor] = {}
    for on in (False, True):
        monkeypatch.setattr(qm, "PARTIALS_BF16", on)
        for split in (1, 8):
            got[on, split] = qm.qgemm(half, packed, tile, split=split).float()
        if on:  # fp32 x: fp32 partials whatever the switch
            fp32 = qm.qgemm(x, qm.KMajorWeight.pack(qw), tile, split=8)
            torch.testing.assert_close(fp32, x @ qw.dequantize().T, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[True, 1], got[False, 1])
    assert not torch.equal(got[True, 8], got[False, 8])  # the partials' rounding shows
    scale = exact.abs().max()
    assert (got[True, 8] - got[False, 8]).abs().max() < 4 * 2**-8 * scale

    def rms(y: torch.Tensor) -> float:
        return float((y - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())

    assert rms(got[True, 8]) < 2.5 * rms(got[False, 8]) < 0.05
    monkeypatch.delenv("TOKENPIPE_QUANT_PARTIALS", raising=False)
    assert qm._partials_bf16()
    monkeypatch.setenv("TOKENPIPE_QUANT_PARTIALS", "fp32")
    assert not qm._partials_bf16()


def test_int4_scales_kept_as_bf16_for_a_bf16_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 weights of a bf16 model keep their scales and offsets as bf16 in the GPU layout
    (``meta_dtype_for``): the GEMM, which rounded them to bf16 anyway, gives the same bits;
    the GEMV equals the reference with bf16-rounded scales. int8, fp32 and fp16 models and
    TOKENPIPE_QUANT_BF16_META=0 keep fp16."""
    from worker.device.kernels import quant_matmul as qm

    bf16 = torch.bfloat16
    assert qm.meta_dtype_for("int4", bf16) == bf16
    for kind, dtype in [("int8", bf16), ("int4", torch.float32), ("int4", torch.float16)]:
        assert qm.meta_dtype_for(kind, dtype) == torch.float16
    qw = _qw("int4", 32, n=72, k=128, seed=9)
    plain, kept = qm.KMajorWeight.pack(qw), qm.KMajorWeight.pack(qw, bf16)
    assert kept.scales.dtype == kept.offsets.dtype == bf16  # type: ignore[union-attr]
    assert kept.nbytes == plain.nbytes
    torch.testing.assert_close(kept.scales, plain.scales.to(bf16), rtol=0, atol=0)
    gen = torch.Generator().manual_seed(2)
    many = torch.randn(5, 128, generator=gen).to(DEVICE).to(bf16)
    tile = (16, 32, 4, 2, 1)
    torch.testing.assert_close(qm.qgemm(many, kept, tile), qm.qgemm(many, plain, tile),
                               rtol=0, atol=0)  # fmt: skip
    one = torch.randn(1, 128, generator=gen).to(DEVICE)
    rounded = Q.QuantizedWeight(qw.kind, qw.shape, qw.group_size, qw.qdata,
                                qw.scales.to(bf16).half(), qw.offsets.to(bf16).half())  # fmt: skip
    torch.testing.assert_close(qm.qgemv(one, kept), one @ rounded.dequantize().T,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert (qm.qgemv(one, kept) - qm.qgemv(one, plain)).abs().max() > 0  # the rounding shows
    monkeypatch.setenv("TOKENPIPE_QUANT_BF16_META", "0")
    assert qm.meta_dtype_for("int4", bf16) == torch.float16


@pytest.mark.parametrize(("kind", "group"), [("int4", 32), ("int8", 16)])
def test_gemm_joined_store_equals_the_per_position_store(
    kind: str, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GEMM's joined store (config field 5: the P accumulators interleaved into
    consecutive outputs, one store) writes the same values to the same outputs as the store
    per code position, with and without a K split, for a partial last word (75 outputs) and
    row counts of each BLOCK_M (16, 32; 40 rows as two row tiles of 32, the same bits as one
    tile of 64)."""
    from worker.device.kernels import quant_matmul as qm

    qw = _qw(kind, group, n=75, k=group * 4, seed=6)
    packed = qm.KMajorWeight.pack(qw)
    for rows in (3, 20, 40):
        x = torch.randn(rows, group * 4, generator=torch.Generator().manual_seed(rows))
        x = x.to(DEVICE)
        want = x @ qw.dequantize().T
        for split in (1, 3):
            apart = qm.qgemm(x, packed, (8, 32, 4, 2), split=split)
            joined = qm.qgemm(x, packed, (8, 32, 4, 2, 1), split=split)
            torch.testing.assert_close(joined, apart, rtol=0, atol=0)
            torch.testing.assert_close(joined, want, rtol=1e-4, atol=1e-4)
            if rows > 32:
                monkeypatch.setattr(qm, "GEMM_BLOCK_M", 64)
                one_tile = qm.qgemm(x, packed, (8, 32, 4, 2, 1), split=split)
                monkeypatch.setattr(qm, "GEMM_BLOCK_M", 32)
                torch.testing.assert_close(one_tile, joined, rtol=0, atol=0)


def test_gemm_config_field_6_sets_the_k_split_program_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(.., joined, programs): K split for about `programs` programs instead of GEMM_PROGRAMS
    (10 word columns in 2 tiles of 8: 6 programs split K in 3)."""
    from worker.device.kernels import quant_matmul as qm

    qw = _qw("int4", 32, n=75, k=128, seed=6)
    packed = qm.KMajorWeight.pack(qw)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    splits: list[int] = []
    reduce = qm._reduce_kernel

    class Spy:
        def __getitem__(self, grid: object) -> object:
            def launch(*args: object, **kwargs: object) -> None:
                splits.append(int(kwargs["SPLIT"]))  # type: ignore[call-overload]
                reduce[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(qm, "_reduce_kernel", Spy())
    got = qm.qgemm(x, packed, (8, 32, 4, 2, 1, 6))
    assert splits == [3]
    torch.testing.assert_close(got, x @ qw.dequantize().T, rtol=1e-4, atol=1e-4)


def test_gemm_row_tiles_that_fill_the_grid_get_a_program_target_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """33-64 rows run as two row tiles; where those tiles alone would take the K split's
    program target unsplit (a 64-row gate_up: 336 tiles for 528), the target counts per row
    tile (GEMM_PROGRAMS_PER_ROW_TILE): 2 row tiles x 2 column tiles for 6 programs split K in
    3, not 1; one row tile (20 rows) keeps 6 // 2 = 3; off, two row tiles run unsplit."""
    from worker.device.kernels import quant_matmul as qm

    qw = _qw("int4", 32, n=75, k=128, seed=6)
    packed = qm.KMajorWeight.pack(qw)
    splits: list[int] = []
    reduce = qm._reduce_kernel

    class Spy:
        def __getitem__(self, grid: object) -> object:
            def launch(*args: object, **kwargs: object) -> None:
                splits.append(int(kwargs["SPLIT"]))  # type: ignore[call-overload]
                reduce[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(qm, "_reduce_kernel", Spy())
    monkeypatch.setattr(qm, "GEMM_BLOCK_M", 32)
    for rows, per_row_tile, want in [(40, True, [3]), (20, True, [3]), (40, False, [])]:
        monkeypatch.setattr(qm, "GEMM_PROGRAMS_PER_ROW_TILE", per_row_tile)
        splits.clear()
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        got = qm.qgemm(x, packed, (8, 32, 4, 2, 1, 6))
        assert splits == want
        torch.testing.assert_close(got, x @ qw.dequantize().T, rtol=1e-4, atol=1e-4)


def test_pack_for_device_routes_layers_and_shares_a_tied_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.device.kernels import quant_matmul as qm

    qw = _qw("int8", 32, n=40, k=64)
    model = torch.nn.ModuleDict({
        "embed": Q.QuantEmbedding(40, 64, Q.QuantFormat("int8", 32), torch.float32),
        "head": Q.QuantLinear.from_weight(qw),
        "odd": Q.QuantLinear.from_weight(_qw("int8", 0, n=8, k=48)),  # stays canonical
    })  # fmt: skip
    model["embed"].quantized = qw  # tied: one table
    want_rows = qw.rows(torch.tensor([3, 1]).to(DEVICE)).dequantize()
    x = torch.randn(3, 64).to(DEVICE)
    want = x @ qw.dequantize().T
    assert Q.pack_for_device(model) == (1, 1)
    head, embed = model["head"], model["embed"]
    assert head.quantized is None and embed.quantized is None
    assert head.device_packed is embed.device_packed is not None
    assert model["odd"].quantized is not None and model["odd"].device_packed is None
    calls: list[int] = []
    real = qm.quant_linear
    monkeypatch.setattr(qm, "quant_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(head(x), want, rtol=1e-4, atol=1e-4)
    assert calls
    torch.testing.assert_close(embed(torch.tensor([3, 1]).to(DEVICE)), want_rows)
    model["odd"](torch.randn(2, 48).to(DEVICE))  # the reference: no kernel call
    assert len(calls) == 1


def test_pack_for_device_drops_each_canonical_copy_before_the_next_pack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Packing holds one weight in two layouts at a time, never the model: int4 Gemma 4 31B
    (19.8 GB) packed with every canonical copy kept until the end needed 2 x its weights and
    ran out under a 24 GiB limit on the H200 (BENCHMARKS, session 27)."""
    from worker.device.kernels import quant_matmul as qm

    shared = _qw("int8", 32, n=40, k=64)
    model = torch.nn.ModuleDict({
        "embed": Q.QuantEmbedding(40, 64, Q.QuantFormat("int8", 32), torch.float32),
        "a": Q.QuantLinear.from_weight(_qw("int4", 32, n=16, k=64)),
        "b": Q.QuantLinear.from_weight(_qw("int4", 32, n=24, k=64)),
        "head": Q.QuantLinear.from_weight(shared),
    })  # fmt: skip
    model["embed"].quantized = shared
    alive: list[int] = []
    real = qm.KMajorWeight.pack

    def pack(qw: Any, *args: Any) -> Any:  # canonical weights held when each pack starts
        alive.append(len({id(m.quantized) for m in model.values() if m.quantized is not None}))
        return real(qw, *args)

    monkeypatch.setattr(qm.KMajorWeight, "pack", staticmethod(pack))
    assert Q.pack_for_device(model) == (3, 0)
    assert alive == [3, 2, 1]  # the tied table counted once, each weight gone once packed
    assert all(m.quantized is None and m.device_packed is not None for m in model.values())
    assert model["embed"].device_packed is model["head"].device_packed


def test_a_weight_without_room_for_a_second_copy_packs_from_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a 24 GB card's limit the 31B's tied 1.5 GB table, packed first, ran out in one
    of two starts (session 47): a weight whose device lacks room for its packed copy leaves
    the device first and packs from a host copy, a chunk of rows at a time, into the same
    layout; the others pack in place; the log says how many moved."""
    from worker.device.kernels import quant_matmul as qm

    def model() -> torch.nn.ModuleDict:
        shared = _qw("int8", 32, n=40, k=64, seed=1)
        m = torch.nn.ModuleDict({
            "embed": Q.QuantEmbedding(40, 64, Q.QuantFormat("int8", 32), torch.float32),
            "a": Q.QuantLinear.from_weight(_qw("int4", 32, n=16, k=64, seed=2)),
            "head": Q.QuantLinear.from_weight(shared),
        })  # fmt: skip
        m["embed"].quantized = shared
        return m

    plain, staged = model(), model()
    assert Q._room_for_a_second_copy(plain["head"].quantized)  # always on the CPU
    assert Q.pack_for_device(plain) == (2, 0)
    devices: list[Any] = []
    real = qm.KMajorWeight.pack

    def pack(qw: Any, *args: Any, device: Any = None) -> Any:
        devices.append(device)
        return real(qw, *args, device=device)

    monkeypatch.setattr(qm.KMajorWeight, "pack", staticmethod(pack))
    monkeypatch.setattr(Q, "_room_for_a_second_copy", lambda qw: qw.shape[0] != 40)
    lines: list[str] = []
    assert Q.pack_for_device(staged, log=lines.append) == (2, 0)
    kinds = [None if d is None else torch.device(d).type for d in devices]
    assert kinds == [torch.device(DEVICE).type, None]  # the table from the host, then "a"
    assert lines == ["cuda_setup: 1 quantized weights packed from a host copy: the device had "
                     "no room for a second copy of each"]  # fmt: skip
    for name in ("a", "head"):
        got, want = staged[name].device_packed, plain[name].device_packed
        for part in ("words", "scales", "offsets"):
            a, b = getattr(got, part), getattr(want, part)
            assert (a is None and b is None) or torch.equal(a, b)
    assert staged["embed"].device_packed is staged["head"].device_packed
    assert all(m.quantized is None for m in staged.values())


def test_quantized_model_logits_kernels_equal_reference() -> None:
    """A tiny model loaded --quantize int4 with random weights: after pack_for_device (the
    CUDA set-up's step) the kernels' logits (prefill and decode rows) equal the reference's."""
    from tiny_models import byte_level_tokenizer_json, tiny_config

    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions
    from worker.models.step import StepInput

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "config.json").write_text(json.dumps(tiny_config("llama", 263)))
        (directory / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
        loaded = load_model(
            directory, DEVICE, torch.float32, random_weights=True, progress=False,
            quantize=QuantizeOptions("int4", 32),
        )  # fmt: skip
    model = loaded.model
    assert isinstance(model.model.embed_tokens, Q.QuantEmbedding)
    prompt = StepInput.single(list(range(5, 14)), 0, 0, device=DEVICE)
    one = StepInput.single([20], 0, 9, device=DEVICE)
    kv = model.make_kv_cache(1, 32)
    slow = [model(prompt, kv), model(one, kv)]
    model.fuse_projections()
    packed, left = Q.pack_for_device(model)
    assert packed > 0 and left == 0
    kv = model.make_kv_cache(1, 32)
    fast = [model(prompt, kv), model(one, kv)]
    for got, want in zip(fast, slow, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_staged_quantized_load_equals_the_plain_one(tiny_checkpoint_factory) -> None:
    """The CUDA load path, run on the CPU: a float checkpoint streamed through transient
    targets (no float copy of a planned weight in the model) quantizes to the same bytes as
    the plain read."""
    from worker.loading.checkpoint import open_checkpoint
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions, begin_load
    from worker.loading.staged_load import StagingConfig, staged_tensors
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    directory = tiny_checkpoint_factory(dtype=torch.bfloat16, shards=2)
    options = QuantizeOptions("int4", 32)
    plain = load_model(directory, "cpu", torch.float32, progress=False, quantize=options).model
    checkpoint = open_checkpoint(directory)
    model = build_model(ModelConfig.from_hf(checkpoint.config), "meta", torch.float32)
    load = begin_load(model, options, None, torch.device("cpu"), torch.float32)
    assert load is not None
    model = model.to_empty(device="cpu")
    transient = load.transient_names(model)
    assert "model.layers.0.mlp.up_proj.weight" in transient
    targets = model.state_dict(keep_vars=True)
    assert not set(transient) & set(targets)  # no float storage for a planned weight
    config = StagingConfig(buffer_bytes=1000, buffers=3, readers=2)  # tensors cut in pieces
    pairs = staged_tensors(checkpoint.text_tensors(), targets, config, transient, "cpu")
    report = model.load_weights(pairs)
    assert not report.missing and not report.unexpected
    want = dict(plain.named_modules())
    for name, module in model.named_modules():
        if isinstance(module, (Q.QuantLinear, Q.QuantEmbedding)):
            mine, theirs = module.quantized, want[name].quantized  # type: ignore[union-attr]
            assert mine is not None and theirs is not None
            assert torch.equal(mine.qdata, theirs.qdata), name
            assert torch.equal(mine.scales, theirs.scales), name


def test_transient_targets_need_a_device(tiny_checkpoint_factory) -> None:
    from worker.loading.checkpoint import open_checkpoint
    from worker.loading.staged_load import staged_tensors

    checkpoint = open_checkpoint(tiny_checkpoint_factory())
    entries = checkpoint.text_tensors()
    transient = dict.fromkeys(entries, torch.float32)
    with pytest.raises(ValueError, match="device"):
        list(staged_tensors(entries, {}, None, transient))
    loaded = dict(staged_tensors(entries, {}, None, transient, torch.device("cpu")))
    assert set(loaded) == set(entries)
    assert not any(t.is_meta for t in loaded.values())


def test_tiles_chosen_per_matrix_shape() -> None:
    """choose_configs keeps the fastest candidate by the timer (a fake one here: the CUDA
    graph timer needs a GPU) on every weight of a shape, each shape timed once."""
    from worker.device.kernels import quant_matmul as qm

    weights = [qm.KMajorWeight.pack(_qw("int4", 32, n=40, k=256, seed=s)) for s in (0, 1)]
    other = qm.KMajorWeight.pack(_qw("int8", 32, n=24, k=128))
    timed: list[object] = []

    def timer(fn: object) -> float:
        fn()  # type: ignore[operator]
        timed.append(fn)
        return float(len(timed) % 3)  # the candidate timed third, sixth, ... wins ties first

    assert qm.choose_configs([*weights, other], torch.float32, timer) == 2
    assert weights[0].gemv_config == weights[1].gemv_config == qm.GEMV_CANDIDATES[2]
    assert weights[0].gemm_config in qm.GEMM_CANDIDATES and other.gemv_config is not None
    x = torch.randn(1, 256).to(DEVICE)
    torch.testing.assert_close(
        qm.quant_linear(x, weights[0]), x @ _qw("int4", 32, 40, 256).dequantize().T,
        rtol=1e-4, atol=1e-4,
    )  # fmt: skip


def test_tiles_are_timed_over_the_models_matrices_of_a_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each candidate is timed over the matrices of its shape in turn, as many as make 200 MB
    (``_past_l2``), so no call finds its weight in L2 as a lone matrix would (a decode step
    reads each once); a shape with one matrix is timed on it."""
    from worker.device.kernels import quant_matmul as qm

    weights = [qm.KMajorWeight.pack(_qw("int4", 32, n=40, k=256, seed=s)) for s in range(3)]
    lone = qm.KMajorWeight.pack(_qw("int8", 32, n=24, k=128))
    assert qm._past_l2(weights, enough=2 * weights[0].nbytes) == weights[:2]
    assert qm._past_l2(weights, enough=1) == weights[:1]
    seen: list[list[int]] = []
    calls: list[int] = []
    gemv, gemm = qm.qgemv, qm.qgemm

    def spy(real):  # type: ignore[no-untyped-def]
        def run(x, w, c=None, split=None):  # type: ignore[no-untyped-def]
            calls.append(id(w))
            return real(x, w, c, split)

        return run

    monkeypatch.setattr(qm, "qgemv", spy(gemv))
    monkeypatch.setattr(qm, "qgemm", spy(gemm))
    monkeypatch.setattr(qm, "GEMV_CANDIDATES", qm.GEMV_CANDIDATES[:1])
    monkeypatch.setattr(qm, "GEMM_CANDIDATES", qm.GEMM_CANDIDATES[:1])

    def timer(fn: object) -> float:
        calls.clear()
        fn()  # type: ignore[operator]
        seen.append(list(calls))
        return 1.0

    assert qm.choose_configs([*weights, lone], torch.float32, timer) == 2
    ids = [id(w) for w in weights]
    assert seen == [ids, ids, [id(lone)], [id(lone)]]


@pytest.mark.parametrize(("kind", "group"), [("int4", 32), ("int8", 16)])
def test_l2_prefetch_fields_leave_the_results_as_they_were(kind: str, group: int) -> None:
    """GEMV field 6 and GEMM field 7 (prefetch into L2 some steps ahead: hints) give the same
    bits as the same tile without them, with and without a K split, at distances past a
    program's last step too (masked). Triton's interpreter runs no PTX and drops the fields,
    so on the CPU this checks the configs are read; on CUDA the prefetching kernels run."""
    from worker.device.kernels import quant_matmul as qm

    qw = _qw(kind, group, n=75, k=group * 7, seed=3)
    packed = qm.KMajorWeight.pack(qw)
    one = torch.randn(1, group * 7, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want = one @ qw.dequantize().T
    for split in (1, 3):
        for tile in ((8, 1, 1, 8, 4), (16, 1, 2, 4, 2)):
            plain = qm.qgemv(one, packed, tile, split=split)
            torch.testing.assert_close(plain, want, rtol=1e-4, atol=1e-4)
            for ahead in (2, 9):
                got = qm.qgemv(one, packed, (*tile, ahead), split=split)
                torch.testing.assert_close(got, plain, rtol=0, atol=0)
    many = torch.randn(20, group * 7, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for split in (1, 3):
        plain = qm.qgemm(many, packed, (8, 32, 4, 2, 1), split=split)
        torch.testing.assert_close(plain, many @ qw.dequantize().T, rtol=1e-4, atol=1e-4)
        for ahead in (4, 9):
            got = qm.qgemm(many, packed, (8, 32, 4, 2, 1, 0, ahead), split=split)
            torch.testing.assert_close(got, plain, rtol=0, atol=0)


def test_tile_choices_are_remembered(tmp_path: Path) -> None:
    from worker.device.kernels import quant_matmul as qm

    cache = tmp_path / "tiles.json"
    weight = qm.KMajorWeight.pack(_qw("int4", 32, n=40, k=256))
    calls: list[int] = []

    def timer(fn: object) -> float:
        fn()  # type: ignore[operator]
        calls.append(1)
        return float(len(calls))  # the first candidate wins

    assert qm.choose_configs([weight], torch.float32, timer, cache, "gpu A", remember=False) == 1
    assert not cache.exists()  # a trace run (worker/device/cuda_setup.py) leaves no choices
    assert qm.choose_configs([weight], torch.float32, timer, cache, "gpu A") == 1
    timed = len(calls)
    again = qm.KMajorWeight.pack(_qw("int4", 32, n=40, k=256))
    assert qm.choose_configs([again], torch.float32, timer, cache, "gpu A") == 0
    assert len(calls) == timed  # nothing timed: read back
    assert again.gemv_config == qm.GEMV_CANDIDATES[0] and again.gemm_config == qm.GEMM_CANDIDATES[0]
    assert qm.choose_configs([again], torch.float32, timer, cache, "gpu B") == 1  # another GPU
    cache.write_text("{not json")
    assert qm.choose_configs([again], torch.float32, timer, cache, "gpu A") == 1  # damaged: again


def test_cuda_refuses_groups_its_kernels_cannot_take() -> None:
    """Checked from the plan, before any weight (or CUDA) is touched."""
    from tiny_models import tiny_config

    from worker.loading.checkpoint import ModelLoadError
    from worker.loading.quantize import QuantizeOptions, begin_load
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    config = ModelConfig.from_hf(
        tiny_config("llama", 263, hidden_size=96, intermediate_size=192, head_dim=24)
    )
    model = build_model(config, "meta", torch.float32)
    with pytest.raises(ModelLoadError, match="power of two"):
        begin_load(model, QuantizeOptions("int4", 48), None, torch.device("cuda"), torch.float32)
    model = build_model(config, "meta", torch.float32)  # the CPU takes group 48
    assert begin_load(model, QuantizeOptions("int4", 48), None, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_split_sum_and_activation_in_one_kernel(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``qgemm_gated`` (the K-split partials summed and act(gate) * up made in one kernel)
    gives the bits of ``qgemm`` then ``gated_act_triton``, split or not; the layer asks for it
    only with ``GATED_SUM`` on and rows that take the GEMM; and a quantized GatedMLP's output
    keeps its bits either way."""
    from tiny_models import tiny_config

    from worker.device.kernels import quant_matmul as qm
    from worker.device.kernels.rmsnorm import gated_act_triton
    from worker.layers.blocks import GatedMLP
    from worker.models.config import ModelConfig

    qw = _qw("int4", 32, n=2 * 40, k=32 * 4, seed=9)
    packed = qm.KMajorWeight.pack(qw)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    for act in ("silu", "gelu_pytorch_tanh"):
        for split in (1, 3):
            y = qm.qgemm(x, packed, (8, 32, 4, 2, 1), split=split)
            want = gated_act_triton(y[:, :40], y[:, 40:], act)
            got = qm.qgemm_gated(x, packed, act, (8, 32, 4, 2, 1), split=split)
            assert got.shape == (20, 40) and got.dtype == dtype
            assert torch.equal(got, want), (act, split)
    monkeypatch.setattr(qm, "GATED_SUM", False)
    assert qm.quant_linear_gated(x, packed, "silu") is None
    monkeypatch.setattr(qm, "GATED_SUM", True)
    assert qm.quant_linear_gated(x[:1], packed, "silu") is None  # one row: the GEMV's
    assert qm.quant_linear_gated(x, packed, "relu") is None  # no fused activation
    y = qm.quant_linear(x, packed)
    fused = qm.quant_linear_gated(x, packed, "silu")
    assert fused is not None and torch.equal(fused, gated_act_triton(y[:, :40], y[:, 40:], "silu"))

    # the layer: gate and up quantized and fused into one gate_up, down in float
    monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")  # the unfused path's activation in Triton
    config = ModelConfig.from_hf(tiny_config("llama", 300, hidden_size=128, intermediate_size=64))
    mlp = GatedMLP(config).to(DEVICE, dtype)
    gen = torch.Generator().manual_seed(4)
    for name in ("gate_proj", "up_proj"):
        weight = torch.randn(64, 128, generator=gen) * 0.05
        part = Q.quantize(weight, Q.QuantFormat("int4", 32), search=False).to(DEVICE)
        setattr(mlp, name, Q.QuantLinear.from_weight(part))
    mlp.fuse_projections()
    assert isinstance(mlp.gate_up_proj, Q.QuantLinear) and mlp.gate_up_proj.quantized is not None
    mlp.gate_up_proj.device_packed = qm.KMajorWeight.pack(mlp.gate_up_proj.quantized)
    calls: list[int] = []
    gated = qm.qgemm_gated

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return gated(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(qm, "qgemm_gated", counted)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(qm, "GATED_SUM", on)
        outs.append(mlp(x))
        assert len(calls) == int(on)
    assert torch.equal(outs[0], outs[1])
