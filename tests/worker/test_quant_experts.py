"""Quantized MoE experts (worker/layers/quant_experts.py): the K-major store against the
canonical reference (``quant.dequantize``), the CPU MoE over them against the float MoE over the
dequantized weights, the Triton grouped GEMMs (Triton's interpreter here, CUDA on the GPU box;
the `triton_ready` fixture) against the same, loading a qwen3_5_moe checkpoint with
``--quantize int4`` (fused and per-expert tensors), and `tokenpipe info`'s count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.layers.quant import QuantFormat, dequantize, quantize
from worker.layers.quant_experts import QuantExperts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMATS = [QuantFormat("int4", 8), QuantFormat("int8", 16), QuantFormat("int4", 32)]


def _float_experts(
    experts: int, hidden: int, inner: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inner, generator=gen) * inner**-0.5
    return gate_up, down


def _quantized(gate_up: torch.Tensor, down: torch.Tensor, fmt: QuantFormat) -> QuantExperts:
    experts, two_inner, hidden = gate_up.shape
    module = QuantExperts(experts, hidden, two_inner // 2, fmt)
    module.load("gate_up_proj", gate_up)
    module.load("down_proj", down)
    return module


def _reference(weights: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[E, N, K] -> each expert quantized and dequantized by the canonical reference."""
    return torch.stack([dequantize(quantize(w, fmt)) for w in weights])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.describe())
def test_store_dequantizes_to_the_reference(fmt: QuantFormat) -> None:
    gate_up, down = _float_experts(5, 64, 32, torch.Generator().manual_seed(1))
    module = _quantized(gate_up, down, fmt)
    want_gate_up, want_down = _reference(gate_up, fmt), _reference(down, fmt)
    for e in range(5):
        assert torch.equal(module.expert_weight("gate_up_proj", e, torch.float32), want_gate_up[e])
        assert torch.equal(module.expert_weight("down_proj", e, torch.float32), want_down[e])
    int4 = fmt.kind == "int4"
    words = 5 * (64 * 64 + 32 * 64) // (8 if int4 else 4) * 4
    meta = 5 * (64 * 64 // fmt.group_size + 32 * 64 // fmt.group_size) * 2 * (2 if int4 else 1)
    assert module.nbytes == words + meta


def test_per_expert_rows_equal_the_fused_load() -> None:
    """gate and up quantized apart (a per-expert checkpoint) = quantized together."""
    gate_up, down = _float_experts(3, 32, 16, torch.Generator().manual_seed(2))
    fmt = QuantFormat("int4", 16)
    fused = _quantized(gate_up, down, fmt)
    rows = QuantExperts(3, 32, 16, fmt)
    for e in range(3):
        rows.load_rows("gate_up_proj", e, 0, gate_up[e, :16])
        rows.load_rows("gate_up_proj", e, 16, gate_up[e, 16:])
        rows.load_rows("down_proj", e, 0, down[e])
    for a, b in zip(fused.buffers(), rows.buffers(), strict=True):
        assert torch.equal(a, b)


def _moe(gate_up: torch.Tensor, down: torch.Tensor, experts: torch.nn.Module) -> torch.nn.Module:
    """A SparseMoE shell whose ``_experts`` runs over ``experts`` (the CPU loop)."""
    from worker.layers.moe import SparseMoE

    moe = SparseMoE.__new__(SparseMoE)
    torch.nn.Module.__init__(moe)
    moe.experts = experts  # type: ignore[assignment]
    moe.act = F.silu
    moe.act_name = "silu"
    return moe


def _fused(gate_up: torch.Tensor, down: torch.Tensor) -> torch.nn.Module:
    from worker.layers.moe import FusedExperts

    experts, two_inner, hidden = gate_up.shape
    module = FusedExperts(experts, hidden, two_inner // 2)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return module


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, 0] += 0.5  # expert 0 crowded: several blocks on the GPU path
    return torch.topk(scores, top_k, dim=-1).indices


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.describe())
def test_cpu_moe_over_quantized_experts_equals_float_over_dequantized(fmt: QuantFormat) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up, down = _float_experts(8, 64, 32, gen)
    x = torch.randn(11, 64, generator=gen)
    ids = _routing(11, 8, 2, gen)
    weights = torch.softmax(torch.randn(11, 2, generator=gen), dim=-1)
    quantized = _moe(gate_up, down, _quantized(gate_up, down, fmt))
    reference = _moe(gate_up, down, _fused(_reference(gate_up, fmt), _reference(down, fmt)))
    got = quantized._experts(x, weights, ids)  # type: ignore[operator]
    want = reference._experts(x, weights, ids)  # type: ignore[operator]
    assert torch.equal(got, want)
    unquantized = _moe(gate_up, down, _fused(gate_up, down))
    assert not torch.equal(got, unquantized._experts(x, weights, ids))  # type: ignore[operator]


@pytest.mark.parametrize(
    "tokens,hidden,inner,fmt,gemv",
    [
        (1, 64, 24, QuantFormat("int4", 8), False),
        (5, 64, 32, QuantFormat("int8", 16), False),
        (70, 48, 24, QuantFormat("int4", 8), False),
        (3, 64, 32, QuantFormat("int4", 32), False),
        (9, 32, 16, QuantFormat("int8", 8), False),
        (1, 64, 24, QuantFormat("int4", 8), True),
        (5, 64, 32, QuantFormat("int8", 16), True),
        (3, 64, 32, QuantFormat("int4", 32), True),
        (9, 32, 16, QuantFormat("int8", 8), True),
        (2, 128, 32, QuantFormat("int8", 32), True),
    ],
)
def test_quantized_moe_kernels_match_the_reference(
    triton_ready: None, tokens: int, hidden: int, inner: int, fmt: QuantFormat, gemv: bool
) -> None:
    """The grouped GEMMs and the per-pair GEMVs (moe_gemv: K split over programs
    at these sizes, outputs past N masked) against the CPU MoE over dequantized experts."""
    from worker.device.kernels.moe_quant import fused_moe_quant_triton, supports

    gen = torch.Generator().manual_seed(tokens * 1000 + hidden)
    experts, top_k = 8, 2
    gate_up, down = _float_experts(experts, hidden, inner, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = _routing(tokens, experts, top_k, gen)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    shared = torch.randn(tokens, hidden, generator=gen)
    shared_gate = torch.randn(tokens, 1, generator=gen)
    reference = _moe(gate_up, down, _fused(_reference(gate_up, fmt), _reference(down, fmt)))
    routed = reference._experts(x, weights, ids)  # type: ignore[operator]
    want = routed + torch.sigmoid(shared_gate) * shared
    module = _quantized(gate_up, down, fmt).to(DEVICE)
    assert supports(module)
    got = fused_moe_quant_triton(
        x.to(DEVICE), module.matrix("gate_up_proj"), module.matrix("down_proj"),
        weights.to(DEVICE), ids.to(DEVICE), shared=shared.to(DEVICE),
        shared_gate=shared_gate.to(DEVICE), gemv=gemv,
    ).cpu()  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_dequantized_experts_equal_the_reference_rows(triton_ready: None, kind: str) -> None:
    """``dequantize_experts``: the experts hit, exactly ``expert_weight`` (the CPU path's
    dequantization) in fp32; N and K not multiples of the kernel's tiles."""
    from worker.device.kernels.moe_quant import dequantize_experts, hit_experts

    gen = torch.Generator().manual_seed(17)
    gate_up, down = _float_experts(6, 96, 40, gen)  # gate_up [6, 80, 96], down [6, 96, 40]
    module = _quantized(gate_up, down, QuantFormat(kind, 8))
    hit_ids = (1, 4, 5)
    want = {(m, e): module.expert_weight(m, e, torch.float32) for m in module.shapes
            for e in hit_ids}  # fmt: skip
    module.to(DEVICE)
    hit = hit_experts(torch.tensor([[4, 1], [1, 5]], device=DEVICE), 6)
    assert hit.cpu().tolist() == [0, 1, 0, 0, 1, 1]
    # a padding row's garbage ids: never an index error; past the end marks nothing
    garbage = torch.tensor([[4, 1], [1, 5], [6, 1 << 40]], device=DEVICE)
    assert hit_experts(garbage, 6).cpu().tolist() == [0, 1, 0, 0, 1, 1]
    assert hit_experts(torch.tensor([[-3, 2]], device=DEVICE), 6).cpu().tolist()[2] == 1
    for matrix in module.shapes:
        got = dequantize_experts(module.matrix(matrix), hit, torch.float32).cpu()
        for e in hit_ids:
            assert torch.equal(got[e], want[matrix, e]), (matrix, e)


@pytest.mark.parametrize(
    "tokens,top_k,fmt",
    [(70, 2, QuantFormat("int4", 8)), (40, 3, QuantFormat("int8", 16))],
    ids=["int4-g8", "int8-g16"],
)
def test_quantized_moe_prefill_dequantizes_to_the_float_kernels(
    triton_ready: None, tokens: int, top_k: int, fmt: QuantFormat
) -> None:
    """A step past the per-pair GEMVs: the hit experts dequantized, then the float grouped
    GEMMs, against the quantized grouped GEMMs and the CPU MoE over dequantized experts."""
    from worker.device.kernels.moe_quant import fused_moe_quant_triton

    gen = torch.Generator().manual_seed(tokens)
    gate_up, down = _float_experts(8, 64, 32, gen)
    x = torch.randn(tokens, 64, generator=gen)
    ids = _routing(tokens, 8, top_k, gen)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    residual = torch.randn(tokens, 64, generator=gen)
    reference = _moe(gate_up, down, _fused(_reference(gate_up, fmt), _reference(down, fmt)))
    want = reference._experts(x, weights, ids) + residual  # type: ignore[operator]
    module = _quantized(gate_up, down, fmt).to(DEVICE)
    results = []
    for dequant in (True, False):
        got = fused_moe_quant_triton(
            x.to(DEVICE), module.matrix("gate_up_proj"), module.matrix("down_proj"),
            weights.to(DEVICE), ids.to(DEVICE), residual=residual.to(DEVICE), gemv=False,
            dequant=dequant,
        ).cpu()  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        results.append(got)
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", [QuantFormat("int4", 8), QuantFormat("int8", 16)],
                         ids=lambda f: f.describe())  # fmt: skip
def test_quantized_moe_gemv_tiles_and_residual(triton_ready: None, fmt: QuantFormat) -> None:
    """Narrow column blocks (several per matrix), two warps, a split that leaves the last
    program fewer groups than warps, one split (gate_up's kernel stores silu(gate) * up), in
    bf16 with a residual: within bf16 rounding of the CPU MoE, and of each other."""
    from worker.device.kernels.moe_gemv import GemvTiles, moe_quant_gemv, split_for

    gen = torch.Generator().manual_seed(11)
    tokens, hidden, inner, top_k = 2, 80, 48, 3
    gate_up, down = _float_experts(6, hidden, inner, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = _routing(tokens, 6, top_k, gen)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    residual = torch.randn(tokens, hidden, generator=gen)
    shared = torch.randn(tokens, hidden, generator=gen)
    shared_gate = torch.randn(tokens, 1, generator=gen)
    reference = _moe(gate_up, down, _fused(_reference(gate_up, fmt), _reference(down, fmt)))
    routed = reference._experts(x, weights, ids)  # type: ignore[operator]
    want = routed + torch.sigmoid(shared_gate) * shared + residual
    module = _quantized(gate_up, down, fmt).to(DEVICE)
    gu, dn = module.matrix("gate_up_proj"), module.matrix("down_proj")
    narrow = GemvTiles(block_n=16, warps=2, programs=200)
    assert split_for(tokens * top_k, 80, 80 // fmt.group_size, narrow)[0] > 1
    results = []
    # split K; one split, so gate_up stores the activations itself (wide, then narrow blocks)
    for t in (narrow, GemvTiles(block_n=64, warps=4, programs=1), GemvTiles(16, 2, 1)):
        got = moe_quant_gemv(
            x.to(DEVICE).bfloat16(), gu, dn, weights.to(DEVICE).bfloat16(), ids.to(DEVICE),
            shared.to(DEVICE).bfloat16(), shared_gate.to(DEVICE).bfloat16(),
            residual.to(DEVICE).bfloat16(), t,
        ).cpu()  # fmt: skip
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=0.03, atol=0.03)
        results.append(got)
    for other in results[1:]:
        assert (results[0].float() - other.float()).abs().max() <= 0.02


@pytest.mark.parametrize("fmt", [QuantFormat("int4", 8), QuantFormat("int8", 16)],
                         ids=lambda f: f.describe())  # fmt: skip
def test_lanes_gemv_tiles_and_expert_order_match_the_reference(
    triton_ready: None, fmt: QuantFormat
) -> None:
    """The lanes kernel (``_pair_gemv_lanes_kernel``): two and four tiles a program, K split
    (partial sums) and not (gate_up stores the activations), pairs in expert order, columns
    past N masked, and x in fp32 (within 1e-5 of the CPU MoE) and in bf16 (read as int32
    pairs: within bf16 rounding, and equal to the per-pair kernel's result's rounding)."""
    from worker.device.kernels.moe_gemv import GemvTiles, expert_order, moe_quant_gemv, split_for

    gen = torch.Generator().manual_seed(12)
    tokens, hidden, inner, top_k = 2, 80, 48, 2
    gate_up, down = _float_experts(6, hidden, inner, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = _routing(tokens, 6, top_k, gen)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    residual = torch.randn(tokens, hidden, generator=gen)
    reference = _moe(gate_up, down, _fused(_reference(gate_up, fmt), _reference(down, fmt)))
    want = reference._experts(x, weights, ids) + residual  # type: ignore[operator]
    module = _quantized(gate_up, down, fmt).to(DEVICE)
    gu, dn = module.matrix("gate_up_proj"), module.matrix("down_proj")
    split_tiles = GemvTiles(block_n=32, warps=2, programs=200, lanes=2)
    assert split_for(tokens * top_k, 2 * inner, hidden // fmt.group_size, split_tiles)[0] > 1
    one_split = GemvTiles(block_n=32, warps=2, programs=1, lanes=4)
    assert split_for(tokens * top_k, 2 * inner, hidden // fmt.group_size, one_split)[0] == 1
    order = expert_order(ids.to(DEVICE))
    assert order.cpu().tolist() == torch.argsort(ids.reshape(-1), stable=True).tolist()
    args = (x.to(DEVICE), gu, dn, weights.to(DEVICE), ids.to(DEVICE))
    for t, pairs_order in [(split_tiles, None), (one_split, order)]:
        got = moe_quant_gemv(*args, residual=residual.to(DEVICE), t=t, order=pairs_order).cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bf16 = (x.to(DEVICE).bfloat16(), gu, dn, weights.to(DEVICE).bfloat16(), ids.to(DEVICE))
    old = moe_quant_gemv(*bf16, t=GemvTiles(32, 2, 200, lanes=0)).cpu().float()
    for t in (split_tiles, one_split):
        got = moe_quant_gemv(*bf16, t=t, order=order).cpu()
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want - residual, rtol=0.03, atol=0.03)
        assert (got.float() - old).abs().max() <= 0.02


def _tiny_checkpoint(tmp_path: Path, per_expert: bool, layers: int = 8) -> Path:
    """A tiny qwen3_5_moe checkpoint (8 experts, hidden 64, inner 24; ``layers`` layers, every
    fourth full attention) with random weights."""
    from safetensors.torch import save_file
    from test_models_qwen3_5_moe import _text_config
    from tiny_models import byte_level_tokenizer_json

    from worker.loading.random_init import init_random_weights
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    config = _text_config().to_dict()
    config["vocab_size"] = 263  # the byte-level tokenizer's
    config["num_hidden_layers"] = layers
    config["layer_types"] = config["layer_types"][:layers]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    model = build_model(ModelConfig.from_hf(config), "cpu", torch.float32)
    init_random_weights(model, seed=5)
    state = {}
    for name, tensor in model.state_dict().items():
        if per_expert and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix, _, matrix = name.rpartition(".")
            inner = 24
            for e in range(tensor.shape[0]):
                if matrix == "down_proj":
                    state[f"{prefix}.{e}.down_proj.weight"] = tensor[e].clone()
                else:
                    state[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :inner].clone()
                    state[f"{prefix}.{e}.up_proj.weight"] = tensor[e, inner:].clone()
        else:
            state[name] = tensor.contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("per_expert", [False, True], ids=["fused", "per_expert"])
def test_int4_load_quantizes_the_experts(tmp_path: Path, per_expert: bool) -> None:
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions, summary
    from worker.models.step import StepInput

    path = _tiny_checkpoint(tmp_path, per_expert)
    floats = load_model(path, "cpu", torch.float32, progress=False).model
    model = load_model(path, "cpu", torch.float32, progress=False,
                       quantize=QuantizeOptions("int4", 8)).model  # fmt: skip
    layers = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(layers) == 8
    float_experts = floats.model.layers[3].mlp.experts
    fmt = QuantFormat("int4", 8)
    want = _reference(float_experts.gate_up_proj.detach(), fmt)
    for e in range(8):
        got = layers[3].expert_weight("gate_up_proj", e, torch.float32)
        assert torch.equal(got, want[e])
    assert "int4 g8" in summary(model)
    step = StepInput.single(list(range(3, 12)), 0, 0, device="cpu")
    logits = model(step, model.make_kv_cache(1, 64))
    float_logits = floats(step, floats.make_kv_cache(1, 64))
    assert torch.isfinite(logits).all()
    assert (logits - float_logits).norm() / float_logits.norm() < 0.3


def test_missing_quantized_expert_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from worker.loading.quantize import QuantizeOptions, begin_load
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    path = _tiny_checkpoint(tmp_path, per_expert=True)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = build_model(config, "meta", torch.float32)
    begin_load(model, QuantizeOptions("int4", 8), None, torch.device("cpu"), torch.float32)
    model = model.to_empty(device="cpu")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.experts.<experts>"):
        model.load_weights(tensors.items())


def test_info_counts_the_experts_bytes() -> None:
    """35B-A3B in int4 g32: the experts (32.2 B weights) at 4.5 bits each."""
    from worker.loading.quantize import QuantizeOptions, describe_weights, plan_for_model
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    root = Path(__file__).resolve().parents[2]
    raw = json.loads((root / "examples/qwen3_5_moe/config.json").read_text())
    model = build_model(ModelConfig.from_hf(raw), "meta", torch.bfloat16)
    plan = plan_for_model(model, QuantizeOptions("int4"))
    described = describe_weights(model, plan, torch.bfloat16)
    experts = 40 * 256 * 3 * 512 * 2048  # weights
    int4 = described["formats"]["int4 g32"]
    assert int4["bytes"] >= experts // 2 + experts // 32 * 4  # codes + scale and offset
    total = sum(entry["bytes"] for entry in described["formats"].values())
    assert total <= 24e9
    floats = describe_weights(model, {}, torch.bfloat16)
    assert sum(e["bytes"] for e in floats["formats"].values()) >= 2 * experts


def test_int4_experts_plan_keeps_the_dense_matmuls_float() -> None:
    """``--quantize int4-experts`` on the 35B-A3B shape: only the routed experts int4, the head
    int8, the embedding int4; every attention / DeltaNet / shared-expert / router matmul float;
    the whole model within the issue's 24 GB."""
    from worker.loading.quantize import QuantizeOptions, describe_weights, plan_for_model
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    root = Path(__file__).resolve().parents[2]
    raw = json.loads((root / "examples/qwen3_5_moe/config.json").read_text())
    model = build_model(ModelConfig.from_hf(raw), "meta", torch.bfloat16)
    plan = plan_for_model(model, QuantizeOptions("int4-experts"))
    experts = {name for name in plan if name.endswith("mlp.experts")}
    assert len(experts) == 40 and all(plan[name] == QuantFormat("int4", 32) for name in experts)
    assert set(plan) - experts == {"model.embed_tokens", "lm_head"}
    assert plan["lm_head"] == QuantFormat("int8", 32)
    assert plan["model.embed_tokens"] == QuantFormat("int4", 32)
    described = describe_weights(model, plan, torch.bfloat16)
    total = sum(entry["bytes"] for entry in described["formats"].values())
    assert 23e9 < total <= 24e9
    dense = 40 * 3 * 512 * 2048 + 30 * (8192 + 4096 + 64 + 4096) * 2048  # shared, DeltaNet
    assert described["formats"]["bfloat16"]["bytes"] >= 2 * dense


def test_int4_experts_needs_experts() -> None:
    from worker.loading.quantize import QuantizeOptions, plan_for_model
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip
    model = build_model(ModelConfig.from_hf(raw), "meta", torch.float32)
    with pytest.raises(ValueError, match="no sparse-MoE experts"):
        plan_for_model(model, QuantizeOptions("int4-experts"))


def test_int4_experts_load_runs_on_the_cpu(tmp_path: Path) -> None:
    """A tiny checkpoint under int4-experts: experts quantized, dense layers still float (and
    the same tensors as the float load), logits close to the float model's."""
    from worker.layers.quant import QuantEmbedding, QuantLinear
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions
    from worker.models.step import StepInput

    path = _tiny_checkpoint(tmp_path, per_expert=False)
    floats = load_model(path, "cpu", torch.float32, progress=False).model
    model = load_model(path, "cpu", torch.float32, progress=False,
                       quantize=QuantizeOptions("int4-experts", 8)).model  # fmt: skip
    assert sum(isinstance(m, QuantExperts) for m in model.modules()) == 8
    quant_linears = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert quant_linears == ["lm_head"]
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert model.model.embed_tokens.format.kind == "int4"
    attn = model.model.layers[0].linear_attn.out_proj
    assert isinstance(attn, torch.nn.Linear)
    assert torch.equal(attn.weight, floats.model.layers[0].linear_attn.out_proj.weight)
    step = StepInput.single(list(range(3, 12)), 0, 0, device="cpu")
    logits = model(step, model.make_kv_cache(1, 64))
    float_logits = floats(step, floats.make_kv_cache(1, 64))
    assert torch.isfinite(logits).all()
    assert (logits - float_logits).norm() / float_logits.norm() < 0.3


@pytest.mark.parametrize("per_expert", [False, True], ids=["fused", "per_expert"])
def test_staged_load_streams_the_experts_as_transients(tmp_path: Path, per_expert: bool) -> None:
    """The CUDA load path (staged_tensors, here on the CPU): fused and per-expert expert
    tensors are transient targets, quantized as they arrive; none is yielded as a meta tensor."""
    from worker.loading.checkpoint import open_checkpoint
    from worker.loading.quantize import QuantizeOptions, begin_load
    from worker.loading.staged_load import staged_tensors
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    path = _tiny_checkpoint(tmp_path, per_expert)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = build_model(config, "meta", torch.float32)
    cpu = torch.device("cpu")
    quantized = begin_load(model, QuantizeOptions("int4", 8), None, cpu, torch.float32)
    assert quantized is not None
    model = model.to_empty(device=cpu)
    pairs = staged_tensors(
        open_checkpoint(path).text_tensors(), model.state_dict(keep_vars=True),
        transient=quantized.transient_names(model), device=cpu,
    )  # fmt: skip
    report = model.load_weights(pairs)
    assert not report.missing and not report.unexpected
    float_model = build_model(config, "cpu", torch.float32)
    float_model.load_weights(open_checkpoint(path).iter_tensors())
    down = float_model.model.layers[0].mlp.experts.down_proj.detach()
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantExperts)
    want = _reference(down, QuantFormat("int4", 8))
    for e in range(8):
        assert torch.equal(experts.expert_weight("down_proj", e, torch.float32), want[e])


def test_staged_float_load_fills_the_fused_experts_from_per_expert_tensors(tmp_path: Path) -> None:
    """The float CUDA load path (staged_tensors, here on the CPU) with the hub's per-expert
    tensors: each copied straight into its view of the fused parameter (``staging_views``)."""
    from worker.loading.checkpoint import open_checkpoint
    from worker.loading.staged_load import staged_tensors
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    path = _tiny_checkpoint(tmp_path, per_expert=True)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    staged = build_model(config, "cpu", torch.float32)
    targets = {**staged.state_dict(keep_vars=True), **staged.staging_views()}  # type: ignore[operator]
    report = staged.load_weights(
        staged_tensors(open_checkpoint(path).text_tensors(), targets, device=torch.device("cpu"))
    )
    assert not report.missing and not report.unexpected
    direct = build_model(config, "cpu", torch.float32)
    direct.load_weights(open_checkpoint(path).iter_tensors())
    for (name, a), (_, b) in zip(
        sorted(staged.state_dict().items()), sorted(direct.state_dict().items()), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("fused", [0, 1, 2], ids=["apart", "in_proj", "in_proj_long_step"])
def test_sparse_moe_forward_takes_the_quantized_kernels(
    triton_ready: None, monkeypatch: pytest.MonkeyPatch, fused: int
) -> None:
    """SparseMoE.forward with QuantExperts on the Triton path (router, grouped GEMMs, shared
    expert in the combine) equals its CPU path; ``in_proj``: the router and the shared
    expert's gate/up rows merged (E + 2I rows) and the shared expert gate's logit computed in
    the combine (``gate_in_combine``), or by its own matmul in a step longer than
    GATE_IN_COMBINE_MAX_TOKENS."""
    from test_models_qwen3_5_moe import _text_config

    import worker.layers.deltanet as deltanet
    import worker.layers.moe as moe_module
    from worker.loading.quantize import QuantizeOptions, install, plan_for_model
    from worker.loading.random_init import init_random_weights
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    config = ModelConfig.from_hf(_text_config().to_dict())
    model = build_model(config, "cpu", torch.float32)
    init_random_weights(model, seed=7)
    layer = model.model.layers[1].mlp
    gen = torch.Generator().manual_seed(8)
    gate_up = torch.randn(8, 48, 64, generator=gen) * 0.1
    down = torch.randn(8, 64, 24, generator=gen) * 0.1
    plan = {k: v for k, v in plan_for_model(model, QuantizeOptions("int4", 8)).items()
            if k == "model.layers.1.mlp.experts"}  # fmt: skip
    assert install(model, plan) == 1
    experts = layer.experts
    assert isinstance(experts, QuantExperts)
    experts.load("gate_up_proj", gate_up)
    experts.load("down_proj", down)
    x = torch.randn(6, 64, generator=gen)
    import worker.device.kernels.moe_quant as kernels

    calls = []
    original = kernels.fused_moe_quant_triton

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs.get("shared_gate_weight") is not None)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    with torch.no_grad():
        want = layer(x)
        monkeypatch.setattr(moe_module, "use_triton", lambda t: True)
        monkeypatch.setattr(kernels, "fused_moe_quant_triton", spy)
        layer.to(DEVICE)
        if fused:
            monkeypatch.setattr(deltanet, "FUSED_PROJECTION_DEVICES", (DEVICE.type,))
            layer.fuse_projections()
            assert layer.in_proj is not None and layer.gate_in_combine
            if fused == 2:
                monkeypatch.setattr(moe_module, "GATE_IN_COMBINE_MAX_TOKENS", 4)
            rows = layer.in_proj.out_features  # a multiple of 8: no shared gate row
            assert rows == 8 + 2 * layer.shared_expert.inner and rows % 8 == 0
        got = layer(x.to(DEVICE)).cpu()
    assert calls == [fused == 1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gemv_splits_cover_k_without_empty_splits(triton_ready: None) -> None:
    """``split_for`` / ``float_split_for`` (pure): the splits cover K exactly, none is empty,
    a quantized split's groups are whole warps' worth where K allows, and enough pairs need
    no split at all (the gate_up kernel then stores the activations itself)."""
    from worker.device.kernels.moe_gemv import (
        FloatTiles,
        GemvTiles,
        float_split_for,
        split_for,
        tiles,
    )

    for pairs, n, groups in [(8, 1024, 64), (8, 2048, 16), (1, 10, 9), (6, 80, 5), (256, 1024, 64)]:
        t = GemvTiles()
        split, span = split_for(pairs, n, groups, t)
        assert (split - 1) * span < groups <= split * span
        assert span % t.warps == 0 or split == 1
    assert tiles(256).lanes == 4 and split_for(256, 1024, 64, tiles(256)) == (1, 64)  # 32 tokens
    assert tiles(8).lanes == 0 and split_for(8, 1024, 64, tiles(8)) == (4, 16)  # 1 token: 4 x 16
    for pairs, n, k in [(8, 1024, 2048), (8, 2048, 512), (2, 48, 24), (3, 64, 40)]:
        t = FloatTiles()
        split, span = float_split_for(pairs, n, k, t)
        assert (split - 1) * span < k <= split * span and span % t.block_k == 0
