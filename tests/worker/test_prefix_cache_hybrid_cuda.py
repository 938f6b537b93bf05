"""The hybrid shared-prefix cache on the CUDA path: short prefills replayed from prefill graphs
(the in-place Triton recurrence, one snapshot inside the step) write the DeltaNet states the
prefix cache asks for, and a prompt rebuilt from them equals a cold prefill. On the CPU the
graphs' body runs through Triton's interpreter; on a GPU the Engine runs the captured graphs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_qwen3_5_moe_cuda import _ids, _model, _rel

from protocol import DoneEvent, GenerateRequest, IdsSegment
from worker.device.graphed_lm import GraphedCausalLM
from worker.engine.engine import Engine, EngineConfig
from worker.engine.prefix_cache import PrefixCache, block_keys
from worker.models.step import StepInput

CUDA = torch.cuda.is_available()
BLOCK = 8


def _prefill(graphed: Any, cache: PrefixCache, slot: int, prompt: list[int], start: int,
             chunk: int) -> torch.Tensor:  # fmt: skip
    """The engine's prefill of ``prompt[start:]`` in ``chunk``-token steps, with the prefix
    cache's begin/finish around each -> the last step's logits."""
    keys = block_keys(prompt, BLOCK)
    plan = cache.plan(prompt, keys, len(prompt) - 1)
    points = cache.state_points(len(prompt), plan)
    next_block, cached = 0, start
    logits = torch.empty(0)
    while cached < len(prompt):
        new = min(chunk, len(prompt) - cached)
        pending = cache.begin(prompt, keys, slot, next_block, cached, new, points)
        logits = graphed(
            StepInput.single(prompt[cached : cached + new], slot, cached), cache.states
        )
        cached += new
        if pending is not None:
            next_block = cache.finish(pending, slot, cached, ok=True)
    return logits


@pytest.mark.skipif(CUDA, reason="CPU tensors through the interpreter; CUDA: the engine test")
def test_graphed_prefills_write_the_states_a_reuse_needs(
    triton_ready: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.layers.deltanet as deltanet

    ref, fast = _model(num_hidden_layers=4), _model(num_hidden_layers=4)  # 3 DeltaNet, 1 full
    monkeypatch.setattr(deltanet, "FUSED_PROJECTION_DEVICES", ("cuda", "cpu"))
    fast.fuse_projections()
    monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
    graphed = GraphedCausalLM(fast, use_graphs=False, capture=False)
    kv = graphed.make_kv_cache(3, 128)
    assert graphed.prefill is not None
    cache = PrefixCache(kv, budget_bytes=64 << 20, block=BLOCK)

    def cold(prompt: list[int]) -> torch.Tensor:
        monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "0")
        try:
            return ref(StepInput.single(prompt, 0, 0), ref.make_kv_cache(1, 128))
        finally:
            monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")

    first = _ids(30, 1)  # one graphed step: the state at 24 inside it, at 30 no block end
    kv.snapshot_at(0, 29)  # a named session's own snapshot: it takes the graph's one
    _prefill(graphed, cache, 0, first, 0, 30)
    assert 29 in kv.snapshot_lens[0] and len(cache.state_lru) == 0  # 24: not written
    replays = graphed.prefill.replays
    _prefill(graphed, cache, 0, first + _ids(2, 2), 30, 2)  # the slot goes on: 32, a step end
    assert len(cache.state_lru) == 1

    kv.truncate(1, 0)
    second = _ids(21, 3)  # a scratch prompt: 16 inside the step, through a slot entry
    _prefill(graphed, cache, 1, second, 0, 21)
    keys = block_keys(second, BLOCK)
    assert cache.blocks[keys[1]].state is not None and cache.blocks[keys[0]].state is None
    assert graphed.prefill.replays == replays + 2

    prompt = second[:19] + _ids(6, 4)  # shares 19: the state at 16
    plan = cache.plan(prompt, block_keys(prompt, BLOCK), len(prompt) - 1)
    assert plan.tokens == 16 and not plan.truncated
    kv.truncate(2, 0)
    cache.apply(plan, 2, keep=0)
    got = _prefill(graphed, cache, 2, prompt, 16, 16)
    assert _rel(got, cold(prompt)) < 1e-4


def _request(prompt: list[int], session: str | None) -> GenerateRequest:
    return GenerateRequest(
        id="r", prompt_segments=[IdsSegment(prompt)], add_prefix=False, max_new_tokens=8,
        session_id=session,
    )  # fmt: skip


def _turn(engine: Engine, prompt: list[int], session: str | None = None) -> DoneEvent:
    events = list(engine.submit(_request(prompt, session)))
    while not engine.idle:
        events.extend(engine.step())
    (done,) = [e for e in events if isinstance(e, DoneEvent)]
    return done


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_engine_prefix_hits_equal_cold() -> None:
    """fp32 on the GPU through the worker's CUDA set-up (prefill graphs captured for steps of
    up to 256 tokens, eager chunks of 272): prompts rebuilt from cached blocks and states, the
    states written after a step, inside an eager one and inside a graphed one, give a cold
    engine's tokens."""
    from test_engine_qwen3_5_moe import IdTokenizer

    from worker.device.cuda_setup import prepare_model_for_device

    def engine(prefix_bytes: int) -> Engine:
        gpu = prepare_model_for_device(SimpleNamespace(model=_model("cuda")), "cuda")
        loaded = SimpleNamespace(model=gpu, tokenizer=IdTokenizer(), config=gpu.config, meta={})
        config = EngineConfig(
            max_sessions=4, max_context=512, prefill_chunk=272,
            prefix_cache_bytes=prefix_bytes, prefix_block=BLOCK,
        )  # fmt: skip
        return Engine(loaded, config, "cuda")

    cached, cold = engine(64 << 20), engine(0)
    assert cached.prefix_cache is not None and cached.prefix_cache.states is not None
    first = _ids(300, 5)  # an eager step to 272 (a state after it), a graphed one (296 inside)
    assert _turn(cached, first).generated_token_ids == _turn(cold, first).generated_token_ids
    cases = [
        (296, 12, 296, "a"),  # the graphed step's state
        (272, 9, 272, None),  # the eager step's end
        (200, 80, 0, None),  # no state at or below 200: its eager step keeps one at 200
        (200, 70, 200, "b"),  # that state (written inside an eager step)
    ]
    for shared, tail, reused, session in cases:
        prompt = first[:shared] + _ids(tail, 1000 + tail)
        done = _turn(cached, prompt, session)
        assert done.reused_prompt_tokens == reused, (shared, done)
        assert done.generated_token_ids == _turn(cold, prompt).generated_token_ids, shared
    graph_stats = cached.model.graph_stats()
    assert graph_stats["prefill_graph_replays"] >= 4, graph_stats
    assert cached.stats()["prefix_cache"]["truncated"] == 1
