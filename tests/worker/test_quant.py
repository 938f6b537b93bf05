"""Quantized formats (worker/layers/quant.py), GGUF repacking (worker/loading/gguf_quant.py),
the CPU kernel (worker/device/cpu_quant.py) and the load-time plan (worker/loading/quantize.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from worker.device import cpu_gemv, cpu_quant
from worker.layers import quant as Q
from worker.loading.checkpoint import ModelLoadError
from worker.loading.quantize import QuantizeOptions

needs_kernel = pytest.mark.skipif(not cpu_quant.available(), reason="no CPU kernel")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group", [0, 16, 32, 128])
def test_int8_round_trip(group: int) -> None:
    w = _weight(48, 256)
    qw = Q.quantize_int8(w, group)
    g = group or 256
    assert qw.qdata.dtype == torch.int8 and qw.scales.shape == (48, 256 // g)
    # error at most half a step per weight, plus the fp16 rounding of the scale
    step = qw.scales.float().repeat_interleave(g, dim=1)
    assert bool(((Q.dequantize(qw) - w).abs() <= 0.5 * step * (1 + 1e-3) + 1e-7).all())
    assert torch.equal(Q.quantize_int8(Q.dequantize(qw), group).qdata, qw.qdata)  # a fixed point


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip(group: int) -> None:
    w = _weight(32, 256, seed=1)
    qw = Q.quantize_int4(w, group, search=False)  # the searched fit may clip: see below
    assert qw.qdata.shape == (32, 128) and qw.offsets is not None
    assert torch.equal(Q.unpack_nibbles(qw.qdata).max(), torch.tensor(15, dtype=torch.uint8))
    step = qw.scales.float().repeat_interleave(group, dim=1)
    err = (Q.dequantize(qw) - w).abs()
    assert bool((err <= 0.5 * step + 2e-3 * w.abs().max()).all())  # + fp16 scale/offset


def test_bad_group_size_names_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"'blk'.*group size 48 does not divide.*640"):
        Q.QuantFormat(Q.INT4, 48).check("blk", (16, 640))
    with pytest.raises(ValueError, match="--quantize must be one of"):
        QuantizeOptions("int3")


def test_concat_and_rows() -> None:
    a, b = Q.quantize_int4(_weight(16, 64), 32), Q.quantize_int4(_weight(32, 64, 2), 32)
    both = Q.concat([a, b])
    assert both is not None and both.shape == (48, 64)
    assert torch.equal(Q.dequantize(both), torch.cat([Q.dequantize(a), Q.dequantize(b)]))
    assert Q.concat([a, Q.quantize_int8(_weight(16, 64), 32)]) is None
    ids = torch.tensor([3, 40, 0])
    assert torch.equal(Q.dequantize(both.rows(ids)), Q.dequantize(both)[ids])


# ---- GGUF blocks: our repack against the gguf package's own dequantize


def _blocks(type_name: str, rows: int, k: int) -> np.ndarray:
    """Random but valid blocks: random bytes with sane fp16 scale fields."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    halves = {"Q4_K": [0, 2], "Q6_K": [208], "Q8_0": [0], "Q5_0": [0], "Q4_0": [0],
              "Q4_1": [0, 2]}[type_name]  # fmt: skip
    for at in halves:
        scale = rng.uniform(1e-3, 2e-2, len(raw)).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "Q4_1"])
def test_gguf_repack_matches_gguf_dequantize(type_name: str) -> None:
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from worker.loading.gguf_quant import KEPT_FORMATS, repack

    raw = _blocks(type_name, 16, 512)
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).reshape(16, 512))
    qw = repack(type_name, raw, (16, 512))
    assert qw.format == KEPT_FORMATS[type_name]
    got = Q.dequantize(qw)
    if type_name in ("Q8_0", "Q5_0", "Q4_0", "Q4_1"):
        # d * q (+ m): d and m are fp16 already and -8 d is exact, so the one fp32 rounding
        # of the sum is the gguf package's own
        assert torch.equal(got, expected)
    else:  # d * sc (and dmin * m) rounded to fp16: 2^-11 relative per product
        assert torch.allclose(got, expected, rtol=0, atol=float(expected.abs().max()) * 2**-10)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "Q4_1"])
def test_gguf_block_dequantize_matches_gguf_dequantize(type_name: str) -> None:
    """The torch dequantization a float load of a GGUF uses on a GPU (run here on the CPU): the
    gguf package's values, fp32 scale products and all, a chunk of rows at a time."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from worker.loading import gguf_quant

    raw = _blocks(type_name, 16, 512)
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).reshape(16, 512))
    chunk = gguf_quant.REPACK_CHUNK_BYTES
    try:
        gguf_quant.REPACK_CHUNK_BYTES = raw.shape[1] * 3  # 3 rows a chunk: 6 chunks, a short one
        got = gguf_quant.dequantize_blocks(type_name, raw, (16, 512), torch.device("cpu"),
                                           torch.float32)  # fmt: skip
    finally:
        gguf_quant.REPACK_CHUNK_BYTES = chunk
    torch.testing.assert_close(
        got, expected, rtol=2**-20, atol=float(expected.abs().max()) * 2**-22
    )


# ---- the CPU kernel against the torch reference


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("kind, group", [("int8", 16), ("int8", 32), ("int8", 0), ("int4", 32),
                                         ("int4", 128)])  # fmt: skip
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n", [16, 48, 1040])
def test_kernel_matches_reference(kind: str, group: int, rows: int, n: int, threads: int) -> None:
    k = 256
    w = _weight(n, k, seed=n)
    qw = Q.quantize_int8(w, group) if kind == "int8" else Q.quantize_int4(w, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    reference = Q.dequantize(qw).double()
    out = cpu_quant.matmul(x, cpu_quant.pack(qw))
    # tolerance: a float32 sum of K products (the kernel's dequantized weight may differ from
    # the reference's by one rounding: an FMA for int4)
    bound = 2 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ reference.abs().T)
    assert bool(((out.double() - x.double() @ reference.T).abs() <= bound + 1e-6).all())


@needs_kernel
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_kernel_same_bits_at_any_thread_count(kind: str) -> None:
    w = _weight(4096, 640, seed=3)
    qw = Q.quantize_int8(w, 32) if kind == "int8" else Q.quantize_int4(w, 32)
    packed = cpu_quant.pack(qw)
    x = torch.randn(3, 640)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_quant.matmul(x, packed)
        torch.set_num_threads(2)
        two = cpu_quant.matmul(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("n", [64, 128, 176, 272])  # blocks of eight tiles, full and partial
def test_packed_rows_and_unpack(kind: str, n: int) -> None:
    w = _weight(n, 96)
    qw = Q.quantize_int8(w, 32) if kind == "int8" else Q.quantize_int4(w, 32)
    packed = cpu_quant.pack(qw)
    ids = torch.tensor([n - 1, 0, 17, 17, n // 2 + 3, n - 20])
    assert torch.equal(cpu_quant.packed_rows(packed, ids), Q.dequantize(qw)[ids])
    back = cpu_quant.unpack(packed)
    assert torch.equal(back.qdata, qw.qdata) and torch.equal(back.scales, qw.scales)
    assert torch.equal(Q.dequantize(back), Q.dequantize(qw))


def test_packed_rows_rejects_ids_out_of_range() -> None:
    packed = cpu_quant.pack(Q.quantize_int8(_weight(32, 64), 32))
    for bad in ([32], [0, -1]):
        with pytest.raises(IndexError):
            cpu_quant.packed_rows(packed, torch.tensor(bad))


def test_packed_layout_interleaves_eight_tiles_in_32_byte_units() -> None:
    """The layout the kernels read (worker/device/cpu_quant.py): 32-byte units of eight tiles'
    streams in turn, so a one-row matmul over eight tiles reads memory in order."""
    n, k = 16 * 9, 64  # one block of eight tiles, then a block of one
    codes = torch.arange(n * k, dtype=torch.int64).reshape(n, k)
    qw = Q.QuantizedWeight(Q.INT8, (n, k), 32, (codes % 251 - 125).to(torch.int8),
                           torch.ones(n, 2, dtype=torch.float16))  # fmt: skip
    data = cpu_quant.pack(qw).data
    tiles = qw.qdata.reshape(9, 16, k).transpose(1, 2).reshape(9, k * 16)  # each tile's stream
    assert torch.equal(data[:32], tiles[0, :32]) and torch.equal(data[32:64], tiles[1, :32])
    assert torch.equal(data[7 * 32 : 8 * 32], tiles[7, :32])
    assert torch.equal(data[8 * 32 : 9 * 32], tiles[0, 32:64])
    assert torch.equal(data[8 * k * 16 :], tiles[8])  # the last block holds one tile


def test_quant_linear_reference_and_kernel_agree() -> None:
    layer = Q.QuantLinear(96, 32, Q.QuantFormat(Q.INT8, 32), bias=True)
    layer.load(_weight(32, 96))
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(2, 96)
    reference = layer(x)
    if cpu_quant.available():
        layer.cpu_packed = cpu_quant.pack(layer.quantized)
        # int16 activations (the default on VNNI CPUs) round the input to 2^-15 of each
        # group's largest value: about 1e-4 here; fp32 activations agree to 1e-5
        atol = 1e-5 if cpu_quant.ACTIVATION_BITS == 32 else 5e-4
        assert torch.allclose(layer(x), reference, atol=atol)


@pytest.mark.parametrize("kind", [Q.INT8, Q.INT4])
def test_scale_search_beats_round_to_nearest(kind: str) -> None:
    w = _weight(64, 256, seed=3)
    fmt = Q.QuantFormat(kind, 32)
    searched = Q.dequantize(Q.quantize(w, fmt)) - w
    nearest = Q.dequantize(Q.quantize(w, fmt, search=False)) - w
    # per group never worse (the round-to-nearest candidate is among the searched ones) ...
    searched_groups = searched.square().reshape(64, 8, 32).sum(-1)
    nearest_groups = nearest.square().reshape(64, 8, 32).sum(-1)
    assert bool((searched_groups <= nearest_groups * (1 + 1e-5) + 1e-12).all())
    # ... and better overall on Gaussian weights (measured: -20% squared error for both kinds)
    assert float(searched.square().sum()) < 0.9 * float(nearest.square().sum())


def test_int8_search_finds_a_coarser_grid_exactly() -> None:
    # a dequantized 5-bit GGUF tensor (Q5_0: d * q, q in [-16, 15]): amax / 127 does not land
    # on its grid, but one of the candidate scales (d / 7 here) does
    gen = torch.Generator().manual_seed(4)
    d = (torch.rand(32, 8, 1, generator=gen) * 0.01 + 0.001).half().float()
    codes = torch.randint(-16, 16, (32, 8, 32), generator=gen).float()
    codes[:, :, 0] = -16
    w = (codes * d).reshape(32, 256)
    assert float((Q.dequantize(Q.quantize_int8(w, 32)) - w).abs().max()) == 0.0
    assert float((Q.dequantize(Q.quantize_int8(w, 32, search=False)) - w).abs().max()) > 0.0


def _int_activations(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """x [1, K] quantized per group (amax / (2^(bits-1) - 1)) and back, as the VNNI kernels do."""
    grouped = x.reshape(-1, group)
    scale = grouped.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(grouped / safe) * scale).reshape(x.shape)


def _has_integer_kernel() -> bool:
    lib = cpu_gemv.kernel()
    assert lib is not None
    w = cpu_quant.pack(Q.quantize_int8(_weight(16, 32, seed=1), 32))
    x, out = torch.zeros(1, 32), torch.empty(1, 16)
    status = lib.tp_quant_gemm_a16(
        1, x.data_ptr(), w.data.data_ptr(), w.scales.data_ptr(), None, out.data_ptr(), 32, 16,
        32, 1,
    )  # fmt: skip
    return status != 2


@needs_kernel
@pytest.mark.parametrize(("kind", "bits"), [("int8", 8), ("int8", 16), ("int4", 16)])
@pytest.mark.parametrize(("n", "k", "group"), [(256, 640, 32), (640, 2048, 16), (48, 128, 128)])
def test_matmul_with_integer_activations(
    monkeypatch: pytest.MonkeyPatch, n: int, k: int, group: int, kind: str, bits: int
) -> None:
    """Integer activations (16: the default where the CPU has AVX512-VNNI; 8: int8 weights at one
    row): the result is the reference on the per-group quantized input, and a row's result
    does not depend on the rows beside it or on the thread count."""
    if not _has_integer_kernel():
        pytest.skip("kernel built without AVX512-VNNI/VBMI")
    w = _weight(n, k, seed=5)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(6))
    x[:, 3] = 40.0  # an outlier channel, as Gemma's residual stream has
    qw = Q.quantize_int8(w, group) if kind == "int8" else Q.quantize_int4(w, group)
    packed = cpu_quant.pack(qw)
    monkeypatch.setattr(cpu_quant, "ACTIVATION_BITS", bits)
    rows = 1 if bits == 8 else 6  # q8: one-row matmuls only (more rows take the int16 kernel)
    expected = _int_activations(x[:rows], group, bits) @ Q.dequantize(qw).T
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = cpu_quant.matmul(x[:rows], packed)
            assert float((out - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
            alone = torch.cat([cpu_quant.matmul(x[i : i + 1], packed) for i in range(rows)])
            assert torch.equal(alone, out)
    finally:
        torch.set_num_threads(before)


def test_int4_mixed_plan_keeps_the_sensitive_matmuls_int8() -> None:
    """int4-mixed: every v_proj and the down_proj of Q4_K_M's more-bits layers int8, the rest
    int4; plain int4 stays int4 everywhere (the memory and speed targets' format)."""
    from tiny_models import tiny_config

    from worker.loading.quantize import keeps_int8, plan_for_model
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    more_bits = [i for i in range(18) if keeps_int8(f"model.layers.{i}.mlp.down_proj", 18)]
    assert more_bits == [0, 1, 4, 7, 10, 13, 15, 16, 17]  # the default model's Q6_K layers
    assert keeps_int8("model.layers.5.self_attn.v_proj", 18)
    assert not keeps_int8("model.layers.5.mlp.gate_proj", 18)
    assert not keeps_int8("model.layers.3.mlp.experts", 18)

    config = ModelConfig.from_hf(tiny_config("llama", 300, num_hidden_layers=8))
    model = build_model(config, "meta", torch.float32)
    mixed = plan_for_model(model, QuantizeOptions("int4-mixed"))
    plain = plan_for_model(model, QuantizeOptions("int4"))
    assert mixed.keys() == plain.keys()
    assert {f.kind for f in plain.values() if f.group_size == 32} == {"int4", "int8"}
    int8 = sorted(name for name, fmt in mixed.items() if fmt.kind == "int8")
    assert int8 == sorted(
        ["lm_head", "model.embed_tokens"]
        + [f"model.layers.{i}.self_attn.v_proj" for i in range(8)]
        + [f"model.layers.{i}.mlp.down_proj" for i in (0, 3, 6, 7)]
    )
    assert all(plain[name].kind == "int4" for name in plain if name.startswith("model.layers."))


def test_int4_importance_weights_the_fit_by_input_channel() -> None:
    """A channel of large importance gets a smaller error; uniform importance is the plain fit."""
    w = _weight(64, 128, seed=3)
    importance = torch.ones(128)
    importance[5::32] = 1000.0  # one heavy input channel per group
    plain = Q.quantize_int4(w, 32)
    weighted = Q.quantize_int4(w, 32, importance=importance)
    uniform = Q.quantize_int4(w, 32, importance=torch.full((128,), 7.0))
    assert torch.equal(Q.dequantize(uniform), Q.dequantize(plain))

    def error(qw: Q.QuantizedWeight) -> tuple[float, float]:
        squared = (Q.dequantize(qw) - w).square()
        return float(squared[:, 5::32].sum()), float((squared * importance).sum())

    (heavy_plain, total_plain), (heavy_weighted, total_weighted) = error(plain), error(weighted)
    assert heavy_weighted < 0.25 * heavy_plain and total_weighted < 0.5 * total_plain
    with pytest.raises(ValueError, match="importance of shape"):
        Q.quantize_int4(w, 32, importance=torch.ones(64))


def test_set_importance_names_a_wrong_shape(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from tiny_models import tiny_config

    from worker.loading.quantize import install, plan_for_model, set_importance
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    model = build_model(ModelConfig.from_hf(tiny_config("llama", 300)), "meta", torch.float32)
    install(model, plan_for_model(model, QuantizeOptions("int4-mixed")))
    path = tmp_path / "importance.safetensors"
    save_file({"model.layers.0.mlp.up_proj": torch.ones(64), "other": torch.ones(3)}, str(path))
    assert set_importance(model, str(path)) == 1
    assert model.get_submodule("model.layers.0.mlp.up_proj").importance is not None
    save_file({"model.layers.1.self_attn.q_proj": torch.ones(8)}, str(path))
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.q_proj' has shape \[8\]"):
        set_importance(model, str(path))
    assert set_importance(model, str(path), strict=False) == 0  # the shipped file: plain fit


def test_int4_mixed_with_importance_loads_and_runs_the_device_kernels(
    tiny_checkpoint_factory: Any, triton_ready: None, tmp_path: Path
) -> None:
    """A float checkpoint loaded --quantize int4-mixed --quant-importance: the importance
    changes the int4 layers' codes as they load, v_proj stays int8, and after the CUDA set-up's
    steps (fuse, pack_for_device; Triton's interpreter here) the kernels' logits equal the
    reference's (q/k int4 and v int8 are not fused)."""
    from safetensors.torch import save_file

    from worker.loading.loader import load_model
    from worker.models.step import StepInput

    directory = tiny_checkpoint_factory(config_overrides={"num_hidden_layers": 2})
    importance = {
        f"model.layers.{i}.{name}": torch.rand(k, generator=torch.Generator().manual_seed(i)) ** 8
        for i in range(2)
        for name, k in [("self_attn.q_proj", 64), ("self_attn.k_proj", 64),
                        ("self_attn.o_proj", 64), ("mlp.gate_proj", 64), ("mlp.up_proj", 64),
                        ("mlp.down_proj", 128)]
    }  # fmt: skip
    path = tmp_path / "importance.safetensors"
    save_file(importance, str(path))

    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on the CPU

    def load(file: str | None) -> Any:
        options = QuantizeOptions("int4-mixed", 32, file)
        return load_model(directory, device, torch.float32, progress=False, quantize=options).model

    plain, model = load(None), load(str(path))
    up, plain_up = model.model.layers[0].mlp.up_proj, plain.model.layers[0].mlp.up_proj
    assert up.format.kind == "int4" and up.importance is not None
    assert not torch.equal(up.quantized.dequantize(), plain_up.quantized.dequantize())
    assert model.model.layers[0].self_attn.v_proj.format.kind == "int8"
    prompt = StepInput.single(list(range(5, 14)), 0, 0, device=device)
    one = StepInput.single([20], 0, 9, device=device)
    kv = model.make_kv_cache(1, 32)
    slow = [model(prompt, kv), model(one, kv)]
    model.fuse_projections()
    assert model.model.layers[0].self_attn.qkv_proj is None  # int4 q/k, int8 v
    packed, left = Q.pack_for_device(model)
    assert packed > 0 and left == 0
    kv = model.make_kv_cache(1, 32)
    fast = [model(prompt, kv), model(one, kv)]
    for got, want in zip(fast, slow, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_importance_file_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--quant-importance: a file, "none" (the plain fit), or by default the shipped file for
    int4 of the default model only; a missing file is a clear error."""
    from worker.loading import quantize

    gguf = tmp_path / "model.gguf"
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"")
    shipped = str(quantize.SHIPPED_IMPORTANCE)
    assert quantize.SHIPPED_IMPORTANCE.is_file()
    monkeypatch.setattr(quantize, "_is_default_model", lambda path: path == gguf)
    choice = quantize.importance_file
    assert choice(QuantizeOptions("int4"), gguf) == shipped
    assert choice(QuantizeOptions("int4-mixed"), gguf) == shipped
    assert choice(QuantizeOptions("int4"), tmp_path / "other.gguf") is None
    assert choice(QuantizeOptions("int4"), None) is None
    assert choice(QuantizeOptions("int8"), gguf) is None
    assert choice(QuantizeOptions("int4", 32, "none"), gguf) is None
    assert choice(QuantizeOptions("int4", 32, str(mine)), None) == str(mine)
    with pytest.raises(ValueError, match="--quant-importance: no file"):
        QuantizeOptions("int4", 32, str(tmp_path / "missing.safetensors"))


def test_input_scales_fold_into_the_layers_that_feed_them(
    tiny_checkpoint_factory: Any, tmp_path: Path
) -> None:
    """Activation-aware scales in an importance file (``"<module>.input_scale"``): the scaled
    layers store their weight times the scales (columns), the norms before attention and the
    MLP and the up projection's rows divide by them, so the model computes what the float
    model does up to int4's rounding (a fold left out would be off by the scales, 0.25-4x);
    scales that q/k/v do not share are refused, naming the norm."""
    from safetensors.torch import save_file

    from worker.loading.loader import load_model
    from worker.models.step import StepInput

    directory = tiny_checkpoint_factory(config_overrides={"num_hidden_layers": 2})
    generator = torch.Generator().manual_seed(7)
    stats = {}
    for i in range(2):
        attn, mlp, down = (
            4.0 ** (2 * torch.rand(k, generator=generator) - 1) for k in (64, 64, 128)
        )
        for name, scale in [("self_attn.q_proj", attn), ("self_attn.k_proj", attn),
                            ("self_attn.v_proj", attn), ("mlp.gate_proj", mlp),
                            ("mlp.up_proj", mlp), ("mlp.down_proj", down)]:  # fmt: skip
            stats[f"model.layers.{i}.{name}.input_scale"] = scale.clone()
    path = tmp_path / "scales.safetensors"
    save_file(stats, str(path))

    def load(mode: str, file: str | None) -> Any:
        options = QuantizeOptions(mode, 32, file)
        return load_model(directory, "cpu", torch.float32, progress=False, quantize=options).model

    reference, plain, scaled = load("none", None), load("int4", "none"), load("int4", str(path))
    layer, float_layer = scaled.model.layers[0], reference.model.layers[0]
    attn = stats["model.layers.0.self_attn.q_proj.input_scale"]
    norm, float_norm = layer.input_layernorm.weight, float_layer.input_layernorm.weight
    torch.testing.assert_close(norm, float_norm / attn)  # llama's norm: offset 0
    up, down = layer.mlp.up_proj, layer.mlp.down_proj
    down_scale = stats["model.layers.0.mlp.down_proj.input_scale"]
    assert up.row_divisor is not None and torch.equal(up.row_divisor, down_scale)
    pairs = [(down, float_layer.mlp.down_proj.weight), (up, float_layer.mlp.up_proj.weight)]
    for module, float_weight in pairs:
        rows = 1.0 if module is down else down_scale[:, None]
        weight = float_weight / rows
        stored = module.quantized.dequantize()
        # int4 of these random weights: ~8% plain, more where a column was scaled down
        assert float((stored / module.input_scale - weight).norm() / weight.norm()) < 0.4
        assert float((stored - weight).norm() / weight.norm()) > 0.8  # stored scaled
    prompt = StepInput.single(list(range(5, 14)), 0, 0)

    def logits(model: Any) -> torch.Tensor:
        return model(prompt, model.make_kv_cache(1, 32))

    want = logits(reference)
    plain_error = float((logits(plain) - want).norm() / want.norm())
    scaled_error = float((logits(scaled) - want).norm() / want.norm())
    assert scaled_error < 3 * plain_error + 0.02, (scaled_error, plain_error)

    stats["model.layers.1.self_attn.k_proj.input_scale"] = torch.ones(64)
    save_file(stats, str(path))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.input_layernorm.*share one input"):
        load("int4", str(path))


def test_gptq_tool_spreads_the_error_over_the_later_columns() -> None:
    """tools/quant_gptq.py's GPTQ (an analysis tool): on inputs with correlated channels it
    gives a smaller output error over those inputs than the same static groups rounded to
    nearest, and with a diagonal H (nothing to spread) it is that rounding."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import quant_gptq

    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(48, 128, generator=generator)
    # [T, K]: inputs near a 32-dimensional subspace, their channels strongly correlated
    x = torch.randn(512, 32, generator=generator) @ torch.randn(32, 128, generator=generator)
    x = x + 0.1 * torch.randn(512, 128, generator=generator)
    hessian = (x.T @ x).double()

    def nearest(h: torch.Tensor) -> torch.Tensor:
        scale, offset = quant_gptq.group_params(weight.double(), torch.diag(h).float())
        grouped = weight.double().reshape(48, 4, 32)
        s, o = scale[..., None], offset[..., None]
        return (torch.round((grouped - o) / s).clamp(0, 15) * s + o).reshape(48, 128).float()

    def error(q: torch.Tensor) -> float:
        return float((x @ (q - weight).T).square().sum())

    for act_order in (False, True):  # measured: 0.22x and 0.14x
        assert error(quant_gptq.gptq(weight, hessian, 0.01, act_order)) < 0.5 * error(
            nearest(hessian)
        )
    diagonal = torch.diag(torch.diag(hessian))
    torch.testing.assert_close(quant_gptq.gptq(weight, diagonal, 0.0, False), nearest(diagonal))
