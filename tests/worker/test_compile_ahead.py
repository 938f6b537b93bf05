"""Triton variants compiled ahead (worker/device/compile_ahead.py), without a GPU: Triton
compiles for an H100-class target on the CPU (ptxas ships with it); only launching needs CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker.device import compile_ahead

REPO = Path(__file__).resolve().parents[2]

# In a fresh interpreter (the tests' own runs Triton's interpreter), with a stand-in driver:
# the recorded launches are skipped, the pool compiles them into TRITON_CACHE_DIR, and the
# real launch then finds each variant there (never builds its IR) and goes on to launch.
SCRIPT = textwrap.dedent(
    """
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compiler

    from worker.device.compile_ahead import CompilePool
    from worker.device.kernels.gemv import gemv_triton

    class Launched(Exception):
        pass

    class Launcher:
        def __init__(self, *args):
            raise Launched

    class StandInDriver:
        launcher_cls = Launcher
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self): return torch.device("cpu")

    triton.runtime.driver.set_active(StandInDriver())
    weight = torch.zeros(64, 256, dtype=torch.bfloat16)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    configs = [(16, 256, 4, 4), (8, 128, 4, 2)]
    pool = CompilePool(ThreadPoolExecutor(1), 1)
    a, b = (lambda c=c: gemv_triton(x, weight, c) for c in configs)
    settle = lambda: time.sleep(3)  # the pool's answers are in by the next stage
    first = pool.compile_launches([a, b, settle, a])
    print("first", first.variants, first.cache_hits, first.failed, first.stages_traced)
    # skipped launches left nothing in memory: a is sent again, the pool finds it on disk,
    # and the trace stops once that is known (a warm cache), by `settle`: b is never traced
    again = pool.compile_launches([a, settle, b])
    print("again", again.variants, again.cache_hits, again.failed, again.stages_traced < 3)
    after = pool.compile_launches([b])  # the last call found the cache warm: no trace
    print("after", after.variants, after.stages_traced)

    def build_ir(*args, **kwargs):
        raise AssertionError("compiled again: not found in the cache")

    compiler.ASTSource.make_ir = build_ir
    for config in configs:
        try:
            gemv_triton(x, weight, config)
        except Launched:
            print("found", config)
    """
)


def test_recorded_launches_compile_into_the_cache(triton_ready: None, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split("\n")
    assert "first 2 0 0 4" in lines, result.stdout  # two variants compiled, every stage traced
    assert "again 1 1 0 True" in lines, result.stdout  # found in the cache: the trace stopped
    assert "after 0 0" in lines, result.stdout
    assert "found (16, 256, 4, 4)" in lines and "found (8, 128, 4, 2)" in lines


def test_no_pool_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []
    compile_ahead.compile_ahead(None, lambda: ran.append(1), "nothing")
    assert ran == []
    monkeypatch.setenv("TOKENPIPE_COMPILE_AHEAD", "0")
    assert compile_ahead.start_compile_pool(4) is None
    monkeypatch.delenv("TOKENPIPE_COMPILE_AHEAD")
    assert compile_ahead.start_compile_pool(1) is None  # one process: no gain


class TracingPool(compile_ahead.CompilePool):
    """Runs every stage (no Triton on the CPU path: nothing to record)."""

    def __init__(self) -> None:
        self.processes, self.traces = 1, 0

    def compile_launches(self, stages):  # type: ignore[no-untyped-def]
        for stage in stages:
            stage()
        self.traces += 1
        return compile_ahead.AheadReport(stages_traced=len(stages))


def test_graph_start_traces_its_warm_up_once_and_stores_nothing() -> None:
    """The capture's warm-up runs once under the pool before the captures, on padding rows
    only: the KV cache stays as made (the eager runners on the CPU take the same path)."""
    import torch

    from tests.worker.test_cuda_graphs import tiny_model
    from worker.device.graphed_lm import GraphedCausalLM

    model = tiny_model("cpu")
    pool = TracingPool()
    graphed = GraphedCausalLM(model, use_graphs=False, compiles=pool)
    kv = graphed.make_kv_cache(4, 96)
    assert pool.traces == 1
    fresh = model.make_kv_cache(4, 96)
    for got, want in zip(kv.layers, fresh.layers, strict=True):
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def test_trace_runs_the_engine_warm_ups_chunks() -> None:
    """With the engine's prefill chunk given, the trace's last stage runs the chunks of
    `Engine.warm_up_prefill` (two chunks and an odd tail, one slot), so their kernel variants
    compile on the pool; without it, that stage runs nothing."""
    from tests.worker.test_cuda_graphs import tiny_model
    from worker.device.graphed_lm import GraphedCausalLM
    from worker.engine.engine import warm_up_tokens

    model = tiny_model("cpu")
    graphed = GraphedCausalLM(model, use_graphs=False, compiles=TracingPool())
    kv = graphed.make_kv_cache(4, 96)
    assert graphed._warm_up_stages(kv)[-1].func == graphed._trace_long_prefill
    seen: list[tuple[list[int], list[int]]] = []
    forward = model.forward

    def recording(step, kv):  # type: ignore[no-untyped-def]
        seen.append((list(step.cached_lens), list(step.new_lens)))
        return forward(step, kv)

    model.forward = recording  # type: ignore[method-assign]
    graphed._trace_long_prefill(kv)
    assert seen == []
    graphed.trace_chunk = 32
    graphed._trace_long_prefill(kv)
    assert seen == [([0], [32]), ([32], [32]), ([64], [25])]
    assert warm_up_tokens(32, 96) == 32 + 32 + 25 and warm_up_tokens(32, 60) == 57


def test_trace_keeps_states_inside_a_hybrid_models_steps() -> None:
    """With a prefix cache (`trace_block`), the trace's hybrid steps keep a state at a block end
    inside them, as a prompt's steps do under the prefix cache (the first block end, and the
    last one before the final token: inside the warm-up's tail), so fla's state pass compiles
    with those arguments on the pool (session 36: the one variant the warm-up still compiled).
    No pool exists yet: nothing is written, and the captures are gone afterwards."""
    import torch
    from test_engine_qwen3_5_moe import _config

    from worker.device.graphed_lm import GraphedCausalLM
    from worker.layers.hybrid_cache import DeltaNetLayerCache
    from worker.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(_config(), "cpu", torch.float32)
    graphed = GraphedCausalLM(model, use_graphs=False, capture=False)
    kv = graphed.make_kv_cache(2, 96)
    inside: list[tuple[int, int]] = []
    save = DeltaNetLayerCache.save_snapshot

    def recording(self, slot, tokens, conv, recurrent):  # type: ignore[no-untyped-def]
        inside.append((slot, tokens))
        return save(self, slot, tokens, conv, recurrent)

    graphed.trace_chunk, graphed.trace_block = 32, 16  # 89 tokens: 32 + 32 + 25
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(DeltaNetLayerCache, "save_snapshot", recording)
        graphed._trace_long_prefill(kv)
        layers = len(kv.deltanet_layers)
        assert sorted(set(inside)) == [(0, 16), (0, 80)] and len(inside) == 2 * layers
        assert kv._state_captures == []
        inside.clear()
        graphed.trace_block = 0  # no prefix cache: no state inside a step
        graphed._trace_long_prefill(kv)
        assert inside == []
