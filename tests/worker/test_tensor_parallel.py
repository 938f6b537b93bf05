"""Tensor parallel on the CPU (worker/parallel/): a group of 2 gloo ranks gives the greedy tokens
of 1 rank (fp32), through the real worker processes, for a tiny model of each family (llama,
gemma3, gemma4 with a replicated KV head, qwen3_5_moe with its DeltaNet heads and every
expert split); and the slicing itself, without processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import byte_level_tokenizer_json, tiny_config

from worker.layers.quant import QuantFormat, quantize
from worker.models.config import ModelConfig
from worker.parallel.shard import Shard, _columns, _rows

VOCAB = 263  # the byte-level tokenizer's 259 tokens and a few more; odd: the last rank pads
_COMMON = {"vocab_size": VOCAB, "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "float32"}


def _gemma3() -> dict[str, Any]:
    return {
        **_COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 1
        + ["sliding_attention"],
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "rope_theta": 10_000.0,
        "rope_local_base_freq": 100.0,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
    }


def _gemma4() -> dict[str, Any]:
    """The 31B layout in miniature: K=V full layers with ONE KV head (replicated on 2 ranks)."""
    return {
        **_COMMON,
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 8,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        },
    }


def _qwen3_5_moe() -> dict[str, Any]:
    """Gated DeltaNet and gated full attention layers, each with a sparse MoE (8 experts)."""
    return {
        **_COMMON,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
    }


CONFIGS = {
    "llama": lambda: tiny_config("llama", VOCAB, bos_token_id=256, eos_token_id=257),
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "qwen3_5_moe": _qwen3_5_moe,
}


def _model_dir(root: Path, name: str, family: str | None = None) -> Path:
    family = family or name
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CONFIGS[family]()))
    (directory / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    return directory


class _Worker:
    """`tokenpipe worker` on random weights (seeded: every group size draws the same model)."""

    def __init__(self, model: Path, tp: int, *flags: str) -> None:
        argv = [sys.executable, "-m", "worker.main", "--model", str(model), *flags]
        argv += ["--threads", "1", "--max-sessions", "3", "--max-context", "128"]
        argv += ["--prefill-chunk", "16", "--tensor-parallel", str(tp)]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.stderr = b""
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.ready = self.read()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"worker exited: {self.stderr[-2000:]!r}"
        event: dict[str, Any] = json.loads(line)
        return event

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def finals(self, requests: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
        """Send all, then read until each has its terminal line; by id."""
        for request in requests:
            self.send(request)
        done: dict[Any, dict[str, Any]] = {}
        while len(done) < len(requests):
            event = self.read()
            if event["event"] in ("done", "error"):
                done[event.get("id")] = event
        return done

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=60)


def _conversation(worker: _Worker) -> list[Any]:
    """Greedy turns that exercise prefill chunks, a batched step of two sequences, a warm
    resume and a mismatch resume (truncation; ring buffers on the sliding layers)."""
    greedy = {"temperature": 0, "return_token_ids": True}
    turns: list[Any] = []
    first = worker.finals(
        [
            {"id": 1, "prompt": "hello world, " * 4, "max_new_tokens": 12, "session_id": "a"},
            {"id": 2, "prompt": "well hello", "max_new_tokens": 12, "session_id": "b", **greedy},
        ]
    )
    turns += [first[1]["generated_token_ids"], first[2]["generated_token_ids"]]
    text = "hello world, " * 4 + "and more"  # diverges from what session a holds
    second = worker.finals([{"id": 3, "prompt": text, "max_new_tokens": 8, "session_id": "a"}])
    turns += [second[3]["generated_token_ids"], second[3]["session_reset_reason"]]
    return turns


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_two_ranks_give_the_tokens_of_one(models: Path, family: str) -> None:
    model = _model_dir(models, family)
    one, two = _Worker(model, 1, "--random-weights"), _Worker(model, 2, "--random-weights")
    try:
        assert one.ready["event"] == two.ready["event"] == "ready"
        expected = _conversation(one)
        assert sum(len(ids) for ids in expected[:3]) >= 16 and expected[3] != "new"
        assert _conversation(two) == expected
        two.send({"id": "i", "op": "info"})  # an op that touches no other rank
        assert two.read()["event"] == "info"
    finally:
        assert one.close() == 0
        assert two.close() == 0, two.stderr[-2000:]


def _offloads(worker: _Worker) -> list[Any]:
    """Two named sessions through one device slot (--max-resident 1): each turn moves the
    other session's cache to host memory and brings its own back."""
    out: list[Any] = []
    for turn in range(3):
        for sid, text in (("a", "hello world"), ("b", "well hello")):
            prompt = text + " and more" * turn  # each turn extends the last one's prompt
            request = {"id": f"{sid}{turn}", "prompt": prompt, "session_id": sid}
            done = worker.finals([{**request, "max_new_tokens": 5}])[f"{sid}{turn}"]
            assert done["event"] == "done", done
            out.append((done["generated_token_ids"], done["reused_prompt_tokens"]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sessions_leave_the_devices_and_come_back(models: Path, tmp_path: Path) -> None:
    """Host tier and --session-dir in a group: every rank's part of a slot goes out and back."""
    model = _model_dir(models, "llama-tiers", "llama")
    flags = ("--random-weights", "--max-resident", "1")
    saved = ("--session-dir", str(tmp_path / "sessions"))
    one, two = _Worker(model, 1, *flags), _Worker(model, 2, *flags, *saved)
    try:
        expected = _offloads(one)
        assert sum(reused for _, reused in expected[2:]) > 0  # warm from host memory
        assert _offloads(two) == expected
    finally:
        assert one.close() == 0
        assert two.close() == 0, two.stderr[-2000:]
    again = _Worker(model, 2, *flags, *saved)  # a restarted group reads its saved sessions
    try:
        assert sorted(again.ready["restored_sessions"]) == ["a", "b"]
        text = "hello world" + " and more" * 3
        done = again.finals([{"id": 1, "prompt": text, "session_id": "a", "max_new_tokens": 5}])
        assert done[1]["reused_prompt_tokens"] > 0 and done[1]["event"] == "done"
    finally:
        assert again.close() == 0, again.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quantized_weights_split_on_group_boundaries_give_the_same_tokens(models: Path) -> None:
    """int4, groups of 32 (o_proj's 64 inputs and down_proj's 128 split in whole groups)."""
    from safetensors.torch import save_file

    from worker.loading.random_init import init_random_weights
    from worker.models.registry import build_model

    model = _model_dir(models, "llama-int4", "llama")
    full = build_model(ModelConfig.from_hf(CONFIGS["llama"]()), "cpu")
    init_random_weights(full, seed=3)
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, model / "w.safetensors")
    flags = ("--quantize", "int4", "--group-size", "32")
    one, two = _Worker(model, 1, *flags), _Worker(model, 2, *flags)
    try:
        expected = _conversation(one)
        assert sum(len(ids) for ids in expected[:3]) >= 16
        assert _conversation(two) == expected
    finally:
        assert one.close() == 0
        assert two.close() == 0, two.stderr[-2000:]


# -- the slices, without processes -----------------------------------------------------------


def _config(family: str) -> ModelConfig:
    return ModelConfig.from_hf(CONFIGS[family]())


def test_shard_config_splits_heads_and_replicates_a_lone_kv_head() -> None:
    full = _config("gemma4")
    for rank in (0, 1):
        cfg = Shard(full, 2, rank).config()
        assert cfg.num_attention_heads == 2 and cfg.intermediate_size == 48
        assert cfg.vocab_size == 132  # ceil(263 / 2)
        assert [s.num_kv_heads for s in cfg.layers] == [1, 1, 1, 1]  # 2/2 sliding, 1 full
    shard = Shard(full, 2, 1)
    k_full = torch.arange(32 * 64, dtype=torch.float32).view(32, 64)  # 1 KV head x 32 dims
    assert torch.equal(shard.slice("model.layers.1.self_attn.k_proj.weight", k_full), k_full)
    k_sliding = torch.arange(32 * 64, dtype=torch.float32).view(32, 64)  # 2 heads x 16
    assert torch.equal(
        shard.slice("model.layers.0.self_attn.k_proj.weight", k_sliding), k_sliding[16:]
    )


def test_row_parallel_bias_is_added_once_and_vocab_rows_pad() -> None:
    full = _config("llama")
    bias = torch.ones(64)
    assert torch.equal(Shard(full, 2, 0).slice("model.layers.0.mlp.down_proj.bias", bias), bias)
    assert not Shard(full, 2, 1).slice("model.layers.0.mlp.down_proj.bias", bias).any()
    table = torch.randn(VOCAB, 64)
    last = Shard(full, 2, 1).slice("model.embed_tokens.weight", table)
    assert last.shape == (132, 64)
    assert torch.equal(last[:131], table[132:]) and not last[131].any()


def test_unsupported_splits_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="attention heads"):
        Shard(_config("llama"), 3, 0)
    three_kv = tiny_config("llama", VOCAB, num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(ValueError, match="do not split"):
        Shard(ModelConfig.from_hf(three_kv), 2, 0)
    with pytest.raises(ValueError, match="cannot be replicated"):
        Shard(ModelConfig.from_hf(three_kv), 4, 0)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_weights_split_on_group_boundaries(kind: str) -> None:
    weight = torch.randn(8, 128)
    qw = quantize(weight, QuantFormat(kind, 32), search=False)
    whole = qw.dequantize()
    right = _columns(qw, 64, 64, "down_proj")
    assert right.shape == (8, 64) and torch.equal(right.dequantize(), whole[:, 64:])
    rows = _rows(qw, 4, 6, pad=True)  # rows 4..7 and two zero rows
    assert torch.equal(rows.dequantize()[:4], whole[4:]) and not rows.dequantize()[4:].any()
    with pytest.raises(ValueError, match="whole groups"):
        _columns(qw, 48, 80, "down_proj")


def test_qwen3_5_moe_splits_deltanet_heads_and_every_expert() -> None:
    full = ModelConfig.from_hf(_qwen3_5_moe())
    cfg = Shard(full, 2, 1).config()
    assert cfg.deltanet is not None and cfg.moe is not None
    assert (cfg.deltanet.num_key_heads, cfg.deltanet.num_value_heads) == (1, 2)
    assert (cfg.moe.num_experts, cfg.moe.expert_intermediate_size) == (8, 12)
    shard = Shard(full, 2, 1)
    qkv = torch.arange(2 * 16 + 48, dtype=torch.float32)[:, None]  # q 2x8, k 2x8, v 4x12
    rows = shard.slice("model.layers.0.linear_attn.in_proj_qkv.weight", qkv)[:, 0].tolist()
    assert rows == [*range(8, 16), *range(24, 32), *range(56, 80)]
    gate_up = torch.arange(48, dtype=torch.float32).view(1, 48, 1).expand(8, 48, 1)
    mine = shard.slice("model.layers.0.mlp.experts.gate_up_proj", gate_up)[0, :, 0].tolist()
    assert mine == [*range(12, 24), *range(36, 48)]  # the second half of gate, then of up


def test_unsplit_families_say_so() -> None:
    cfg = _config("llama")
    other = ModelConfig(**{**cfg.__dict__, "family": "mamba"})
    with pytest.raises(ValueError, match="not split yet"):
        Shard(other, 2, 0)
