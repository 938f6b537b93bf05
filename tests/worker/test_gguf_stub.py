"""tools/gguf_stub.py, the files BENCHMARKS' and the example READMEs' GGUF memory figures come
from: a shrunk Gemma 4 / Qwen3.5-MoE layout in each scheme is read by the loader (header, then
the tensors: zeros), kept in the formats llama.cpp's type choices call for, and steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import gguf_stub  # noqa: E402

# K-quant blocks run 256 weights along a row: every matrix's input width is a multiple of it
GEMMA4 = {
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
    "num_key_value_heads": 1, "num_global_key_value_heads": 1, "head_dim": 128,
    "global_head_dim": 256, "num_hidden_layers": 8, "sliding_window": 64, "vocab_size": 1024,
    "vocab_size_per_layer_input": 1024,
    "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
}  # fmt: skip
QWEN = {
    "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "num_hidden_layers": 8, "vocab_size": 1024,
}  # fmt: skip


def shrunk(example: str, overrides: dict[str, Any]) -> dict[str, Any]:
    config = json.loads((REPO / "examples" / example / "config.json").read_text())
    return {**config.get("text_config", config), **overrides}


def kept(path: Path) -> dict[str, str]:
    """HF module -> the format auto keeps it in, from the file's header."""
    from worker.loading.quantize import plan_for_gguf

    return {name: fmt.describe() for name, fmt in plan_for_gguf(path).items()}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))


def steps(path: Path) -> torch.Tensor:
    """The stub loaded as `tokenpipe run` loads it (auto, CPU), one prefill: its logits."""
    from worker.device.cuda_setup import prepare_model_for_device
    from worker.loading.loader import load_model
    from worker.models.step import StepInput

    model = prepare_model_for_device(
        load_model(path, "cpu", torch.float32, progress=False), "cpu", cuda_graphs=False
    )
    kv = model.make_kv_cache(1, 32)
    return model(StepInput.single(list(range(3, 12)), 0, 0, device="cpu"), kv)


@pytest.mark.parametrize("scheme", ["q4_k_m", "q4_0"])
def test_gemma4_stub_is_kept_in_llama_cpp_s_types(tmp_path: Path, cache: None, scheme: str):
    path = tmp_path / f"gemma4-{scheme}.gguf"
    size = gguf_stub.write_stub(shrunk("gemma4_31b", GEMMA4), scheme, path)
    assert path.stat().st_size == size
    formats = kept(path)
    # the tied embedding (Q6_K in both) is one int6 table shared with the head
    assert formats["model.embed_tokens"] == formats["lm_head"] == "int6 g16"
    tables = {"model.embed_tokens", "lm_head"}
    six_bits = {n for n, f in formats.items() if f == "int6 g16"} - tables
    if scheme == "q4_0":  # a QAT file's type everywhere else: nothing at 6 bits
        assert not six_bits
    else:  # the first and last eighth (0, 7) and every third between (3, 6: (i - 1) % 3 == 2)
        assert {n for n in six_bits if n.endswith("down_proj")} == {
            f"model.layers.{i}.mlp.down_proj" for i in (0, 3, 6, 7)
        }
        assert all(n.endswith(("down_proj", "v_proj")) for n in six_bits)
    # full-attention layers share K and V: no v_proj there
    assert "model.layers.3.self_attn.v_proj" not in formats
    assert {f for n, f in formats.items() if n.endswith("gate_proj")} == {"int4 g32"}
    logits = steps(path)
    assert logits.shape[-1] == 1024 and torch.isfinite(logits).all()


@pytest.mark.filterwarnings("ignore:divide by zero")  # A_log = log(-ssm_a) of a zero ssm_a
@pytest.mark.parametrize("scheme", ["q4_k_m", "q4_0"])
def test_qwen_stub_is_kept_in_llama_cpp_s_types(tmp_path: Path, cache: None, scheme: str):
    path = tmp_path / f"qwen-{scheme}.gguf"
    gguf_stub.write_stub(shrunk("qwen3_5_moe", QWEN), scheme, path)
    formats = kept(path)
    assert formats["lm_head"] == "int6 g16"  # untied: output.weight at Q6_K
    assert formats["model.embed_tokens"] == "int4 g32"
    # one kind for a layer's experts: a Q6_K down_proj joins the layer's int4
    experts = {f for n, f in formats.items() if n.endswith("mlp.experts")}
    assert experts == {"int4 g32"}
    fused = {f for n, f in formats.items() if n.endswith("in_proj_qkv")}
    # Q5_K (not repackable) is quantized again: int8 g32; Q4_0 stays int4
    assert fused == ({"int8 g32"} if scheme == "q4_k_m" else {"int4 g32"})
    logits = steps(path)
    assert logits.shape[-1] == 1024 and torch.isfinite(logits).all()
