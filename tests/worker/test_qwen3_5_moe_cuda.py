"""qwen3_5_moe's CUDA path: the decode-graph body over the hybrid cache (padding rows, step
bookkeeping) against the eager model on the CPU; the model through its Triton kernels (Triton's
CPU interpreter here) against the torch path; and, on a GPU, the fp32 CUDA path (decode graphs,
grouped-GEMM MoE, in-place DeltaNet decode) against the CPU path, and fla's bf16 prefill
against the torch form. No transformers needed: the weights are seeded random values."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_models_qwen3_5_moe import TINY

from worker.device.graphed_lm import GraphedCausalLM
from worker.layers.hybrid_cache import HybridCache
from worker.models.config import ModelConfig
from worker.models.registry import build_model
from worker.models.step import StepInput

torch.set_num_threads(2)
CUDA = torch.cuda.is_available()


def _config(**overrides: Any) -> ModelConfig:
    raw = {**TINY, "architectures": ["Qwen3_5MoeForCausalLM"], **overrides}
    return ModelConfig.from_hf(raw)


def _model(
    device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any
) -> Any:
    """The tiny model with seeded weights of a realistic scale (identical on every device)."""
    model = build_model(_config(**overrides), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif param.dim() >= 2:
                fan_in = param.shape[-1] if "conv1d" not in name else param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=gen) * fan_in**-0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    if device == "cpu" and dtype == torch.float32:
        return model
    out = build_model(_config(**overrides), device, dtype)
    out.load_state_dict(model.state_dict())
    return out


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def _decode_step(tokens: list[int], lens: list[int], slots: list[int], device: Any) -> StepInput:
    return StepInput(
        input_ids=torch.tensor(tokens, device=device),
        positions=torch.tensor(lens, device=device),
        slots=list(slots), cached_lens=list(lens), new_lens=[1] * len(slots),
    )  # fmt: skip


def _run_side_by_side(
    ref: Any,
    ours: Any,
    ours_device: Any,
    steps: int,
    tolerance: float,
    chunk: int = 29,
    same_tokens: bool = True,
) -> HybridCache:
    """Prompts prefilled in chunks (slot 0 in one shot), then `steps` greedy decode steps of 3
    sequences (a padded bucket of 4); every step's logits within `tolerance` (relative) and,
    with `same_tokens`, the same greedy tokens (both follow the reference's). Returns ours's
    cache."""
    kv_ref, kv_ours = ref.make_kv_cache(5, 256), ours.make_kv_cache(5, 256)
    prompts = {4: _ids(5, 1), 0: _ids(70, 2), 2: _ids(90, 3)}
    for slot, ids in prompts.items():
        size = len(ids) if slot == 0 else chunk
        for start in range(0, len(ids), size):
            piece = ids[start : start + size]
            want = ref(StepInput.single(piece, slot, start), kv_ref)
            got = ours(StepInput.single(piece, slot, start, device=ours_device), kv_ours)
            assert _rel(got, want) < tolerance
    slots = [2, 4, 0]
    lens = [len(prompts[s]) for s in slots]
    tokens = [prompts[s][-1] for s in slots]
    for _ in range(steps):
        want = ref(_decode_step(tokens, lens, slots, "cpu"), kv_ref)
        got = ours(_decode_step(tokens, lens, slots, ours_device), kv_ours).clone()
        assert _rel(got, want) < tolerance
        tokens = want.argmax(dim=-1).tolist()
        assert not same_tokens or got.argmax(dim=-1).tolist() == tokens
        lens = [n + 1 for n in lens]
    assert [kv_ours.live_len[s] for s in slots] == lens  # the replays kept the bookkeeping
    return kv_ours  # type: ignore[no-any-return]


def test_graph_decode_body_equals_eager_model_on_cpu() -> None:
    """The body a CUDA graph captures (tensor-only plan, bucket padding with slot -1) gives
    the eager model's logits; padding rows leave the unused slots' DeltaNet state alone."""
    model = _model()
    graphed = GraphedCausalLM(model, use_graphs=False, capture=False)
    kv = _run_side_by_side(model, graphed, "cpu", steps=6, tolerance=1e-5)
    assert graphed.runner is not None and len(graphed._lanes) == 2  # decode ahead
    assert (graphed.ahead_hits, graphed.ahead_misses) == (5, 0)
    assert graphed.prefill is None  # no prefill graphs over a hybrid cache
    for layer in kv.deltanet_layers:
        for unused in (1, 3):
            assert not layer.conv[unused].any() and not layer.recurrent[unused].any()


@pytest.mark.skipif(CUDA, reason="CPU tensors through the interpreter; CUDA: the fp32 test")
def test_fused_kernels_qwen3_5_moe_match_torch_path(
    triton_ready: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model as CUDA runs it (merged projections; every Triton kernel on: router, pair
    alignment and grouped-GEMM MoE, the in-place DeltaNet decode step, its gated norm, norms,
    attention; in the CPU interpreter here) through the graph body, against the torch path."""
    import worker.layers.deltanet as deltanet

    ref = _model()
    fast = _model()
    monkeypatch.setattr(deltanet, "FUSED_PROJECTION_DEVICES", ("cuda", "cpu"))
    # MoE input matmuls (router, shared gate, shared gate/up), shared experts (left as they
    # are: the MoE took their gate/up), attention q/k/v, DeltaNet input matmuls
    assert fast.fuse_projections() == 8 + 8 + 2 + 6
    moe = fast.model.layers[0].mlp
    assert moe.in_proj is not None and not hasattr(moe, "gate")
    assert fast.model.layers[3].self_attn.qkv_proj is not None
    monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
    graphed = GraphedCausalLM(fast, use_graphs=False, capture=False)

    class TorchPath:
        """The reference model with Triton off for its own calls."""

        def make_kv_cache(self, *args: Any) -> Any:
            return ref.make_kv_cache(*args)

        def __call__(self, step: StepInput, kv: Any) -> torch.Tensor:
            monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "0")
            try:
                return ref(step, kv)  # type: ignore[no-any-return]
            finally:
                monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")

    _run_side_by_side(TorchPath(), graphed, "cpu", steps=3, tolerance=1e-4, chunk=45)
    assert graphed.prefill is not None and graphed.prefill.replays == 4  # every prefill


@pytest.mark.skipif(CUDA, reason="CPU tensors through the interpreter")
def test_prefill_graph_body_keeps_the_snapshots(
    triton_ready: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short prefills through the prefill graphs' body (the in-place Triton recurrence; the
    interpreter here): a snapshot inside the step, a rollback to it and a new turn from it
    give the torch path's logits and snapshot bookkeeping."""
    import worker.layers.deltanet as deltanet

    ref, fast = _model(num_hidden_layers=4), _model(num_hidden_layers=4)  # 3 DeltaNet, 1 full
    assert [layer.is_linear for layer in fast.model.layers] == [True, True, True, False]
    monkeypatch.setattr(deltanet, "FUSED_PROJECTION_DEVICES", ("cuda", "cpu"))
    fast.fuse_projections()
    monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
    graphed = GraphedCausalLM(fast, use_graphs=False, capture=False)
    kv_ref, kv = ref.make_kv_cache(3, 128), graphed.make_kv_cache(3, 128)
    assert graphed.prefill is not None

    def both(step: StepInput) -> None:
        monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "0")
        want = ref(step, kv_ref)
        monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
        got = graphed(step, kv)
        assert _rel(got, want) < 1e-4

    ids = _ids(40, 7)
    for cache in (kv_ref, kv):
        cache.snapshot_at(1, 17)  # inside the first step
    both(StepInput.single(ids[:20], 1, 0))
    both(StepInput.single(ids[20:23], 1, 20))
    assert kv.snapshot_lens[1] == kv_ref.snapshot_lens[1] and 17 in kv.snapshot_lens[1]
    for cache in (kv_ref, kv):
        cache.truncate(1, 17)  # a rollback to the snapshot
    both(StepInput.single(ids[30:40], 1, 17))
    assert kv.live_len[1] == kv_ref.live_len[1] == 27
    assert graphed.prefill.replays == 3


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fp32_path_equals_cpu_path() -> None:
    """fp32 on the GPU through the worker's CUDA set-up (merged projections, Triton kernels,
    decode graphs captured) against the CPU path."""
    from worker.device.cuda_setup import prepare_model_for_device

    ref = _model()
    gpu = prepare_model_for_device(SimpleNamespace(model=_model("cuda")), "cuda")
    assert isinstance(gpu, GraphedCausalLM)
    _run_side_by_side(ref, gpu, "cuda", steps=16, tolerance=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_bf16_fla_prefill_close_to_torch_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: flash-linear-attention's chunked prefill (over a cached prefix too, then a decode
    step from its state) is as close to float32 as the torch form in bf16 is: both against the
    same weights in float32 (two bf16 paths differ from each other by both their roundings,
    which on this tiny random model reaches a few percent of the logits)."""
    import worker.layers.deltanet as deltanet

    if deltanet.fla_chunk_rule() is None:
        pytest.skip("fla does not import")
    model = _model("cuda", torch.bfloat16)
    oracle = _model("cuda", torch.float32)
    oracle.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ids = _ids(201, 5)  # the decode step's token is fixed: each side's own argmax may differ

    def run(side: Any) -> list[torch.Tensor]:
        kv = side.make_kv_cache(1, 256)
        return [
            side(StepInput.single(ids[:130], 0, 0, device="cuda"), kv),
            side(StepInput.single(ids[130:200], 0, 130, device="cuda"), kv),
            side(StepInput.single(ids[200:], 0, 200, device="cuda"), kv),
        ]

    want = run(oracle)
    with_fla = run(model)
    monkeypatch.setattr(deltanet, "fla_chunk_rule", lambda: None)
    torch_form = run(model)
    assert not deltanet._fla_broken, deltanet._fla_broken
    fla_err = [_rel(got, ref) for got, ref in zip(with_fla, want, strict=True)]
    torch_err = [_rel(got, ref) for got, ref in zip(torch_form, want, strict=True)]
    print(f"rel. error to float32 (first, second, third): fla {fla_err}, torch form {torch_err}")
    for fla, form in zip(fla_err, torch_err, strict=True):
        assert fla < 2 * form + 1e-2, (fla_err, torch_err)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "kind,dtype,tolerance",
    [
        ("int4", torch.float32, 1e-3),
        ("int8", torch.float32, 1e-3),
        ("int4", torch.bfloat16, 5e-2),
        ("int4-experts", torch.bfloat16, 5e-2),
    ],
    ids=["int4-fp32", "int8-fp32", "int4-bf16", "int4-experts-bf16"],
)
def test_gpu_quantized_path_equals_cpu_path(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, kind: str, dtype: torch.dtype,
    tolerance: float,
) -> None:  # fmt: skip
    """``--quantize int4|int8|int4-experts`` on the GPU (W4A16/W8A16 linears, the quantized
    MoE: grouped GEMMs for the prefills, per-pair GEMVs for the decode steps; decode graphs;
    int4-experts: float dense layers, int8 head, int4 embedding) against the
    CPU path over the same checkpoint quantized the same way (the CPU dequantizes the experts
    a step hits). Four layers (3 DeltaNet, 1 full), the kernels' default tiles (no start-up
    timing, which compiles every candidate), the graphs' kernels compiled by a pool."""
    from test_quant_experts import _tiny_checkpoint

    from worker.device.compile_ahead import start_compile_pool
    from worker.device.cuda_setup import prepare_model_for_device
    from worker.layers.quant_experts import QuantExperts
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions

    monkeypatch.setenv("TOKENPIPE_NO_GEMV", "1")
    path = _tiny_checkpoint(tmp_path, per_expert=False, layers=4)
    options = QuantizeOptions(kind, 8)
    ref = load_model(path, "cpu", torch.float32, progress=False, quantize=options).model
    loaded = load_model(path, "cuda", dtype, progress=False, quantize=options)
    assert sum(isinstance(m, QuantExperts) for m in loaded.model.modules()) == 4
    pool = start_compile_pool()  # the graphs' kernels compiled side by side, as at a start
    try:
        gpu = prepare_model_for_device(loaded, "cuda", compiles=pool)
        assert isinstance(gpu, GraphedCausalLM)
        _run_side_by_side(ref, gpu, "cuda", 4, tolerance, same_tokens=dtype == torch.float32)
    finally:
        if pool is not None:
            pool.close()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_quantized_moe_prefill_dequant_path_captures_in_a_graph() -> None:
    """The prefill path of quantized experts (hit experts dequantized to a scratch, then the
    float grouped GEMMs) inside a CUDA graph, as the prefill graphs run it: no host tensor
    and no sync, and the replay equals the eager call."""
    from worker.device.kernels.moe_quant import fused_moe_quant_triton
    from worker.layers.quant import QuantFormat
    from worker.layers.quant_experts import QuantExperts

    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens, hidden, inner, experts, top_k = 96, 128, 64, 16, 8
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    module = QuantExperts(experts, hidden, inner, QuantFormat("int4", 32)).cuda()
    module.draw_random(0.05, torch.Generator(device="cuda").manual_seed(2), torch.bfloat16)
    gate_up, down = module.matrix("gate_up_proj"), module.matrix("down_proj")

    def run() -> torch.Tensor:
        return fused_moe_quant_triton(x, gate_up, down, weights, ids, gemv=False, dequant=True)

    want = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    quantized = fused_moe_quant_triton(x, gate_up, down, weights, ids, gemv=False, dequant=False)
    assert _rel(got, quantized) < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gated_mlp_one_row_through_the_gated_gemv() -> None:
    """A gated MLP (qwen3_5_moe's shared expert) whose down matrix runs on the decode GEMV:
    one row takes the gated GEMV (activation in its loads) and equals the activation kernel
    then the GEMV; more rows keep the two launches."""
    from worker.device.kernels import gemv
    from worker.layers.blocks import GatedMLP

    config = _config()
    mlp = GatedMLP(config).cuda()
    mlp.fuse_projections()
    x = torch.randn(3, config.hidden_size, device="cuda")
    assert mlp.gate_up_proj is not None
    gate_up = mlp.gate_up_proj(x)
    before = mlp.down_from_gate_up(gate_up, x)
    gemv.install_decode_gemv(mlp, choose=lambda weight: (16, 64, 4, 1))
    assert mlp.down_proj.decode_gemv_config == (16, 64, 4, 1)
    calls = []
    real = gemv.gated_gemv_triton
    gemv.gated_gemv_triton = lambda *a, **k: calls.append(1) or real(*a, **k)  # type: ignore[assignment]
    try:
        one = mlp.down_from_gate_up(gate_up[:1], x[:1])
        assert calls
        three = mlp.down_from_gate_up(gate_up, x)
        assert len(calls) == 1
    finally:
        gemv.gated_gemv_triton = real  # type: ignore[assignment]
    torch.testing.assert_close(one, before[:1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(three, before, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fla_stages_equal_the_single_call_and_its_splits() -> None:
    """fla's stages called one by one (``fla_stages``) give the single call's output and final
    state, and the states 64 and 128 rows in equal the final states of calls over those rows
    alone (the prefill's states without a split)."""
    import worker.layers.deltanet as deltanet

    rule = deltanet.fla_chunk_rule()
    if rule is None:
        pytest.skip("fla does not import")
    stages = deltanet.fla_stages()
    assert stages is not None, "fla imports but its stages do not (another fla version?)"
    model = _model("cuda", torch.bfloat16)
    layer = next(m for m in model.modules() if isinstance(m, deltanet.GatedDeltaNet))
    gen = torch.Generator().manual_seed(4)
    n, heads = 200, layer.num_v_heads
    conv_dim = 2 * layer.key_dim + layer.value_dim
    conv_out = torch.randn(n, conv_dim, generator=gen).to("cuda", torch.bfloat16)
    g = (-torch.nn.functional.softplus(torch.randn(n, heads, generator=gen)) * 0.2).cuda()
    beta = torch.rand(n, heads, generator=gen).cuda()
    state = (torch.randn(heads, layer.dk, layer.dv, generator=gen) * 0.1).cuda()
    for start in (None, state):
        out_a, final_a = layer._fla_prefill(rule, conv_out, g, beta, start)
        inside: list[torch.Tensor] = []
        out_b, final_b = layer._fla_stages_prefill(
            stages, conv_out, g, beta, start, [64, 128], inside
        )
        print("stages == single call:", torch.equal(out_a, out_b), torch.equal(final_a, final_b))
        torch.testing.assert_close(out_b, out_a, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(final_b, final_a, rtol=1e-4, atol=1e-4)
        for rows, got in zip((64, 128), inside, strict=True):
            _, want = layer._fla_prefill(rule, conv_out[:rows], g[:rows], beta[:rows], start)
            print(f"state at {rows}: max |diff| {float((got - want).abs().max()):.2e}")
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,split", [(64, 63), (40, 17), (16, 0)])
def test_gpu_chunked_seq_kernel_close_to_the_row_kernel(n: int, split: int) -> None:
    """The prefill graphs' DeltaNet recurrence on the 35B-A3B head shape, bf16 inputs: the
    chunked form (tf32 products, the bf16 models' default) against the row-by-row form (exact
    float32): outputs, final state and the snapshot inside the step within tf32's rounding."""
    from worker.device.kernels.deltanet_decode import gated_delta_seq_triton

    gen = torch.Generator(device="cuda").manual_seed(n)
    hk, hv, dk, dv, rows = 16, 32, 128, 128, 64
    x = torch.randn(rows, 2 * hk * dk + hv * dv, device="cuda", generator=gen).bfloat16()
    a = torch.randn(rows, hv, device="cuda", generator=gen).bfloat16()
    b = torch.randn(rows, hv, device="cuda", generator=gen).bfloat16()
    a_log, dt_bias = (torch.randn(hv, device="cuda", generator=gen) for _ in range(2))
    state = torch.randn(3, hv, dk, dv, device="cuda", generator=gen) * 0.1
    meta = torch.tensor([1, 5, n, split, 1], device="cuda")
    results = []
    for form in ("rows", "chunk"):
        live, snap = state.clone(), torch.zeros(3, 2, hv, dk, dv, device="cuda")
        out = gated_delta_seq_triton(x, a, b, a_log, dt_bias, live, snap, meta,
                                     num_key_heads=hk, key_dim=dk, form=form)  # fmt: skip
        results.append((out, live, snap))
    (want, want_state, want_snap), (got, got_state, got_snap) = results
    assert not got[n:].any()
    assert _rel(got, want) < 5e-3 and _rel(got_state, want_state) < 2e-3
    if split:
        assert _rel(got_snap[1, 1], want_snap[1, 1]) < 2e-3
    assert not got_snap[0].any() and not got_snap[1, 0].any()
