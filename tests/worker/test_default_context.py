"""The worker's default context: the default Gemma 3 270M gets its full 32k on the CPU (all
sessions' KV within `CPU_KV_BUDGET`), a bigger model never less than 4096 tokens."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from worker.main import (
    CPU_KV_BUDGET,
    CPU_MIN_CONTEXT,
    _memory_capped_context,
    _session_kv_bytes,
)
from worker.models.config import ModelConfig
from worker.models.registry import build_model


def _meta_model(config: dict[str, Any]) -> Any:
    return build_model(ModelConfig.from_hf(config), "meta", torch.float32)


@pytest.fixture(scope="module")
def gemma_270m(default_model_dir: Path) -> Any:
    return _meta_model(json.loads((default_model_dir / "config.json").read_text()))


def test_default_model_kv_cost_and_full_context_on_cpu(gemma_270m: Any) -> None:
    if psutil.virtual_memory().available * 0.5 < CPU_KV_BUDGET:
        pytest.skip("less than 4 GiB of RAM available: the RAM cap applies first")
    per_token = _session_kv_bytes(gemma_270m, 8192) - _session_kv_bytes(gemma_270m, 4096)
    assert per_token == 4096 * 3 * 2 * 256 * 4  # 3 full layers, 1 KV head of 256, fp32: 6 KiB
    rings = _session_kv_bytes(gemma_270m, 4096) - 4096 * 6 * 1024
    assert rings == 15 * 2 * 256 * 4 * (512 + 16)  # 15 sliding layers, 528-entry rings
    assert _memory_capped_context(gemma_270m, 8, 32768) == 32768
    assert 8 * _session_kv_bytes(gemma_270m, 32768) < CPU_KV_BUDGET


def test_big_model_keeps_the_old_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 GiB free, whatever this machine has right now: the floor, not the RAM cap, decides.
    monkeypatch.setattr(
        psutil, "virtual_memory", lambda: types.SimpleNamespace(available=64 * (1 << 30))
    )
    config = {  # Llama 3 8B's attention: 32 layers x 8 KV heads x 128 dims, 128 KiB a token
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 4096,
        "intermediate_size": 64,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
    }
    model = _meta_model(config)
    assert _memory_capped_context(model, 8, 32768) == CPU_MIN_CONTEXT


def test_hybrid_state_counts_in_the_session_cost() -> None:
    """The memory cap sizes a session by the family's own cache: for Qwen3.5-MoE that is the
    full layers' KV plus the DeltaNet state and its snapshots, a fixed cost per session."""
    import json
    from pathlib import Path

    import torch

    from worker.main import _session_kv_bytes
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    root = Path(__file__).resolve().parents[2]
    config = json.loads((root / "examples" / "qwen3_5_moe" / "config.json").read_text())
    model = build_model(ModelConfig.from_hf(config), "meta", torch.bfloat16)
    small, large = _session_kv_bytes(model, 256), _session_kv_bytes(model, 512)
    per_token = (large - small) // 256
    assert small - 256 * per_token > 100 << 20  # > 100 MiB of state before any token


def test_a_default_prefix_pool_too_small_for_1024_tokens_is_left_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a 24 GB limit the Qwen3.5 file's default pool came to 67 MB: no block, no state,
    yet its prefill kept states at block ends and fitted a 1,024 chunk (session 32)."""
    from worker import main as worker_main

    root = Path(__file__).resolve().parents[2]
    config = json.loads((root / "examples" / "qwen3_5_moe" / "config.json").read_text())
    qwen = build_model(ModelConfig.from_hf(config), "meta", torch.bfloat16)
    lines: list[str] = []
    monkeypatch.setattr(worker_main, "log", lines.append)
    assert worker_main._useful_prefix_gb(qwen, 70012108 / (1 << 30)) == 0.0
    assert lines[-1].startswith("prefix cache off: the 0.07 GiB left for it would hold less")
    smallest = _session_kv_bytes(qwen, 1024) / (1 << 30)
    assert worker_main._useful_prefix_gb(qwen, smallest) == smallest
    assert worker_main._useful_prefix_gb(qwen, 8.0) == 8.0 and len(lines) == 1
    assert worker_main._useful_prefix_gb(qwen, 0.05, chosen=True) == 0.05  # the user's, kept
    assert lines[-1].startswith("warning: --prefix-cache-gb 0.05 holds less than 1024 tokens")


def test_the_cpu_default_pool_is_kept_for_the_default_model_and_dropped_for_a_31b(
    gemma_270m: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU default pool (0.25 GiB) holds 1,024 tokens of Gemma 3 270M; of Gemma 4 31B in
    fp32 (1.7 GiB for 1,024 tokens) it held no block, so it is left off."""
    from worker import main as worker_main

    monkeypatch.setattr(worker_main, "log", lambda line: None)
    assert worker_main._useful_prefix_gb(gemma_270m, 0.25) == 0.25
    root = Path(__file__).resolve().parents[2]
    big = _meta_model(json.loads((root / "examples" / "gemma4_31b" / "config.json").read_text()))
    assert worker_main._useful_prefix_gb(big, 0.25) == 0.0
