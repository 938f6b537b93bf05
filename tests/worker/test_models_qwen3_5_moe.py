"""Qwen3.5-MoE vs transformers (fp32, CPU): the 35B-A3B layout in miniature — 3 Gated DeltaNet
layers then a gated full-attention layer (x2), 2 key / 4 value DeltaNet heads, partial rotary
(25% of head_dim 16), q/k norms, 8 experts top-2 plus a gated shared expert; and the hybrid
cache's snapshots (restore = a fresh prefill, never a wrong state)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from test_models_common import (
    Pair,
    check_batched_long_decode,
    check_batched_step,
    check_chunked_prefill,
    check_greedy,
    check_long_decode,
    check_prompt_logits,
    hf_logits,
    iter_safetensors,
    make_pair,
    prefill,
    rel_err,
)

from worker.layers.deltanet import CHUNK, causal_conv1d, conv_state_after
from worker.layers.hybrid_cache import HybridCache
from worker.models.config import ModelConfig
from worker.models.registry import build_model
from worker.models.step import StepInput

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
    max_position_embeddings=512,
    eos_token_id=None,
)


def _text_config() -> Any:
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(**TINY)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    return config


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return make_pair(_text_config(), tmp_path_factory.mktemp("qwen3_5_moe"))


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()


def test_config_read(pair: Pair) -> None:
    cfg = pair.config
    assert cfg.family == "qwen3_5_moe" and not cfg.tie_word_embeddings
    assert cfg.layer_kinds == ("linear", "linear", "linear", "full") * 2
    assert cfg.deltanet is not None and cfg.moe is not None
    assert (cfg.deltanet.num_key_heads, cfg.deltanet.num_value_heads) == (2, 4)
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (8, 2)
    assert cfg.layers[3].rope.partial_rotary_factor == 0.25
    names = {name for name, _ in pair.ours.named_parameters()}
    assert "model.layers.0.linear_attn.A_log" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    from protocol.chat_template import model_family

    assert model_family(cfg.architecture) == "qwen3_5"  # serve's Qwen XML tool-call parser


def test_prompt_logits_match_hf(pair: Pair) -> None:
    check_prompt_logits(pair)


def test_greedy_matches_hf_generate(pair: Pair) -> None:
    check_greedy(pair)


def test_chunked_prefill_equals_one_shot(pair: Pair) -> None:
    check_chunked_prefill(pair)


def test_long_prompt_spans_several_deltanet_chunks(pair: Pair) -> None:
    """150 tokens: three 64-token chunks of the chunked form, one shot and in pieces."""
    ids = _ids(150, seed=3)
    ref = hf_logits(pair, ids)
    kv = pair.ours.make_kv_cache(1, 256)
    assert rel_err(prefill(pair.ours, kv, ids)[-1], ref[-1]) < 1e-4
    kv = pair.ours.make_kv_cache(1, 256)
    pieces = prefill(pair.ours, kv, ids, chunk=37)
    assert rel_err(pieces[-1], ref[-1]) < 1e-4
    assert rel_err(pieces[1], ref[73]) < 1e-4


def test_batched_step_equals_each_alone(pair: Pair) -> None:
    check_batched_step(pair)
    check_batched_long_decode(pair, total=20)


def test_decoding_past_a_chunk_matches_hf(pair: Pair) -> None:
    check_long_decode(pair, total=80)


def test_fused_expert_checkpoint_loads_the_same(pair: Pair, tmp_path: Path) -> None:
    """transformers' in-memory names: experts fused ([E, 2I, H], [E, H, I])."""
    state = {k: v.contiguous() for k, v in pair.hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    fused = build_model(pair.config, "cpu", torch.float32)
    report = fused.load_weights(iter_safetensors(tmp_path))
    assert not report.missing and not report.unexpected
    for (name, a), (_, b) in zip(
        sorted(fused.state_dict().items()), sorted(pair.ours.state_dict().items()), strict=True
    ):
        assert torch.equal(a, b), name


def test_missing_expert_is_an_error(pair: Pair) -> None:
    pairs = [
        (n, t)
        for n, t in iter_safetensors_of(pair)
        if n != "model.layers.2.mlp.experts.5.up_proj.weight"
    ]
    model = build_model(pair.config, "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.experts.<experts>"):
        model.load_weights(pairs)


def iter_safetensors_of(pair: Pair) -> list[tuple[str, torch.Tensor]]:
    """The per-expert names save_pretrained writes, from our own fused copy."""
    out = []
    for name, tensor in pair.ours.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inner = name[: -len(".gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out.append((f"{prefix}.{e}.gate_proj.weight", tensor[e, :inner]))
                out.append((f"{prefix}.{e}.up_proj.weight", tensor[e, inner:]))
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            out += [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
        else:
            out.append((name, tensor))
    return out


def test_multimodal_checkpoint_loads_the_text_stack(tmp_path: Path) -> None:
    """Qwen3_5MoeForConditionalGeneration: text_config nested, model.language_model.* names,
    the vision tower skipped; text-only logits match transformers'."""
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64)
    config = Qwen3_5MoeConfig(
        text_config=Qwen3_5MoeTextConfig(**{**TINY, "num_hidden_layers": 4}).to_dict(),
        vision_config=vision,
    )
    torch.manual_seed(1)
    hf = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.08) if "norm" not in name else p.copy_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    assert cfg.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert cfg.layer_kinds == ("linear", "linear", "linear", "full")
    ours = build_model(cfg, "cpu", torch.float32)
    names = [n for n, _ in iter_safetensors(tmp_path)]
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.") for n in names)
    report = ours.load_weights(iter_safetensors(tmp_path))
    assert not report.missing and not report.unexpected
    ids = _ids(40, seed=9)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, -1].float()
    kv = ours.make_kv_cache(1, 64)
    assert rel_err(prefill(ours, kv, ids)[-1], ref) < 1e-4


def test_35b_a3b_shape_and_session_bytes() -> None:
    """examples/qwen3_5_moe/config.json: the 35B-A3B layout; its session state on meta."""
    path = Path(__file__).parents[2] / "examples" / "qwen3_5_moe" / "config.json"
    cfg = ModelConfig.from_hf(json.loads(path.read_text()))
    assert cfg.layer_kinds == ("linear", "linear", "linear", "full") * 10
    assert (cfg.hidden_size, cfg.vocab_size, cfg.layers[3].head_dim) == (2048, 248_320, 256)
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k) == (256, 8)
    model = build_model(cfg, "meta", torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert 34e9 < params < 36e9, params
    kv = model.make_kv_cache(1, 4096)  # on meta: sizes without memory
    assert isinstance(kv, HybridCache)
    full = 10 * 2 * 2 * 4096 * 256 * 2  # 10 layers, K and V, 2 heads, bf16
    conv = 30 * (2 * 16 * 128 + 32 * 128) * 3 * 2
    recurrent = 30 * 32 * 128 * 128 * 4  # float32
    assert kv.bytes_per_slot == full + (1 + kv.snapshots) * (conv + recurrent)


# -- the hybrid cache: snapshots ----------------------------------------------------------------


def test_snapshot_inside_a_chunk_then_rollback_equals_fresh(pair: Pair) -> None:
    """A snapshot asked for mid-chunk (token 25 of a 40-token chunk) and restored later gives
    exactly the state a prefill of those 25 tokens gives: logits match transformers'."""
    model, p = pair.ours, pair.prompt
    kv = model.make_kv_cache(2, 128)
    kv.snapshot_at(1, 25)
    prefill(model, kv, p[:40], slot=1)
    assert 25 in kv.snapshot_lens[1] and kv.live_len[1] == 40
    kv.snapshot_at(1, 40)  # the live state: taken now
    prefill(model, kv, p[40:50], slot=1, start=40, chunk=3)
    assert kv.resume_prefix(1, 50, 50) == 50  # append-only: the live state
    assert kv.resume_prefix(1, 50, 45) == 40  # the newest snapshot at or before
    assert kv.resume_prefix(1, 50, 30) == 25
    assert kv.resume_prefix(1, 50, 20) == 0
    other = [(t + 1) % pair.config.vocab_size for t in p[25:45]]
    kv.truncate(1, 25)
    assert kv.snapshot_lens[1].count(40) == 0  # past the kept prefix: dropped
    last = prefill(model, kv, other, slot=1, start=25, chunk=6)[-1]
    assert rel_err(last, hf_logits(pair, p[:25] + other)[-1]) < 1e-4


def _set_free_split(kv: HybridCache, free: int) -> None:
    for layer in kv.deltanet_layers:
        layer.free_split = free


def test_states_inside_a_prefill_pass_equal_split_ones(pair: Pair) -> None:
    """Snapshots 64 and 128 tokens into one 200-token prefill step come out of the chunked pass
    itself (``free_split`` = 64, the CPU default), the one at 100 splits it: every state equals
    the one a prefill split at each of them leaves, and a rollback to 64 continues as
    transformers does."""
    model = pair.ours
    assert model.make_kv_cache(1, 16).free_split == CHUNK
    p = _ids(200, 11)
    caches = []
    for free in (CHUNK, 0):
        kv = model.make_kv_cache(1, 256)
        _set_free_split(kv, free)
        for t in (64, 100, 128):
            kv.snapshot_at(0, t)
        prefill(model, kv, p)
        assert sorted(kv.snapshot_lens[0])[1:] == [64, 100, 128]
        caches.append(kv)
    inside, split = caches
    for t in (64, 100, 128):
        a, b = inside.snapshot_lens[0].index(t), split.snapshot_lens[0].index(t)
        for la, lb in zip(inside.deltanet_layers, split.deltanet_layers, strict=True):
            assert torch.equal(la.snap_conv[0, a], lb.snap_conv[0, b])
            torch.testing.assert_close(la.snap_recurrent[0, a], lb.snap_recurrent[0, b])
    for la, lb in zip(inside.deltanet_layers, split.deltanet_layers, strict=True):
        torch.testing.assert_close(la.recurrent[0], lb.recurrent[0])
    other = _ids(20, 12)
    inside.truncate(0, 64)
    last = prefill(model, inside, other, start=64)[-1]
    assert rel_err(last, hf_logits(pair, p[:64] + other)[-1]) < 1e-4


def test_conv_state_after_equals_a_conv_of_the_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    x, state = torch.randn(9, 5, generator=gen), torch.randn(5, 3, generator=gen)
    weight = torch.randn(5, 4, generator=gen)
    for start in (None, state):
        for rows in range(1, 9):
            want = causal_conv1d(x[:rows], start, weight)[1]
            assert torch.equal(conv_state_after(x, start, rows, 4), want), (start is None, rows)


def test_one_token_prefill_tail_takes_the_recurrence(pair: Pair) -> None:
    """A named prompt's snapshot before its last token splits a one-token tail off the
    prefill: it goes through the one-token recurrence and continues as transformers."""
    model, p = pair.ours, _ids(90, 13)
    kv = model.make_kv_cache(1, 256)
    kv.snapshot_at(0, 89)
    last = prefill(model, kv, p)[-1]
    assert 89 in kv.snapshot_lens[0]
    assert rel_err(last, hf_logits(pair, p)[-1]) < 1e-4


def test_wrong_state_is_refused(pair: Pair) -> None:
    model, p = pair.ours, pair.prompt
    kv = model.make_kv_cache(1, 128)
    prefill(model, kv, p[:20])
    with pytest.raises(ValueError, match="recurrent state holds 20 tokens"):
        model(StepInput.single(p[10:12], 0, 10), kv)
    with pytest.raises(ValueError, match="no state at 10 tokens"):
        kv.truncate(0, 10)
    kv.truncate(0, 0)  # from scratch is always possible
    last = prefill(model, kv, p[:30])[-1]
    assert rel_err(last, hf_logits(pair, p[:30])[-1]) < 1e-4


def test_cpu_packed_weights_match_hf(pair: Pair) -> None:
    """``prepare_for_cpu`` (packed matmuls, the kernel's norms) on this family: the oracle
    checks pass on the packed copy too."""
    import copy

    from worker.device import cpu_gemv

    if cpu_gemv.kernel() is None:
        pytest.skip("no AVX2/FMA CPU kernel")
    packed = copy.deepcopy(pair.ours)
    assert packed.prepare_for_cpu() > 0
    twin = Pair(hf=pair.hf, ours=packed, config=pair.config, prompt=pair.prompt)
    check_prompt_logits(twin)
    check_greedy(twin)
    check_batched_step(twin)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("layer_types", ["linear_attention", "sliding_attention"], "unsupported layer type"),
        ("linear_num_value_heads", 3, "multiple of linear_num_key_heads"),
        ("num_experts_per_tok", 9, "num_experts_per_tok"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 2.0}, "not supported"),
    ],
)
def test_bad_configs_are_clear_errors(key: str, value: Any, match: str) -> None:
    raw = {**TINY, "architectures": ["Qwen3_5MoeForCausalLM"], "num_hidden_layers": 2, key: value}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_load_and_cpu_packing(tmp_path: Path, mode: str) -> None:
    """--quantize int8/int4 on the family: its projections become QuantLinear (the DeltaNet's
    four input matmuls too), the CPU packing step takes them, logits unchanged by it."""
    from tiny_models import byte_level_tokenizer_json

    from worker.layers.quant import QuantLinear
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions

    config = _text_config().to_dict()
    config["architectures"] = ["Qwen3_5MoeForCausalLM"]
    config["vocab_size"] = 263  # the byte-level tokenizer's
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    model = load_model(tmp_path, "cpu", torch.float32, random_weights=True, progress=False,
                       quantize=QuantizeOptions(mode, 8)).model  # fmt: skip
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    step = StepInput.single(list(range(3, 12)), 0, 0, device="cpu")
    before = model(step, model.make_kv_cache(1, 64))
    assert model.prepare_for_cpu() > 0
    torch.testing.assert_close(model(step, model.make_kv_cache(1, 64)), before)


def test_prefill_states_where_a_state_needs_no_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch form (CPU, fp32, no fla) and fla's stages hand out states at chunk multiples;
    fla's single call without its stages cannot (every state inside a step is a split)."""
    import worker.layers.deltanet as deltanet

    assert deltanet.prefill_states("cpu", torch.float32) == CHUNK
    assert deltanet.prefill_states("cuda", torch.float32) == CHUNK
    monkeypatch.setattr(deltanet, "fla_chunk_rule", lambda: None)
    assert deltanet.prefill_states("cuda", torch.bfloat16) == CHUNK
    monkeypatch.setattr(deltanet, "fla_chunk_rule", lambda: object())
    monkeypatch.setattr(deltanet, "fla_stages", lambda: None)
    assert deltanet.prefill_states("cuda", torch.bfloat16) == 0
    monkeypatch.setattr(deltanet, "fla_stages", lambda: object())
    assert deltanet.prefill_states("cuda", torch.bfloat16) == CHUNK
