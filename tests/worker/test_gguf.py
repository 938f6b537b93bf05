"""GGUF -> cached HF directory: tensors and config equal transformers' own GGUF reading, the
llama Q/K permutation is undone, the cache is keyed and atomic, corrupt files fail clearly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from worker.loading.checkpoint import ModelLoadError, open_checkpoint, read_safetensors_header
from worker.loading.gguf_convert import cache_root, convert_gguf, unpermute_rows

gguf = pytest.importorskip("gguf")


# ---------------------------------------------------------------------------------------------
# The default model against transformers


@pytest.mark.slow
def test_default_model_tensors_equal_transformers(default_model_dir: Path, hf_gguf_oracle) -> None:
    checkpoint = open_checkpoint(default_model_dir)
    expected = hf_gguf_oracle.state_dict
    ours = dict(checkpoint.iter_tensors())
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name].float()), name


@pytest.mark.slow
def test_default_model_config_matches_transformers(default_model_dir: Path, hf_gguf_oracle) -> None:
    ours = json.loads((default_model_dir / "config.json").read_text())
    theirs = hf_gguf_oracle.config.to_dict()
    assert ours["architectures"] == ["Gemma3ForCausalLM"]
    for key in [
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_activation",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "query_pre_attn_scalar",
        "sliding_window",
        "layer_types",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
    ]:
        assert ours[key] == theirs[key], key
    assert ours["rope_local_base_freq"] == 10000.0 and ours["rope_theta"] == 1e6
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]


def test_default_model_cache_layout(default_model_dir: Path) -> None:
    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= (
        names
    )
    header = read_safetensors_header(default_model_dir / "model.safetensors")
    assert header["model.embed_tokens.weight"].shape == (262144, 640)
    assert header["model.layers.0.self_attn.q_proj.weight"].shape == (1024, 640)
    assert "lm_head.weight" not in header  # tied
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is True and tokenizer_config["bos_token"] == "<bos>"


# ---------------------------------------------------------------------------------------------
# A tiny llama GGUF, written here the way llama.cpp writes one


SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "▁h", "▁w", "or", "ld"]
SPM_PIECES += ["▁he", "▁hello", "▁wor", "▁world", "x", "y", "▁x", "12", "1", "2", "é", "▁é"]
TINY = {"hidden": 64, "inter": 128, "layers": 2, "heads": 4, "kv_heads": 2}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (the inverse of what we undo)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, scores, types


def hf_tiny_weights(vocab_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    hidden, inter = TINY["hidden"], TINY["inter"]
    head_dim = hidden // TINY["heads"]

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    weights = {"model.embed_tokens.weight": rand(vocab_size, hidden)}
    weights["model.norm.weight"] = 1 + rand(hidden)
    weights["lm_head.weight"] = rand(vocab_size, hidden)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = 1 + rand(hidden)
        weights[p + "post_attention_layernorm.weight"] = 1 + rand(hidden)
        weights[p + "self_attn.q_proj.weight"] = rand(TINY["heads"] * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = rand(TINY["kv_heads"] * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = rand(TINY["kv_heads"] * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = rand(hidden, TINY["heads"] * head_dim)
        weights[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    return weights


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, module, proj, leaf = (hf_name.split(".") + [""])[:6]
    key = f"{module}.{proj}" if leaf else module
    return f"blk.{layer}.{GGUF_NAMES[key]}.weight"


def write_tiny_llama_gguf(
    path: Path,
    quantize_ffn: bool = True,
    arch: str = "llama",
    ffn_type: str = "Q8_0",
    inter_override: int | None = None,
) -> dict:
    tokens, scores, types = tiny_vocab()
    weights = hf_tiny_weights(len(tokens))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny llama")
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_block_count(TINY["layers"])
    writer.add_feed_forward_length(inter_override or TINY["inter"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    for name, value in weights.items():
        stored = value
        if ".q_proj." in name:
            stored = llama_cpp_permute(value, TINY["heads"])
        elif ".k_proj." in name:
            stored = llama_cpp_permute(value, TINY["kv_heads"])
        if quantize_ffn and ".mlp." in name:
            kind = gguf.GGMLQuantizationType[ffn_type]
            writer.add_tensor(
                gguf_name(name),
                gguf.quants.quantize(stored, kind),
                raw_dtype=kind,
            )
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny-llama.gguf"
    return path, write_tiny_llama_gguf(path)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        assert np.array_equal(unpermute_rows(llama_cpp_permute(weight, heads), heads), weight)


def test_tiny_llama_recovers_the_hf_weights(tiny_gguf, cache: Path) -> None:
    path, weights = tiny_gguf
    directory = convert_gguf(path, progress=False)
    assert directory.parent == cache
    ours = dict(open_checkpoint(directory).iter_tensors())
    assert set(ours) == set(weights)
    for name, value in weights.items():
        if ".mlp." in name:  # Q8_0: equal up to the quantization step
            assert np.allclose(ours[name].numpy(), value, atol=2e-3), name
        else:  # F32: exact, including the un-permuted q/k rows
            assert np.array_equal(ours[name].numpy(), value), name
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is False and config["head_dim"] == 16


@pytest.mark.slow
def test_tiny_llama_matches_transformers(tiny_gguf, cache: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, _ = tiny_gguf
    directory = convert_gguf(path, progress=False)
    hf_config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    expected = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )["tensors"]
    ours = dict(open_checkpoint(directory).iter_tensors())
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    config = json.loads((directory / "config.json").read_text())
    theirs = hf_config.to_dict()
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ]:
        assert config[key] == theirs[key], key
    assert config["rope_theta"] == theirs["rope_parameters"]["rope_theta"]

    from worker.loading.tokenizer import Tokenizer

    checkpoint = open_checkpoint(directory)
    assert checkpoint.tokenizer_path is not None
    ours_tok = Tokenizer.from_file(
        checkpoint.tokenizer_path,
        checkpoint.tokenizer_config,
        checkpoint.generation_config,
        checkpoint.config,
    )
    theirs_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ["hello world", "hello", " hello  world", "xy 12 é", "wörld ☃", "</s> x"]:
        assert ours_tok.prefix_ids + ours_tok.encode(text) == theirs_tok(text)["input_ids"], text
    assert ours_tok.bos_id == 1 and ours_tok.eos_ids == frozenset({2})


# ---------------------------------------------------------------------------------------------
# The cache


@pytest.mark.parametrize("ffn_type", ["Q4_0", "Q4_1"])
def test_tiny_llama_q4_0_and_q4_1_stay_int4(tmp_path: Path, cache: Path, ffn_type: str) -> None:
    """A GGUF whose MLP is Q4_0 (the format of Google's QAT Gemma files) or Q4_1 loads, by
    default, with those matmuls int4 g32 (not dequantized to float), and its logits are the
    float path's (``--quantize none``: the gguf package's dequantization): the repack is
    exact, so only the kernels' summation order differs."""
    from worker.device.cuda_setup import prepare_model_for_device
    from worker.layers.quant import INT4, QuantFormat, QuantLinear
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions
    from worker.models.step import StepInput

    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, ffn_type=ffn_type)

    def run(mode: str) -> tuple[list[torch.Tensor], list[QuantLinear]]:
        loaded = load_model(path, "cpu", torch.float32, progress=False,
                            quantize=QuantizeOptions(mode))  # fmt: skip
        model = prepare_model_for_device(loaded, "cpu", cuda_graphs=False)
        kv = model.make_kv_cache(1, 64)
        prompt = StepInput.single(list(range(3, 20)), 0, 0, device="cpu")
        one = StepInput.single([7], 0, 17, device="cpu")
        logits = [model(prompt, kv), model(one, kv)]
        return logits, [m for m in model.modules() if isinstance(m, QuantLinear)]

    kept, quantized = run("auto")
    assert len(quantized) == 3 * TINY["layers"]  # gate, up and down of each layer
    assert all(m.format == QuantFormat(INT4, 32) for m in quantized)
    floats, none = run("none")
    assert not none
    for got, want in zip(kept, floats, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_other_quantized_types_are_quantized_again(
    tmp_path: Path, cache: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A matrix of a type that does not repack as it is (Q5_1 here; Q5_K in llama.cpp's Q4_K_M
    mixes) loads as int8 g32 quantized again from its values, not as a float copy; one notice
    names them; the logits stay those of the dequantized file within int8's rounding."""
    from worker.device.cuda_setup import prepare_model_for_device
    from worker.layers.quant import INT8, QuantFormat, QuantLinear
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions
    from worker.models.step import StepInput

    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, ffn_type="Q5_1")

    def run(mode: str) -> tuple[torch.Tensor, list[QuantLinear]]:
        loaded = load_model(path, "cpu", torch.float32, progress=False,
                            quantize=QuantizeOptions(mode))  # fmt: skip
        model = prepare_model_for_device(loaded, "cpu", cuda_graphs=False)
        kv = model.make_kv_cache(1, 64)
        logits = model(StepInput.single(list(range(3, 20)), 0, 0, device="cpu"), kv)
        return logits, [m for m in model.modules() if isinstance(m, QuantLinear)]

    kept, quantized = run("auto")
    assert len(quantized) == 3 * TINY["layers"]
    assert all(m.format == QuantFormat(INT8, 32) for m in quantized)
    notice = capfd.readouterr().err
    assert "GGUF type Q5_1 is quantized again as int8 g32: blk.0.ffn_" in notice
    assert "warning" not in notice
    floats, _ = run("none")
    assert float((kept - floats).norm() / floats.norm()) < 1e-2


def test_loads_write_no_dequantized_copy(tmp_path: Path, cache: Path) -> None:
    """A GGUF's tensors are read from the file itself, whether kept quantized (``--quantize
    auto``) or dequantized as they stream (``none``, ``int8``, ``int4``): its cache directory
    holds the config and tokenizer only (for 31B, the dequantized copy was 62 GB of bf16), and
    `info` needs no weights either."""
    from worker.info import describe
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions

    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, ffn_type="Q4_0")

    def weight_files() -> list[str]:
        return sorted(p.name for p in cache.glob("*/*.safetensors"))

    described = describe(str(path), 64, torch.float32, progress=False)
    assert described["parameters"] > 0 and described["quantize"] == "auto"
    assert weight_files() == []
    (meta_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    assert meta_dir.name.endswith("-meta")
    names = {p.name for p in meta_dir.iterdir()}
    assert {"config.json", "tokenizer.json", "gguf_source.json"} <= names
    assert json.loads((meta_dir / "gguf_source.json").read_text())["weights"] is False
    for mode in ("auto", "none", "int8", "int4"):
        loaded = load_model(path, "cpu", torch.float32, progress=False,
                            quantize=QuantizeOptions(mode))  # fmt: skip
        assert loaded.meta["checkpoint_dir"] == str(meta_dir), mode
    assert weight_files() == []
    assert [p for p in cache.iterdir() if p.is_dir()] == [meta_dir]

    # a tensor whose shape disagrees with the header's config fails before any weight is read
    bad = tmp_path / "bad.gguf"
    write_tiny_llama_gguf(bad, ffn_type="Q4_0", inter_override=96)
    with pytest.raises(ModelLoadError, match="config does not match the weights"):
        load_model(bad, "cpu", torch.float32, progress=False, quantize=QuantizeOptions("auto"))


def test_cache_is_reused_and_keyed_by_identity(tiny_gguf, cache: Path) -> None:
    path, _ = tiny_gguf
    first = convert_gguf(path, progress=False)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(path, progress=False) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = convert_gguf(path, progress=False)
    assert second != first and second.is_dir()
    bf16 = convert_gguf(path, dtype=torch.bfloat16, progress=False)
    assert bf16 not in (first, second)
    assert read_safetensors_header(bf16 / "model.safetensors")["lm_head.weight"].dtype == "BF16"
    leftovers = [p.name for p in cache.iterdir() if p.name.startswith(".") and p.is_dir()]
    assert leftovers == []
    assert cache_root() == cache


def test_failed_conversion_leaves_no_cache_directory(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "tiny-other.gguf"
    write_tiny_llama_gguf(path, arch="mamba")
    with pytest.raises(
        ModelLoadError, match="'mamba' is not supported; supported: gemma3, gemma4, llama"
    ):
        convert_gguf(path, progress=False)
    assert not any(p.is_dir() for p in cache.iterdir())


# ---------------------------------------------------------------------------------------------
# Corrupt files


def test_truncated_gguf(tiny_gguf, cache: Path) -> None:
    path, _ = tiny_gguf
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelLoadError, match="truncated|corrupt"):
        convert_gguf(path, progress=False)
    path.write_bytes(data[:100])  # inside the metadata
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF"):
        convert_gguf(path, progress=False)


def test_bad_magic_and_bit_flipped_header(tiny_gguf, cache: Path) -> None:
    path, _ = tiny_gguf
    data = bytearray(path.read_bytes())
    flipped = bytearray(data)
    flipped[0] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        convert_gguf(path, progress=False)
    flipped = bytearray(data)
    flipped[16 + 7] ^= 0x40  # the high byte of the metadata count: absurdly many keys
    path.write_bytes(bytes(flipped))
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF"):
        convert_gguf(path, progress=False)


def test_missing_gguf(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", progress=False)


def test_info_counts_the_weights_a_cpu_worker_holds(default_model_gguf: Path) -> None:
    """`tokenpipe info`'s formats are what a CPU worker holds, byte for byte (its Q6_K tensors
    as int8 bytes with a scale per 16), and its device estimate counts those in a GPU's 6-bit
    planes (7 bits a weight), which a worker under a memory limit chooses."""
    from worker.info import describe
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions, summary

    described = describe(str(default_model_gguf), 256, torch.float32, progress=False)
    loaded = load_model(default_model_gguf, "cpu", torch.float32, progress=False,
                        quantize=QuantizeOptions("auto"))  # fmt: skip
    held = summary(loaded.model)
    held["float32 vectors"] = held.pop("float32")
    assert described["formats"] == held and "int6 g16" in held
    # the worker's `info` reply counts the parameters a quantized module keeps in buffers too
    # (it counted the float vectors only: 55,936 of 268,098,176)
    assert loaded.meta["parameters"] == described["parameters"] == 268_098_176
    assert described["weights_bytes"] == sum(entry["bytes"] for entry in held.values())
    six = held["int6 g16"]["bytes"]  # [N, K] int8 + N K / 16 fp16 scales: 9 bits a weight
    device = described["device_estimate"]["weights_bytes"]  # in float32 too: no --dtype given
    assert (described["weights_bytes"] - device) * 9 == six * 2
