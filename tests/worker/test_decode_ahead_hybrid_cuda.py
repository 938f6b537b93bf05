"""Decode ahead on a hybrid cache on the GPU (captured decode graphs, the side stream, the state
backup copied there before each step ahead): the engine gives, token for token, what it gives
without decode ahead, through rows finishing, joining and cancelled, sampled rows, warm resumes,
rollbacks and prefix-cache reuse. fp32, the tiny qwen3_5_moe with seeded weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_decode_ahead_hybrid import Schedule, _drive, _req
from test_engine_qwen3_5_moe import IdTokenizer, ids
from test_qwen3_5_moe_cuda import _model

from protocol import CancelRequest
from worker.engine.engine import Engine, EngineConfig

CUDA = torch.cuda.is_available()


def _gpu_engine(ahead: bool, slots: int) -> Engine:
    from worker.device.cuda_setup import prepare_model_for_device
    from worker.device.graphed_lm import GraphedCausalLM

    inner = prepare_model_for_device(SimpleNamespace(model=_model("cuda")), "cuda",
                                     cuda_graphs=False)  # fmt: skip
    graphed = GraphedCausalLM(inner, decode_ahead=ahead)
    loaded = SimpleNamespace(model=graphed, tokenizer=IdTokenizer(), config=inner.config, meta={})
    # 4 slots: decode buckets up to 4, all of which a step ahead may have; 5: a bucket of 8
    # (more rows than slots: padding rows) that a step ahead never has
    config = EngineConfig(
        max_sessions=slots, max_context=512, prefill_chunk=64, prefix_cache_bytes=32 << 20,
        prefix_block=8,
    )  # fmt: skip
    return Engine(loaded, config, "cuda")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("slots", [4, 5])
def test_gpu_engine_with_decode_ahead_equals_without(slots: int) -> None:
    plain, ahead = _gpu_engine(False, slots), _gpu_engine(True, slots)
    assert len(ahead.model._lanes) == 2 and ahead.kv.ahead_rows == 4
    a, b, c, d = ids(20, 1), ids(13, 2), ids(70, 3), ids(9, 4)
    shared = ids(40, 20)
    first: Schedule = {
        0: [
            _req("a", a, "sa", 40),
            _req("b", b, None, 6, temperature=0.9, top_k=40, seed=7),
            _req("c", c, None, 30),
        ],
        8: [_req("d", d, "sd", 24, temperature=0.7, top_p=0.9, seed=3)],
        20: [CancelRequest(id="a")],
    }
    want = _drive(plain, first)
    assert _drive(ahead, first) == want
    d2 = d + want["d"][-1][1] + ids(5, 5)
    a2 = a + want["a"][-1][1] + ids(3, 6)
    later: list[Schedule] = [
        {
            0: [
                _req("d2", d2, "sd", 16, temperature=0.7, top_p=0.9, seed=4),
                _req("a2", a2, "sa", 16),
            ]
        },
        {0: [_req("d3", d2, "sd", 16, temperature=0.7, top_p=0.9, seed=4)]},  # regenerate
        {0: [_req("x", shared + ids(7, 22), None, 16)]},
        {0: [_req("y", shared + ids(9, 23), None, 16), _req("z", ids(5, 24), "sz", 16)]},
    ]
    for schedule in later:
        assert _drive(ahead, schedule) == _drive(plain, schedule)
    stats = ahead.model.graph_stats()["decode_ahead"]
    assert stats["hits"] >= 30 and stats["misses"] >= 4, stats
    assert ahead.prefix_cache is not None and ahead.prefix_cache.hits >= 1
