"""A gemma4 GGUF (Gemma 4 31B's text layout in miniature), written here the way llama.cpp's
converter writes one, loads as the model it came from: logits and greedy tokens equal
transformers' on the HF weights, Q8_0 / Q4_0 tensors stay quantized (int8 / int4 g32), and the
gemma4 tokenizer (BPE over the file's merges, '▁' for spaces, byte fallback) is rebuilt.

What the writer follows (llama.cpp's Gemma4Model converter): tensor names from gguf-py's own
tensor map; norms stored as they are (no 1 + w, unlike Gemma 3); ``layer_scalar`` as
``blk.N.layer_output_scale.weight``; no ``attn_v`` on the full layers that take V from K; the
full layers' head size in ``key_length`` and the sliding layers' in ``key_length_swa``; KV heads
and the sliding pattern per layer; the full layers' partial RoPE as a ``rope_freqs`` tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_models_common import Pair, check_greedy, check_prompt_logits, make_pair

from worker.loading.checkpoint import ModelLoadError

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|tool_response>", "<turn|>", "<|turn>"]
SPECIAL_TYPES = [3, 3, 3, 2, 3, 3, 3, 3]  # control, except <unk>
BASE = ["▁", "\n", *"abcdefghijklmnopqrstuvwxyz", ".", ","]
MERGES = [
    ("t", "h"),
    ("▁", "t"),
    ("▁t", "h"),
    ("th", "e"),
    ("▁th", "e"),
    ("o", "r"),
    ("l", "d"),
    ("▁", "w"),
    ("▁w", "or"),
    ("▁wor", "ld"),
    ("\n", "\n"),
    ("▁", "▁"),
    ("e", "▁"),
    ("\n", "▁"),  # a merge across a line break, which the newline split must keep from firing
]
LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SHAPE = {"hidden": 64, "ffn": 96, "heads": 4, "head_dim": 16, "full_head_dim": 32, "window": 8}
ROPE = {"full_theta": 1e6, "swa_theta": 1e4, "partial": 0.25}  # Gemma4TextConfig's defaults


def vocab() -> tuple[list[str], list[int]]:
    pieces = BASE + [left + right for left, right in MERGES]
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = SPECIAL_TYPES + [6] * 256 + [1] * len(pieces)
    return tokens, types


def hf_config(vocab_size: int) -> Any:
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=vocab_size,
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["ffn"],
        num_hidden_layers=len(LAYERS),
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=2,
        head_dim=SHAPE["head_dim"],
        global_head_dim=SHAPE["full_head_dim"],
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
        layer_types=LAYERS,
        sliding_window=SHAPE["window"],
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        eos_token_id=None,
    )
    config.architectures = ["Gemma4ForCausalLM"]
    return config


QUANTIZED = {"mlp.": "Q4_0", "self_attn.q_proj": "Q8_0", "self_attn.o_proj": "Q8_0"}


def storage_type(hf_name: str, quantize: bool) -> str:
    if quantize:
        for part, kind in QUANTIZED.items():
            if part in hf_name:
                return kind
    return "F32"


def write_gemma4_gguf(path: Path, hf: Any, quantize: bool, **meta: Any) -> None:
    """The HF model's weights as llama.cpp's converter writes a Gemma 4 GGUF. With ``quantize``
    the MLP is Q4_0 and q/o are Q8_0, and the HF model's weights become their round trip so that
    transformers computes the file's values."""
    sliding = [t == "sliding_attention" for t in LAYERS]
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_name("tiny gemma 4")
    writer.add_context_length(512)
    writer.add_embedding_length(SHAPE["hidden"])
    writer.add_block_count(len(LAYERS))
    writer.add_feed_forward_length(SHAPE["ffn"])
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(meta.get("head_count_kv", [2 if s else 1 for s in sliding]))
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_key_length(SHAPE["full_head_dim"])
    writer.add_value_length(SHAPE["full_head_dim"])
    writer.add_key_length_swa(SHAPE["head_dim"])
    writer.add_value_length_swa(SHAPE["head_dim"])
    writer.add_rope_freq_base(ROPE["full_theta"])
    writer.add_rope_freq_base_swa(ROPE["swa_theta"])
    writer.add_rope_dimension_count(SHAPE["full_head_dim"])
    writer.add_rope_dimension_count_swa(SHAPE["head_dim"])
    writer.add_final_logit_softcapping(30.0)
    writer.add_sliding_window(SHAPE["window"])
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(meta.get("shared_kv_layers", 0))
    writer.add_embedding_length_per_layer_input(0)
    tokens, types = vocab()
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_token_merges([f"{left} {right}" for left, right in MERGES])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")

    rotated = int(SHAPE["full_head_dim"] * ROPE["partial"] / 2)
    freqs = [1.0] * rotated + [1e30] * (SHAPE["full_head_dim"] // 2 - rotated)
    writer.add_tensor("rope_freqs.weight", np.array(freqs, dtype=np.float32))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, len(LAYERS))
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            if name == "lm_head.weight":
                continue  # tied; the converter skips it
            base = name.removesuffix(".weight")
            gguf_name = names.get_name(base)
            assert gguf_name is not None, name
            values = tensor.float().numpy()
            kind = storage_type(name, quantize)
            if kind == "F32":
                writer.add_tensor(gguf_name + ".weight", np.ascontiguousarray(values))
                continue
            qtype = gguf.GGMLQuantizationType[kind]
            blocks = gguf.quants.quantize(values, qtype)
            writer.add_tensor(gguf_name + ".weight", blocks, raw_dtype=qtype)
            back = gguf.quants.dequantize(blocks, qtype).reshape(values.shape)
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q8_0-q4_0"])
def test_gemma4_gguf_matches_transformers(tmp_path: Path, cache: Path, quantize: bool) -> None:
    from worker.layers.quant import INT4, INT8, QuantFormat, QuantLinear

    tokens, _ = vocab()
    pair = make_pair(hf_config(len(tokens)), tmp_path / "hf")
    path = tmp_path / "tiny-gemma4.gguf"
    write_gemma4_gguf(path, pair.hf, quantize)

    loaded, model = load_ours(path, "auto")
    cfg = loaded.config
    assert cfg.family == "gemma4" and cfg.layer_kinds == ("sliding", "full", "sliding", "full")
    full, swa = cfg.layers[1], cfg.layers[0]
    assert (swa.head_dim, full.head_dim, swa.num_kv_heads, full.num_kv_heads) == (16, 32, 2, 1)
    assert full.k_eq_v and not swa.k_eq_v
    assert full.rope.rope_type == "proportional" and full.rope.partial_rotary_factor == 0.25
    assert cfg.final_logit_softcapping == 30.0 and cfg.sliding_window == 8
    formats = {m.format for m in model.modules() if isinstance(m, QuantLinear)}
    if quantize:
        assert formats == {QuantFormat(INT4, 32), QuantFormat(INT8, 32)}
    else:
        assert not formats
    check_prompt_logits(Pair(pair.hf, model, cfg, pair.prompt))
    check_greedy(Pair(pair.hf, model, cfg, pair.prompt))
    if quantize:  # --quantize none: the same file dequantized, the same logits
        _, floats = load_ours(path, "none")
        assert not any(isinstance(m, QuantLinear) for m in floats.modules())
        check_prompt_logits(Pair(pair.hf, floats, cfg, pair.prompt))


def test_gemma4_gguf_tokenizer(tmp_path: Path, cache: Path) -> None:
    from worker.loading.gguf_convert import convert_gguf
    from worker.loading.loader import open_model_files

    tokens, _ = vocab()
    pair = make_pair(hf_config(len(tokens)), tmp_path / "hf")
    path = tmp_path / "tiny-gemma4.gguf"
    write_gemma4_gguf(path, pair.hf, quantize=False)
    _, _, tokenizer, source = open_model_files(path, progress=False)
    assert source == path
    ids = {token: index for index, token in enumerate(tokens)}

    def spell(*pieces: str) -> list[int]:
        return [ids[p] for p in pieces]

    # spaces are '▁' and merge by rank; no space is put before the first word
    assert tokenizer.encode("the world") == spell("the", "▁world")
    assert tokenizer.encode("the  world") == spell("the", "▁", "▁world")
    # a character no piece holds falls back to its UTF-8 bytes
    assert tokenizer.encode("é.") == spell("<0xC3>", "<0xA9>", ".")
    # newlines merge among themselves but never with the text around them
    assert tokenizer.encode("the\n\nthe") == spell("the", "\n\n", "the")
    assert tokenizer.encode("e\n the") == spell("e", "\n", "▁", "the")
    # control tokens stay whole; BOS comes first; decoding gives the text back
    assert tokenizer.encode("<turn|>the") == spell("<turn|>", "the")
    assert tokenizer.prefix_ids == [2]
    assert tokenizer.decode(tokenizer.encode("the world é\n\nor")) == "the world é\n\nor"
    # a chat turn's end and a tool call's end stop generation, as the release's config says
    assert tokenizer.eos_ids == frozenset({1, ids["<turn|>"], ids["<|tool_response>"]})
    directory = convert_gguf(path, progress=False)
    template = json.loads((directory / "tokenizer_config.json").read_text())["chat_template"]
    assert template.startswith("{{ bos_token }}")


def test_gemma4_gguf_features_of_other_sizes_fail_before_converting(
    tmp_path: Path, cache: Path
) -> None:
    from worker.loading.gguf_convert import convert_gguf

    tokens, _ = vocab()
    pair = make_pair(hf_config(len(tokens)), tmp_path / "hf")
    shared = tmp_path / "shared.gguf"
    write_gemma4_gguf(shared, pair.hf, quantize=False, shared_kv_layers=2)
    with pytest.raises(ModelLoadError, match="KV sharing"):
        convert_gguf(shared, progress=False)
    assert not any(p.is_dir() for p in cache.glob("*"))  # nothing half-written is left
    uneven = tmp_path / "uneven.gguf"
    write_gemma4_gguf(uneven, pair.hf, quantize=False, head_count_kv=[2, 1, 4, 1])
    with pytest.raises(ModelLoadError, match="KV head counts differ"):
        convert_gguf(uneven, progress=False)
