"""Shared harness for the model-family tests (HF transformers is the oracle), plus config tests.

Each family test builds a tiny random HF model, saves it with ``save_pretrained`` (safetensors),
loads it with ours and compares logits and greedy tokens in float32 on the CPU.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from worker.layers.kv import KVCache
from worker.models.causal_lm import CausalLM
from worker.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from worker.models.registry import build_model
from worker.models.step import StepInput

torch.set_num_threads(1)  # the CPU is shared; more threads only spin

PROMPT_LEN = 64
GREEDY_TOKENS = 32
REL_TOL = 1e-4


@dataclass
class Pair:
    """Our model and transformers' on the same weights."""

    hf: Any
    ours: CausalLM
    config: ModelConfig
    prompt: list[int]


def make_pair(hf_config: Any, tmp_dir: Path, seed: int = 0) -> Pair:
    """Random HF model -> save_pretrained -> load into ours (through config.json + safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    hf = hf.float().eval()
    with torch.no_grad():  # spread the weights so that norms and scalars matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(
                    torch.randn_like(p) * 0.3 + (0.0 if "gemma3" in hf_config.model_type else 1.0)
                )
            else:
                p.normal_(0.0, 0.08)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
    hf.save_pretrained(tmp_dir)
    raw = json.loads((tmp_dir / "config.json").read_text())
    config = ModelConfig.from_hf(raw)
    ours = build_model(config, "cpu", torch.float32)
    ours.load_weights(iter_safetensors(tmp_dir))
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
    return Pair(hf=hf, ours=ours, config=config, prompt=prompt)


def iter_safetensors(directory: Path):  # type: ignore[no-untyped-def]
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def hf_logits(pair: Pair, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of every position."""
    with torch.no_grad():
        return pair.hf(torch.tensor([ids])).logits[0].float()


def prefill(
    model: CausalLM, kv: KVCache, ids: list[int], slot: int = 0, start: int = 0, chunk: int = 0
) -> list[torch.Tensor]:
    """Feed ``ids`` after ``start`` cached tokens in chunks; logits [vocab] of each chunk's end."""
    chunk = chunk or len(ids)
    out = []
    for i in range(0, len(ids), chunk):
        piece = ids[i : i + chunk]
        out.append(model(StepInput.single(piece, slot, start + i), kv)[0])
    return out


def ours_greedy(pair: Pair, n: int, max_context: int = 256) -> list[int]:
    kv = pair.ours.make_kv_cache(2, max_context)
    logits = prefill(pair.ours, kv, pair.prompt, slot=1)[-1]
    tokens = [int(logits.argmax())]
    for _ in range(n - 1):
        pos = len(pair.prompt) + len(tokens) - 1
        logits = pair.ours(StepInput.single([tokens[-1]], 1, pos), kv)[0]
        tokens.append(int(logits.argmax()))
    return tokens


def hf_greedy(pair: Pair, n: int) -> list[int]:
    with torch.no_grad():
        out = pair.hf.generate(
            torch.tensor([pair.prompt]),
            attention_mask=torch.ones(1, len(pair.prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(pair.prompt) :].tolist()


# -- the checks every family runs (called from test_models_<family>.py) -------------------------


def check_prompt_logits(pair: Pair) -> None:
    ref = hf_logits(pair, pair.prompt)  # [64, vocab]
    kv = pair.ours.make_kv_cache(1, 128)
    last = prefill(pair.ours, kv, pair.prompt)[-1]
    assert rel_err(last, ref[-1]) < REL_TOL
    # every position: token-by-token prefill through the KV cache
    kv = pair.ours.make_kv_cache(1, 128)
    every = torch.stack(prefill(pair.ours, kv, pair.prompt, chunk=1))
    assert every.shape == ref.shape
    for pos in range(len(pair.prompt)):
        assert rel_err(every[pos], ref[pos]) < REL_TOL, f"position {pos}"


def check_greedy(pair: Pair) -> None:
    assert ours_greedy(pair, GREEDY_TOKENS) == hf_greedy(pair, GREEDY_TOKENS)


def check_chunked_prefill(pair: Pair) -> None:
    kv = pair.ours.make_kv_cache(1, 128)
    one_shot = prefill(pair.ours, kv, pair.prompt)[-1]
    for chunk in (1, 5, 17, 64):
        kv = pair.ours.make_kv_cache(1, 128)
        chunked = prefill(pair.ours, kv, pair.prompt, chunk=chunk)[-1]
        assert rel_err(chunked, one_shot) < REL_TOL, f"chunk {chunk}"
        # and the cache it left behind continues the same way
        nxt = pair.ours(StepInput.single([7], 0, len(pair.prompt)), kv)[0]
        kv1 = pair.ours.make_kv_cache(1, 128)
        prefill(pair.ours, kv1, pair.prompt)
        ref = pair.ours(StepInput.single([7], 0, len(pair.prompt)), kv1)[0]
        assert rel_err(nxt, ref) < REL_TOL, f"chunk {chunk} then decode"


def check_batched_step(pair: Pair) -> None:
    """3 sequences (2 decodes with different cached lengths + 1 prefill chunk) in one step."""
    model, p = pair.ours, pair.prompt
    cached = [40, 23, 10]
    new = [[p[40]], [p[23]], p[10:30]]
    slots = [2, 0, 1]
    kv = model.make_kv_cache(3, 128)
    for slot, c in zip(slots, cached, strict=True):
        prefill(model, kv, p[:c], slot=slot, chunk=16)
    ids = [t for seq in new for t in seq]
    positions = [c + j for c, seq in zip(cached, new, strict=True) for j in range(len(seq))]
    step = StepInput(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        slots=slots,
        cached_lens=cached,
        new_lens=[len(s) for s in new],
    )
    batched = model(step, kv)
    assert batched.shape == (3, pair.config.vocab_size)
    for i, (c, seq) in enumerate(zip(cached, new, strict=True)):
        alone_kv = model.make_kv_cache(1, 128)
        prefill(model, alone_kv, p[:c])
        alone = model(StepInput.single(seq, 0, c), alone_kv)[0]
        assert rel_err(batched[i], alone) < REL_TOL, f"sequence {i}"
    # the batched step left each slot in the state a lone run would: decode once more
    ref = hf_logits(pair, p[:42])
    nxt = model(StepInput.single([p[41]], 2, 41), kv)[0]
    assert rel_err(nxt, ref[-1]) < REL_TOL


def check_long_decode(pair: Pair, total: int) -> None:
    """Token-by-token decoding far past the sliding window matches HF at every position."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, pair.config.vocab_size, (total,), generator=gen).tolist()
    ref = hf_logits(pair, ids)
    kv = pair.ours.make_kv_cache(1, total)
    ours = prefill(pair.ours, kv, ids[:3]) + prefill(pair.ours, kv, ids[3:], start=3, chunk=1)
    assert rel_err(ours[0], ref[2]) < REL_TOL
    for pos in range(3, total):
        assert rel_err(ours[pos - 2], ref[pos]) < REL_TOL, f"position {pos}"


def check_batched_long_decode(pair: Pair, total: int = 70) -> None:
    """Three sequences decoding together (slots 2, 0, 1, at different positions) far past the
    sliding window equal each decoding alone at every step: per-row ring masks, KV writes."""
    model, p = pair.ours, pair.prompt
    starts, slots = [3, 10, 17], [2, 0, 1]
    kv = model.make_kv_cache(3, total + 20)
    alone = [model.make_kv_cache(1, total + 20) for _ in starts]
    for slot, start, kv1 in zip(slots, starts, alone, strict=True):
        prefill(model, kv, p[:start], slot=slot)
        prefill(model, kv1, p[:start])
    for step in range(total):
        ids = [p[(start + step) % len(p)] for start in starts]
        batched = model(
            StepInput(
                input_ids=torch.tensor(ids),
                positions=torch.tensor([start + step for start in starts]),
                slots=slots,
                cached_lens=[start + step for start in starts],
                new_lens=[1, 1, 1],
            ),
            kv,
        )
        for i, (start, kv1) in enumerate(zip(starts, alone, strict=True)):
            ref = model(StepInput.single([ids[i]], 0, start + step), kv1)[0]
            assert rel_err(batched[i], ref) < REL_TOL, f"sequence {i}, step {step}"


def check_truncate_and_resume(pair: Pair) -> None:
    """Cache truncated to what keepable_prefix allows, then a different suffix: matches HF."""
    p = pair.prompt
    kv = pair.ours.make_kv_cache(1, 128)
    prefill(pair.ours, kv, p, chunk=13)
    keep = kv.keepable_prefix(len(p), len(p) - 3)
    assert keep in (0, len(p) - 3)
    other = [(t + 1) % pair.config.vocab_size for t in p[keep:]]
    ids = p[:keep] + other
    last = prefill(pair.ours, kv, other, start=keep, chunk=5)[-1]
    assert rel_err(last, hf_logits(pair, ids)[-1]) < REL_TOL


def check_cpu_packed(pair: Pair) -> None:
    """``prepare_for_cpu`` (merged projections, packed weights, packed tied/untied head, the
    kernel's norm, rotary and residual helpers) changes nothing beyond fp32 rounding: the
    oracle checks pass on the packed copy too."""
    from worker.device import cpu_gemv

    if cpu_gemv.kernel() is None:
        pytest.skip("no AVX2/FMA CPU kernel")
    packed = copy.deepcopy(pair.ours)
    assert packed.prepare_for_cpu() > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    twin = Pair(hf=pair.hf, ours=packed, config=pair.config, prompt=pair.prompt)
    check_prompt_logits(twin)
    check_greedy(twin)
    check_batched_step(twin)
    check_long_decode(twin, total=90)  # batch-1 decode through wrapped rings (slices and masks)
    check_batched_long_decode(twin)  # the same with several sequences in one step


# -- config tests -------------------------------------------------------------------------------


def test_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="SUPPORTED_ARCHITECTURES") as err:
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert "LlamaForCausalLM" in str(err.value)
    assert set(SUPPORTED_ARCHITECTURES) >= {"Gemma3ForCausalLM", "Gemma4ForCausalLM"}


def test_bad_config_values_are_clear_errors() -> None:
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 3,
    }
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf(base)
    with pytest.raises(ValueError, match="'vocab_size' must be an integer"):
        ModelConfig.from_hf({**base, "num_key_value_heads": 2, "vocab_size": "x"})
    with pytest.raises(ValueError, match="unsupported rope type 'dynamic'"):
        ModelConfig.from_hf({**base, "num_key_value_heads": 2, "rope_scaling": {"type": "dynamic"}})
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_hf([])  # type: ignore[arg-type]
    cfg = ModelConfig.from_hf({**base, "num_key_value_heads": 2})
    assert cfg.family == "llama" and cfg.layers[0].head_dim == 4 and cfg.layers[0].num_kv_heads == 2


def test_old_style_gemma3_config() -> None:
    """Hub configs written before transformers 5: rope_theta / rope_local_base_freq / pattern."""
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 6,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "sliding_window": 4,
            "sliding_window_pattern": 3,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "query_pre_attn_scalar": 64,
        }
    )
    assert cfg.layer_kinds == ("sliding", "sliding", "full") * 2
    assert cfg.layers[2].rope.rope_type == "linear" and cfg.layers[2].rope.factor == 8.0
    assert cfg.layers[0].rope.theta == 1e4 and cfg.layers[0].rope.rope_type == "default"
    assert cfg.attention_scale == 64**-0.5 and cfg.tie_word_embeddings


def test_sparse_multimodal_gemma3_config_uses_text_config_and_defaults() -> None:
    """gemma-3-4b-it style: the text stack lives in a sparse text_config."""
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "eos_token_id": [1, 106],
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "model_type": "gemma3_text",
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "vision_config": {"model_type": "siglip_vision_model"},
        }
    )
    assert cfg.family == "gemma3" and cfg.vocab_size == 262_208
    assert (cfg.num_attention_heads, cfg.layers[0].num_kv_heads, cfg.layers[0].head_dim) == (
        8,
        4,
        256,
    )
    assert cfg.eos_token_ids == (1, 106) and cfg.sliding_window == 1024
    assert cfg.layer_kinds[:6] == ("sliding",) * 5 + ("full",)
    assert cfg.layers[5].rope.factor == 8.0 and cfg.layers[5].rope.theta == 1e6
