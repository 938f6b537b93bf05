"""The decode-graph runner: on the CPU its static-buffer path (the body a CUDA graph
captures) must give the eager model's logits; on CUDA, graph replay must equal eager."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from worker.device.cuda_setup import prepare_model_for_device
from worker.device.decode_graphs import DecodeGraphRunner, bucket_for
from worker.device.graphed_lm import GraphedCausalLM
from worker.device.kernels.batched_sampling import RowSampling
from worker.loading.random_init import init_random_weights
from worker.models.config import ModelConfig
from worker.models.registry import build_model
from worker.models.step import StepInput

torch.set_num_threads(2)

CONFIG_31B = Path(__file__).resolve().parents[2] / "examples" / "gemma4_31b" / "config.json"


def tiny_gemma4_config() -> dict:
    """The 31B config shrunk: sliding (window 8, 2 KV heads, dim 16) and K=V full layers
    (1 KV head, dim 32, partial proportional rope), softcap, tied embeddings."""
    config = json.loads(CONFIG_31B.read_text())
    config.update(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_global_key_value_heads=1, head_dim=16, global_head_dim=32, num_hidden_layers=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        sliding_window=8, vocab_size=256, vocab_size_per_layer_input=256,
        max_position_embeddings=512,
    )  # fmt: skip
    return config


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    model = build_model(ModelConfig.from_hf(tiny_gemma4_config()), device, dtype)
    init_random_weights(model, seed=3)
    return model


def test_bucket_for() -> None:
    assert bucket_for(1) == 1 and bucket_for(3) == 4 and bucket_for(33) == 64
    assert bucket_for(64) == 64 and bucket_for(65) is None
    assert bucket_for(5, (8, 2)) == 8


def _prefill(model, kv, prompts: dict[int, list[int]]) -> None:  # type: ignore[no-untyped-def]
    for slot, ids in prompts.items():
        model(StepInput.single(ids, slot, 0, device=model.device), kv)


def _decode_both(device: str, use_graphs: bool, steps: int = 12) -> None:
    """Greedy decode of 3 sequences (padded to bucket 4) past the sliding ring (R = 24):
    the runner's logits equal the eager model's at every step."""
    model = tiny_model(device)
    graphed = GraphedCausalLM(model, use_graphs=use_graphs)
    kv_eager = model.make_kv_cache(5, 64)
    kv_graph = graphed.make_kv_cache(5, 64)
    assert graphed.runner is not None and graphed.runner.buckets == (1, 2, 4, 8)
    gen = torch.Generator().manual_seed(0)
    prompts = {4: torch.randint(0, 256, (5,), generator=gen).tolist(),
               0: torch.randint(0, 256, (21,), generator=gen).tolist(),
               2: torch.randint(0, 256, (30,), generator=gen).tolist()}  # fmt: skip
    _prefill(model, kv_eager, prompts)
    _prefill(graphed, kv_graph, prompts)
    slots = [2, 4, 0]
    lens = [len(prompts[s]) for s in slots]
    tokens = [prompts[s][-1] for s in slots]
    for _ in range(steps):
        step = StepInput(
            input_ids=torch.tensor(tokens, device=device),
            positions=torch.tensor(lens, device=device),
            slots=slots, cached_lens=list(lens), new_lens=[1, 1, 1],
        )  # fmt: skip
        want = model(step, kv_eager)
        got = graphed(step, kv_graph).clone()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens = want.argmax(dim=-1).tolist()
        assert got.argmax(dim=-1).tolist() == tokens
        lens = [n + 1 for n in lens]
    # the slots nobody used stayed untouched by the padded rows
    for layer in kv_graph.layers:
        assert torch.equal(layer.k[1], torch.zeros_like(layer.k[1]))
        assert torch.equal(layer.k[3], torch.zeros_like(layer.k[3]))


def test_runner_body_matches_eager_model_on_cpu() -> None:
    _decode_both("cpu", use_graphs=False)


def test_mixed_step_splits_decoders_from_the_prefill_chunk() -> None:
    model = tiny_model()
    # no decode ahead: it writes one position past the decoders, and the caches are compared
    graphed = GraphedCausalLM(model, use_graphs=False, decode_ahead=False)
    kv_eager, kv_graph = model.make_kv_cache(4, 64), graphed.make_kv_cache(4, 64)
    prompts = {0: [3, 4, 5, 6], 2: [7, 8, 9]}
    _prefill(model, kv_eager, prompts)
    _prefill(graphed, kv_graph, prompts)
    # slot 2 decodes, slot 1 prefills 5 tokens, slot 0 decodes
    step = StepInput(
        input_ids=torch.tensor([11, 20, 21, 22, 23, 24, 12]),
        positions=torch.tensor([3, 0, 1, 2, 3, 4, 4]),
        slots=[2, 1, 0], cached_lens=[3, 0, 4], new_lens=[1, 5, 1],
    )  # fmt: skip
    want = model(step, kv_eager)
    got = graphed(step, kv_graph)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for layer_eager, layer_graph in zip(kv_eager.layers, kv_graph.layers, strict=True):
        torch.testing.assert_close(layer_graph.k, layer_eager.k, rtol=1e-5, atol=1e-5)


def test_runner_decode_samples_inside_the_step() -> None:
    model = tiny_model()
    kv = model.make_kv_cache(3, 32)
    prompts = {0: [5, 6, 7], 1: [9, 8, 7, 6], 2: [1, 2]}
    _prefill(model, kv, prompts)
    kv_copy = [(layer.k.clone(), layer.v.clone()) for layer in kv.layers]
    runner = DecodeGraphRunner(model, kv, 3, use_graphs=False)
    slots, positions, tokens = [0, 1, 2], [3, 4, 2], [7, 6, 2]
    rows = [RowSampling(), RowSampling(1.0, 0, 0.9, 0.0, 11), RowSampling(0.0)]
    got = runner.decode(tokens, positions, slots, rows)
    # the same step through the eager model
    for layer, (k, v) in zip(kv.layers, kv_copy, strict=True):
        layer.k.copy_(k)
        layer.v.copy_(v)
    step = StepInput(torch.tensor(tokens), torch.tensor(positions), slots, positions, [1, 1, 1])
    greedy = model(step, kv).argmax(dim=-1).tolist()
    assert got[0] == greedy[0] and got[2] == greedy[2]
    assert 0 <= got[1] < 256
    # a seeded row draws the same token alone as in the batch
    for layer, (k, v) in zip(kv.layers, kv_copy, strict=True):
        layer.k.copy_(k)
        layer.v.copy_(v)
    alone = runner.decode([6], [4], [1], [rows[1]])
    assert alone == [got[1]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager_on_cuda() -> None:
    _decode_both("cuda", use_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captures_warm_up_on_one_side_stream() -> None:
    """Every capture's eager warm-up runs on one side stream a device (what a warm-up frees
    stays cached for its stream: a stream a size would strand each size's)."""
    from worker.device.decode_graphs import capture_stream

    here = torch.device("cuda", torch.cuda.current_device())
    stream = capture_stream("cuda")
    assert stream is capture_stream(here) and stream != torch.cuda.current_stream(here)


# ------------------------------------------------------------------ GPU correctness (issue 6)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# the default model's (Gemma 3 270M) text config, as the GGUF conversion writes it
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
    "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "sliding_window_pattern": 6, "final_logit_softcapping": None, "bos_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 0,
}  # fmt: skip


def sharpened_tiny_model(device: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """tiny_model with its (tied) embedding x16: logits spread like a trained model's (std
    about 2.5 instead of 0.16), so a top-1 comparison measures rounding, not coin flips."""
    model = tiny_model(device, dtype)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(16.0)
    return model


def _greedy(model, kv, prompts: dict[int, list[int]], steps: int) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
    """Prefill each prompt (eager), then decode all together through the runner."""
    slots = list(prompts)
    out: dict[int, list[int]] = {s: [] for s in slots}
    tokens = []
    for slot in slots:
        logits = model(StepInput.single(prompts[slot], slot, 0, device=model.device), kv)
        tokens.append(int(logits.argmax(dim=-1)[0]))
    lens = [len(prompts[s]) for s in slots]
    for _ in range(steps):
        for slot, token in zip(slots, tokens, strict=True):
            out[slot].append(token)
        tokens = model.runner.decode(tokens, lens, slots, [RowSampling()] * len(slots))
        lens = [n + 1 for n in lens]
    return out


@needs_cuda
def test_bf16_gpu_top1_agrees_with_fp32_cpu() -> None:
    cpu = sharpened_tiny_model("cpu", torch.float32)
    gpu = GraphedCausalLM(sharpened_tiny_model("cuda", torch.bfloat16))
    kv_cpu, kv_gpu = cpu.make_kv_cache(1, 600), gpu.make_kv_cache(1, 600)
    ids = torch.randint(0, 256, (513,), generator=torch.Generator().manual_seed(5)).tolist()
    agree = 0
    # teacher-forced: a 2-token prefill gives position 1, then 511 decode steps
    for pos in range(1, 513):
        new, cached = (ids[:2], 0) if pos == 1 else ([ids[pos]], pos)
        want = cpu(StepInput.single(new, 0, cached), kv_cpu).argmax(dim=-1).item()
        step = StepInput.single(new, 0, cached, device="cuda")
        agree += int(want == gpu(step, kv_gpu).argmax(dim=-1).item())
    print(f"bf16 GPU vs fp32 CPU top-1 agreement: {agree}/512")
    assert agree >= 0.99 * 512


@needs_cuda
def test_eight_sessions_together_equal_each_alone() -> None:
    model = GraphedCausalLM(sharpened_tiny_model("cuda", torch.bfloat16))
    kv = model.make_kv_cache(9, 256)
    gen = torch.Generator().manual_seed(9)
    prompts = {
        slot: torch.randint(0, 256, (3 + 5 * slot,), generator=gen).tolist() for slot in range(8)
    }
    together = _greedy(model, kv, prompts, steps=40)
    for slot, prompt in prompts.items():
        assert _greedy(model, kv, {slot: prompt}, steps=40)[slot] == together[slot]


@needs_cuda
def test_default_architecture_fp32_gpu_greedy_equals_cpu() -> None:
    config = ModelConfig.from_hf(GEMMA3_270M)
    cpu = build_model(config, "cpu", torch.float32)
    init_random_weights(cpu, seed=1)  # made on the CPU ...
    gpu = build_model(config, "cpu", torch.float32)
    gpu.load_state_dict(cpu.state_dict())
    # ... and moved, then the whole CUDA set-up of the worker (merged projections, fused
    # kernels, the batch-1 GEMV where it wins, graphs, decode ahead)
    gpu = prepare_model_for_device(SimpleNamespace(model=gpu.to("cuda")), "cuda")
    prompt = torch.randint(10, 262144, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    kv_cpu, kv_gpu = cpu.make_kv_cache(1, 128), gpu.make_kv_cache(1, 128)
    want, got = [], []
    for model, kv, out in ((cpu, kv_cpu, want), (gpu, kv_gpu, got)):
        ids, pos = list(prompt), 0
        for _ in range(16):
            step = StepInput.single(ids, 0, pos, device=model.device)
            token = int(model(step, kv).argmax(dim=-1)[0])
            out.append(token)
            pos += len(ids)
            ids = [token]
    assert got == want


def _llama_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
    }  # fmt: skip


@pytest.mark.parametrize("family", ["gemma4", "llama"])
def test_fused_kernels_and_merged_projections_match_the_torch_path(
    family: str, monkeypatch: pytest.MonkeyPatch, triton_ready: None
) -> None:
    """The CUDA path on the CPU (Triton's interpreter): merged q/k/v and gate/up, fused norms,
    q/k norm + rotary, gated activation and the graph runner's decode give the torch path's
    logits, for a chunked prefill and decode steps past the sliding ring."""
    if torch.cuda.is_available():  # CPU tensors through Triton want its interpreter
        pytest.skip("the interpreter's test: the GPU tests above run the fused path on CUDA")
    config = tiny_gemma4_config() if family == "gemma4" else _llama_config()
    ref = build_model(ModelConfig.from_hf(config), "cpu", torch.float32)
    init_random_weights(ref, seed=5)
    with torch.no_grad():  # non-trivial norm weights and layer scalars
        gen = torch.Generator().manual_seed(6)
        for name, t in ref.state_dict(keep_vars=True).items():
            if "norm" in name or "layer_scalar" in name:
                t.add_(torch.rand(t.shape, generator=gen) * 0.5)
    fast = build_model(ModelConfig.from_hf(config), "cpu", torch.float32)
    fast.load_state_dict(ref.state_dict())
    assert fast.fuse_projections() > 0
    names = set(fast.state_dict())
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    assert any("qkv_proj" in n for n in names) and any("gate_up_proj" in n for n in names)
    monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
    graphed = GraphedCausalLM(fast, use_graphs=False)
    kv_ref, kv_fast = ref.make_kv_cache(3, 64), graphed.make_kv_cache(3, 64)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    for start in range(0, 40, 13):  # chunks over a cached prefix, then over a wrapped ring
        step = StepInput.single(prompt[start : start + 13], 1, start)
        monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "0")
        want = ref(step, kv_ref)
        monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
        got = graphed(step, kv_fast)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    token, pos = int(want.argmax()), len(prompt)
    for _ in range(6 if family == "gemma4" else 3):  # decode through the runner, past the ring
        step = StepInput.single([token], 1, pos)
        monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "0")
        want = ref(step, kv_ref)
        monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
        got = graphed(step, kv_fast)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        token, pos = int(want.argmax()), pos + 1


def test_norm_chain_only_where_every_layer_can(
    monkeypatch: pytest.MonkeyPatch, triton_ready: None
) -> None:
    """The decode step chains each layer's last kernel into the next layer's input norm (and
    the last layer's into the final norm) only on the fused path, for sandwich layers whose
    norms share style and eps with the next; TOKENPIPE_NORM_CHAIN=0 turns it off."""
    from worker.layers.blocks import norm_chain

    monkeypatch.delenv("TOKENPIPE_NORM_CHAIN", raising=False)
    gemma, llama = tiny_model(), build_model(ModelConfig.from_hf(_llama_config()), "cpu",
                                             torch.float32)  # fmt: skip
    x = torch.zeros(1, 64)
    monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "0")
    assert norm_chain(gemma.model.layers, gemma.model.norm, x) is None  # the torch path
    monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
    chain = norm_chain(gemma.model.layers, gemma.model.norm, x)
    layers = list(gemma.model.layers)
    assert chain is not None and chain[-1] is gemma.model.norm
    assert chain[:-1] == [layer.input_layernorm for layer in layers[1:]]
    assert norm_chain(llama.model.layers, llama.model.norm, x) is None
    monkeypatch.setenv("TOKENPIPE_NORM_CHAIN", "0")
    assert norm_chain(gemma.model.layers, gemma.model.norm, x) is None
    monkeypatch.delenv("TOKENPIPE_NORM_CHAIN")
    monkeypatch.setattr(gemma.model.norm, "eps", gemma.model.norm.eps * 2)
    assert norm_chain(gemma.model.layers, gemma.model.norm, x) is None


def test_profile_tool_charges_an_early_launch_only_after_the_kernel_before() -> None:
    """tools/profile_decode_step.py --kernels: a dependent launch that starts while the
    kernel before runs is charged from that kernel's end; a gap is charged to nobody."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from profile_decode_step import effective_times

    kernels = [("gemv", 0.0, 20.0), ("norm", 18.0, 23.0), ("gemv", 21.0, 40.0),
               ("act", 45.0, 46.0)]  # fmt: skip
    assert effective_times(kernels) == {"gemv": (2, 37.0), "norm": (1, 3.0), "act": (1, 1.0)}
