"""The shared-prefix pool (worker/engine/prefix_cache.py) on a bare KVCache: prefill steps are
simulated by storing a value that names each (layer, position), as the attention layers store
keys (a ring keeps the last R of a step, the capture sees all of them), so what a reused prefix
puts into another slot can be checked exactly."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import worker.layers.kv as kv_module
from worker.engine.prefix_cache import PrefixCache, block_keys
from worker.layers.kv import KVCache, run_start
from worker.models.config import LayerSpec, RopeSpec

BLOCK = 8
WINDOW = 10  # ring of 12 with the slack below


def make_kv() -> KVCache:
    rope = RopeSpec(theta=10_000.0)
    specs = [
        LayerSpec("sliding", 4, 2, False, rope),
        LayerSpec("full", 8, 1, True, rope),
        LayerSpec("sliding", 4, 2, False, rope),
    ]
    return KVCache(specs, WINDOW, 3, 128, "cpu", torch.float32, ring_slack=2)


def value(layer: int, position: int, prompt_id: int) -> float:  # exact in float32
    return layer * 100_000 + position * 10 + prompt_id % 7


def store_step(kv: KVCache, slot: int, prompt: list[int], cached: int, new: int,
               graph: bool) -> None:  # fmt: skip
    """What one prefill step's attention layers store; ``graph``: a replayed step (no capture)."""
    for i, layer in enumerate(kv.layers):
        vals = torch.tensor(
            [value(i, p, prompt[p]) for p in range(cached, cached + new)], dtype=torch.float32
        )
        new_k = vals[None, :, None].expand(layer.k.shape[1], new, layer.k.shape[3])
        new_v = -new_k
        if layer.window is None:
            layer.k[slot, :, cached : cached + new] = new_k
            layer.v[slot, :, cached : cached + new] = new_v
        else:
            kept = min(new, layer.capacity)
            index = torch.arange(cached + new - kept, cached + new) % layer.capacity
            layer.k[slot].index_copy_(1, index, new_k[:, new - kept :])
            layer.v[slot].index_copy_(1, index, new_v[:, new - kept :])
        if layer.capture is not None and not graph:
            layer.capture.take(layer, slot, new_k, new_v)


def prefill(cache: PrefixCache, slot: int, prompt: list[int], start: int, chunks: list[int],
            graph: bool = False) -> None:  # fmt: skip
    keys = block_keys(prompt, BLOCK)
    next_block, cached = 0, start
    for new in chunks:
        pending = cache.begin(prompt, keys, slot, next_block, cached, new)
        store_step(cache.kv, slot, prompt, cached, new, graph)
        cached += new
        if pending is not None:
            next_block = cache.finish(pending, slot, cached, ok=True)


def check_slot(kv: KVCache, slot: int, prompt: list[int], tokens: int) -> None:
    """The slot holds what a prefill of prompt[:tokens] leaves: full layers [0, tokens), each
    ring the last positions it can hold."""
    for i, layer in enumerate(kv.layers):
        if layer.window is None:
            positions = list(range(tokens))
            held = layer.k[slot, 0, :tokens, 0].tolist()
        else:
            positions = list(range(max(0, tokens - layer.capacity), tokens))
            held = [layer.k[slot, 0, p % layer.capacity, 0].item() for p in positions]
        assert held == [value(i, p, prompt[p]) for p in positions], (i, tokens)


@pytest.mark.parametrize("chunks", [[40], [16, 16, 8], [5, 30, 5], [3] * 13 + [1]])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("runs", [True, False])
def test_a_shared_prefix_rebuilds_the_slot_exactly(
    chunks: list[int], graph: bool, runs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_module, "CAPTURE_RUNS", runs)  # a slice copy, or an indexed one
    kv = make_kv()
    cache = PrefixCache(kv, budget_bytes=64 * BLOCK * kv.pool_row_bytes, block=BLOCK)
    rng = random.Random(1)
    first = [rng.randrange(100) for _ in range(40)]
    prefill(cache, 0, first, 0, chunks, graph)
    second = first[:29] + [rng.randrange(100) for _ in range(11)]  # diverges inside block 3
    plan = cache.plan(second, block_keys(second, BLOCK), len(second) - 1)
    # a replayed step longer than the ring (12) left nothing for the positions it dropped
    lost = graph and max(chunks) > kv.ring_kept  # type: ignore[operator]
    if lost:
        assert plan.tokens < 24 and plan.truncated
    else:
        assert plan.tokens == 24 and not plan.truncated
    cache.apply(plan, 1, keep=0)
    check_slot(kv, 1, second, plan.tokens)
    store_step(kv, 2, second, 0, 5, graph=True)  # a slot already holding 5 of its tokens
    cache.apply(plan, 2, keep=5)
    check_slot(kv, 2, second, plan.tokens)


def test_a_capture_into_one_run_of_rows_is_a_slice_copy_and_any_other_an_indexed_one() -> None:
    assert run_start([5, 6, 7]) == 5 and run_start([0]) == 0
    assert run_start([]) is None and run_start([3, 4, 6]) is None and run_start([8, 0]) is None
    rng = random.Random(2)
    for fresh in (True, False):
        kv = make_kv()
        cache = PrefixCache(kv, budget_bytes=8 * BLOCK * kv.pool_row_bytes, block=BLOCK)
        if not fresh:
            cache._free.reverse()  # blocks handed out highest first: rows 56.., 48.., ...
        prompt = [rng.randrange(100) for _ in range(3 * BLOCK)]
        keys = block_keys(prompt, BLOCK)
        pending = cache.begin(prompt, keys, 0, 0, 0, len(prompt))
        assert pending is not None and pending.capture is not None
        assert pending.capture.run_start == (0 if fresh else None)
        store_step(kv, 0, prompt, 0, len(prompt), graph=False)
        assert pending.capture.written
        cache.finish(pending, 0, len(prompt), ok=True)
        plan = cache.plan(prompt + [1], block_keys(prompt + [1], BLOCK), len(prompt))
        assert plan.tokens == len(prompt)
        cache.apply(plan, 1, keep=0)
        check_slot(kv, 1, prompt, len(prompt))


def test_a_block_finished_by_a_later_turn_keeps_what_the_rings_held() -> None:
    kv = make_kv()
    cache = PrefixCache(kv, budget_bytes=64 * BLOCK * kv.pool_row_bytes, block=BLOCK)
    prompt = list(range(60))
    prefill(cache, 0, prompt, 0, [13])  # block 0 [0, 8) captured; block 1 unfinished
    store_step(kv, 0, prompt, 13, 5, graph=False)  # 5 decoded tokens: no block work
    prefill(cache, 0, prompt, 18, [6])  # blocks 1, 2: [8, 18) from the slot, the rest captured
    assert len(cache.blocks) == 3
    plan = cache.plan(prompt, block_keys(prompt, BLOCK), 40)
    assert plan.tokens == 24
    cache.apply(plan, 2, keep=0)
    check_slot(kv, 2, prompt, 24)
    # blocks finished after a longer gap: the rings (12) held [16, 28) when block 3 was done
    kv2 = make_kv()
    late = PrefixCache(kv2, budget_bytes=64 * BLOCK * kv2.pool_row_bytes, block=BLOCK)
    store_step(kv2, 0, prompt, 0, 28, graph=False)  # a turn no cache saw
    prefill(late, 0, prompt, 28, [4])
    keys = block_keys(prompt, BLOCK)
    assert [late.blocks[k].sliding_from for k in keys[:4]] == [8, 16, 16, 24]
    assert late.plan(prompt, keys, 40).tokens == 32  # needs [20, 32): there
    diverged = prompt[:20] + [99] * 10
    plan = late.plan(diverged, block_keys(diverged, BLOCK), 29)
    assert plan.tokens == 0 and plan.truncated  # 16 needs [4, 16): gone; 8 needs [0, 8)
    late.apply(late.plan(prompt, keys, 40), 1, keep=0)
    check_slot(kv2, 1, prompt, 32)


def test_lru_by_block_and_failed_steps_give_rows_back() -> None:
    kv = make_kv()
    cache = PrefixCache(kv, budget_bytes=3 * BLOCK * kv.pool_row_bytes, block=BLOCK)
    a, b = list(range(16)), list(range(50, 66))
    prefill(cache, 0, a, 0, [16])
    prefill(cache, 1, b, 0, [16])
    assert cache.stats()["blocks"] == 3 and cache.evictions == 1
    assert block_keys(a, BLOCK)[0] in cache.blocks  # a's descendant went first
    keys = block_keys(list(range(100, 116)), BLOCK)
    pending = cache.begin(list(range(100, 116)), keys, 2, 0, 0, 16)
    assert pending is not None
    cache.finish(pending, 2, 0, ok=False)
    assert len(cache._free) == 2 and all(layer.capture is None for layer in kv.layers)


def test_the_capture_benchmark_writes_the_same_bytes_both_ways(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """tools/bench_pool_capture.py on the CPU, small: a row per (cache, layer kind), each with
    equal bytes from the indexed and the slice copy, and the model totals."""
    tools = Path(__file__).resolve().parents[2] / "tools"
    monkeypatch.syspath_prepend(str(tools))
    from bench_pool_capture import main

    argv = ["bench_pool_capture.py", "--chunk", "16", "--pool-rows", "64", "--repeat", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    assert main() == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| bfloat16") or
            line.startswith("| fp8")]  # fmt: skip
    assert len(rows) == 4 and all(line.rstrip().endswith("| True |") for line in rows)
    assert "fp8: a 16-token chunk over the 31B's 60 layers" in out
