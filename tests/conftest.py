"""Shared fixtures.

- `default_model_dir`: the default model (Gemma 3 270M GGUF) converted once into its cache
  directory (the real cache, so later sessions reuse it; `TOKENPIPE_CACHE` moves it).
- `tiny_checkpoint_factory`: writes a tiny random HF checkpoint directory (llama or gemma3
  config, safetensors, a byte-level tokenizer.json) for fast loader tests.
- `hf_gguf_oracle`: transformers' own reading of the default GGUF (config + dequantized fp32
  state dict), built once per session for the tests that compare against it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_gguf() -> Path:
    from worker.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_model_dir(default_model_gguf: Path) -> Path:
    """The converted (float32) cache directory of the default model."""
    from worker.gguf_convert import convert_gguf

    return convert_gguf(default_model_gguf, torch.float32, progress=False)


# ---------------------------------------------------------------------------------------------
# Tiny checkpoints


def byte_level_tokenizer_json(extra_tokens: int = 0) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json: 256 byte tokens, a few merges, <bos>/<eos>/<eot>."""
    import tokenizers
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    from worker.tokenizer import byte_level_decoder

    alphabet = sorted(byte_level_decoder(), key=lambda ch: byte_level_decoder()[ch])
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    for i in range(extra_tokens):
        vocab[f"tok{i}"] = len(vocab)
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<bos>", "<eos>", "<eot>")]
    )
    bos = backend.token_to_id("<bos>")
    backend.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0", pair="<bos>:0 $A:0 $B:1", special_tokens=[("<bos>", bos)]
    )
    return json.loads(backend.to_str())


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 256 + 4,
        "eos_token_id": 256 + 5,
        "torch_dtype": "float32",
    }
    if family == "llama":
        common.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
    else:
        raise ValueError(family)
    common.update(overrides)
    return common


def llama_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    return shapes


TinyFactory = Callable[..., Path]


@pytest.fixture
def tiny_checkpoint_factory(tmp_path: Path) -> TinyFactory:
    """make(name="ckpt", dtype=torch.float32, shards=1, config_overrides={}, weights=True,
    generation_config={...} | None, tokenizer_config={...} | None, prefix="") -> directory.

    Weights are seeded random values; `prefix` prepends a name prefix to every tensor (e.g.
    "model.language_model." after stripping "model." to mimic a multimodal checkpoint).
    """
    from safetensors.torch import save_file

    def make(
        name: str = "ckpt",
        dtype: torch.dtype = torch.float32,
        shards: int = 1,
        config_overrides: dict[str, Any] | None = None,
        weights: bool = True,
        generation_config: dict[str, Any] | None = None,
        tokenizer_config: dict[str, Any] | None = None,
        extra_tensors: dict[str, torch.Tensor] | None = None,
        rename: Callable[[str], str] | None = None,
    ) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        tokenizer_json = byte_level_tokenizer_json()
        vocab_size = 256 + 4 + 3
        overrides = dict(config_overrides or {})
        config = tiny_config("llama", overrides.pop("vocab_size", vocab_size), **overrides)
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json))
        if generation_config is not None:
            (directory / "generation_config.json").write_text(json.dumps(generation_config))
        if tokenizer_config is not None:
            (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        if not weights:
            return directory
        generator = torch.Generator().manual_seed(0)
        tensors = {
            tensor_name: (torch.randn(shape, generator=generator) * 0.05).to(dtype)
            for tensor_name, shape in llama_tensor_shapes(config).items()
        }
        if rename is not None:
            tensors = {rename(k): v for k, v in tensors.items()}
        if extra_tensors:
            tensors.update(extra_tensors)
        names = list(tensors)
        if shards == 1:
            save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for index in range(shards):
                filename = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
                part = {k: tensors[k] for k in names[index::shards]}
                save_file(part, str(directory / filename), metadata={"format": "pt"})
                weight_map.update({k: filename for k in part})
            (directory / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map})
            )
        return directory

    return make


# ---------------------------------------------------------------------------------------------
# The transformers oracle for the default GGUF


class HFGGUFOracle:
    """transformers' reading of a GGUF: its config object and fp32 dequantized state dict."""

    def __init__(self, gguf_path: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        torch.set_num_threads(2)
        self.config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        # The same call `from_pretrained(gguf_file=...)` makes for this architecture (it needs
        # `accelerate` only to place the model, which these tests do themselves).
        parsed = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
        )
        self.state_dict: dict[str, torch.Tensor] = parsed["tensors"]
        self._model: Any = None

    def model(self) -> Any:
        """The transformers model with the dequantized weights (built on first use)."""
        if self._model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
            missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
            model.tie_weights()
            assert not unexpected, unexpected
            assert set(missing) <= {"lm_head.weight"}, missing
            self._model = model.eval()
        return self._model


@pytest.fixture(scope="session")
def hf_gguf_oracle(default_model_gguf: Path) -> HFGGUFOracle:
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return HFGGUFOracle(default_model_gguf)
