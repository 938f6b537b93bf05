"""A qwen35moe GGUF (Qwen3.5-35B-A3B's layout in miniature), written here the way llama.cpp's
converter writes one, loads as the model it came from: logits and greedy tokens equal
transformers' on the HF weights; 2-D Q8_0 / Q4_0 tensors stay quantized with their rows and
columns back in HF order; quantized stacked experts become int4 experts; the MTP block is
skipped; the qwen35 pre-tokenizer keeps combining marks in their word.

What the writer follows (llama.cpp's Qwen3_5MoeTextModel converter and its bases): names from
gguf-py's tensor map; every RMSNorm but the DeltaNet output norm stored as 1 + w; A_log stored
as -exp(A_log); dt_bias as ``ssm_dt.bias``; conv1d squeezed to [C, K]; the DeltaNet value heads
reordered from grouped-by-key-head to tiled (the V rows of in_proj_qkv, the rows of in_proj_z /
in_proj_a / in_proj_b, A_log, dt_bias, the conv's V channels, the columns of out_proj); the
fused gate_up experts split into ffn_gate_exps and ffn_up_exps; MTP blocks after the text
layers, counted in ``block_count`` and ``nextn_predict_layers``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_models_common import Pair, check_greedy, check_prompt_logits, make_pair

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n"]
TINY: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    max_position_embeddings=512,
    eos_token_id=None,
)
PER_KEY = TINY["linear_num_value_heads"] // TINY["linear_num_key_heads"]


def vocab() -> tuple[list[str], list[int]]:
    from worker.loading.tokenizer import byte_level_decoder

    alphabet = sorted(byte_level_decoder(), key=lambda c: byte_level_decoder()[c])
    tokens = alphabet + [m.replace(" ", "") for m in MERGES] + SPECIALS
    return tokens, [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)


def hf_config() -> Any:
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(vocab_size=len(vocab()[0]), **TINY)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    return config


def tile(values: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
    """llama.cpp's _reorder_v_heads: value heads grouped by key head -> tiled."""
    keys = TINY["linear_num_key_heads"]
    moved = np.moveaxis(values, axis, 0)
    rest = moved.shape[1:]
    tiled = moved.reshape(keys, PER_KEY, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(tiled, 0, axis)


def llama_cpp_tensors(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(HF-side name the tensor map knows, values) as llama.cpp's converter changes them."""
    qk = 2 * TINY["linear_num_key_heads"] * TINY["linear_key_head_dim"]
    head = TINY["linear_value_head_dim"]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, values + 1)]
    if name.endswith(".A_log"):
        return [(name, -np.exp(tile(values, 0, 1)))]
    if name.endswith(".dt_bias"):
        return [(name.replace(".dt_bias", ".dt_proj.bias"), tile(values, 0, 1))]
    if name.endswith("conv1d.weight"):
        squeezed = values[:, 0, :]
        return [(name, np.concatenate([squeezed[:qk], tile(squeezed[qk:], 0, head)]))]
    if name.endswith("in_proj_qkv.weight"):
        return [(name, np.concatenate([values[:qk], tile(values[qk:], 0, head)]))]
    if name.endswith("in_proj_z.weight"):
        return [(name, tile(values, 0, head))]
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
        return [(name, tile(values, 0, 1))]
    if name.endswith("out_proj.weight"):
        return [(name, tile(values, 1, head))]
    if name.endswith("experts.gate_up_proj"):
        inner = values.shape[1] // 2
        base = name.removesuffix(".gate_up_proj")
        return [(base + ".gate_proj", values[:, :inner]), (base + ".up_proj", values[:, inner:])]
    return [(name, values)]


def storage_type(gguf_name: str, variant: str) -> str:
    if variant == "kept":
        for part, kind in {"attn_qkv": "Q8_0", "attn_gate": "Q4_0", "ssm_out": "Q4_0",
                           "ffn_up_shexp": "Q8_0", "attn_output": "Q4_0"}.items():  # fmt: skip
            if f".{part}." in gguf_name:
                return kind
    if variant == "experts" and "_exps" in gguf_name:
        return "Q4_0"
    return "F32"


def write_qwen_gguf(path: Path, hf: Any, variant: str) -> None:
    """The HF model's weights as llama.cpp writes a Qwen3.5-MoE GGUF, plus one MTP block; the HF
    model's quantized weights become their round trip, so transformers computes the file's
    values."""
    layers = TINY["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    writer.add_name("tiny qwen 3.5 moe")
    writer.add_block_count(layers + 1)
    writer.add_nextn_predict_layers(1)
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["moe_intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_key_length(TINY["head_dim"])
    writer.add_value_length(TINY["head_dim"])
    writer.add_rope_freq_base(hf.config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(TINY["head_dim"] // 4)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(TINY["num_experts"])
    writer.add_expert_used_count(TINY["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(TINY["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(TINY["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(4)
    writer.add_ssm_state_size(TINY["linear_key_head_dim"])
    writer.add_ssm_group_count(TINY["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(TINY["linear_num_value_heads"])
    writer.add_ssm_inner_size(TINY["linear_value_head_dim"] * TINY["linear_num_value_heads"])
    writer.add_full_attention_interval(4)
    tokens, types = vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, layers + 1)
    with torch.no_grad():
        state = hf.state_dict()
        for hf_name, tensor in state.items():
            originals = {}
            for name, values in llama_cpp_tensors(hf_name, tensor.float().numpy()):
                base, _, suffix = name.rpartition(".")
                if suffix not in ("weight", "bias"):
                    base, suffix = name, ""
                gguf_name = names.get_name(base)
                assert gguf_name is not None, name
                gguf_name += f".{suffix}" if suffix else ""
                kind = storage_type(gguf_name, variant)
                if kind == "F32":
                    writer.add_tensor(gguf_name, np.ascontiguousarray(values))
                    continue
                qtype = gguf.GGMLQuantizationType[kind]
                blocks = gguf.quants.quantize(np.ascontiguousarray(values), qtype)
                writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
                originals[name] = gguf.quants.dequantize(blocks, qtype).reshape(values.shape)
            if originals:  # the round trip back into the HF tensor, in HF order
                restore_round_trip(hf_name, tensor, originals)
        hidden = TINY["hidden_size"]  # the MTP block, which the text model skips
        writer.add_tensor(
            f"blk.{layers}.nextn.eh_proj.weight", np.zeros((hidden, 2 * hidden), np.float32)
        )
        writer.add_tensor(f"blk.{layers}.attn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def untile(values: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
    keys = TINY["linear_num_key_heads"]
    moved = np.moveaxis(values, axis, 0)
    rest = moved.shape[1:]
    grouped = moved.reshape(PER_KEY, keys, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(grouped, 0, axis)


def restore_round_trip(hf_name: str, tensor: torch.Tensor, stored: dict[str, np.ndarray]) -> None:
    """Put the quantization round trip of the stored values back into the HF tensor."""
    qk = 2 * TINY["linear_num_key_heads"] * TINY["linear_key_head_dim"]
    head = TINY["linear_value_head_dim"]
    if hf_name.endswith("experts.gate_up_proj"):
        base = hf_name.removesuffix(".gate_up_proj")
        value = np.concatenate([stored[base + ".gate_proj"], stored[base + ".up_proj"]], axis=1)
    else:
        (value,) = stored.values()
        if hf_name.endswith("in_proj_qkv.weight"):
            value = np.concatenate([value[:qk], untile(value[qk:], 0, head)])
        elif hf_name.endswith("in_proj_z.weight"):
            value = untile(value, 0, head)
        elif hf_name.endswith("out_proj.weight"):
            value = untile(value, 1, head)
    tensor.copy_(torch.from_numpy(np.ascontiguousarray(value)))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def load_ours(path: Path, mode: str) -> Any:
    from worker.device.cuda_setup import prepare_model_for_device
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions

    loaded = load_model(path, "cpu", torch.float32, progress=False,
                        quantize=QuantizeOptions(mode))  # fmt: skip
    return loaded, prepare_model_for_device(loaded, "cpu", cuda_graphs=False)


@pytest.mark.parametrize("variant", ["f32", "kept", "experts"])
def test_qwen35moe_gguf_matches_transformers(tmp_path: Path, cache: Path, variant: str) -> None:
    from worker.layers.quant import INT4, INT8, QuantFormat, QuantLinear
    from worker.layers.quant_experts import QuantExperts

    pair = make_pair(hf_config(), tmp_path / "hf")
    path = tmp_path / "tiny-qwen35moe.gguf"
    write_qwen_gguf(path, pair.hf, variant)

    loaded, model = load_ours(path, "auto")
    cfg = loaded.config
    assert cfg.family == "qwen3_5_moe" and cfg.num_hidden_layers == TINY["num_hidden_layers"]
    assert cfg.layer_kinds == ("linear", "linear", "linear", "full")
    assert cfg.deltanet is not None and cfg.moe is not None
    assert (cfg.deltanet.num_key_heads, cfg.deltanet.num_value_heads) == (2, 4)
    assert cfg.deltanet.value_head_dim == 32 and cfg.moe.shared_intermediate_size == 32
    assert cfg.layers[3].rope.partial_rotary_factor == 0.25
    linear = {m.format for m in model.modules() if isinstance(m, QuantLinear)}
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    ours = Pair(pair.hf, model, cfg, pair.prompt)
    if variant == "experts":  # Q4_0 blocks repacked into int4 experts, exactly
        assert not linear and len(experts) == TINY["num_hidden_layers"]
        assert all(e.format(m) == QuantFormat(INT4, 32) for e in experts
                   for m in ("gate_up_proj", "down_proj"))  # fmt: skip
    else:
        assert not experts
    if variant == "kept":
        assert linear == {QuantFormat(INT4, 32), QuantFormat(INT8, 32)}
        kept = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        assert "model.layers.0.linear_attn.out_proj" in kept
        assert "model.layers.0.linear_attn.in_proj_qkv" in kept
    elif variant == "f32":
        assert not linear
    check_prompt_logits(ours)
    check_greedy(ours)


def test_qwen35_pretokenizer_keeps_combining_marks(tmp_path: Path, cache: Path) -> None:
    from worker.loading.loader import open_model_files

    pair = make_pair(hf_config(), tmp_path / "hf")
    path = tmp_path / "tiny-qwen35moe.gguf"
    write_qwen_gguf(path, pair.hf, "f32")
    _, config, tokenizer, _ = open_model_files(path, progress=False)
    text = "so the cafe\u0301 in a\u0308\n<|im_end|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    tokens = vocab()[0]
    assert ids[-1] == tokens.index("<|im_end|>")
    assert tokens.index("Ġthe") in ids and tokens.index("in") in ids
    assert tokenizer.eos_ids == frozenset({tokens.index("<|im_end|>")})
    from worker.loading.tokenizer import byte_level_bpe

    backend = byte_level_bpe(tokens, MERGES, "qwen35")
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("cafe\u0301!")]
    assert [len(p) for p in pieces] == [6, 1]  # "café" (its mark's 2 bytes kept) and "!"
    qwen2 = byte_level_bpe(tokens, MERGES, "qwen2")
    pieces = [p for p, _ in qwen2.pre_tokenizer.pre_tokenize_str("cafe\u0301!")]
    assert [len(p) for p in pieces] == [4, 3]  # qwen2 splits the mark off the word
