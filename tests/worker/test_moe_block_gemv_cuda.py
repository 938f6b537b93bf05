"""The blocked MoE GEMVs (worker/device/kernels/moe_block_gemv.py) and the per-pair GEMVs in
expert order on a GPU, at a decode batch of 32 tokens of top 8, int4 experts: against the
per-pair GEMVs, each replayed from a CUDA graph equal to its eager launch. (The interpreter
tests of the same kernels are in test_quant_experts.py.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EXPERTS, HIDDEN, INNER, TOP_K, TOKENS = 64, 512, 256, 8, 32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _graphed(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(TOKENS, EXPERTS, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    shared = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    shared_gate = torch.randn(TOKENS, 1, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    return x, weights, ids, shared, shared_gate, residual


@pytest.mark.parametrize("tiles", [(2, 128, 4, 264), (2, 64, 4, 264), (4, 64, 2, 5000)])
def test_int4_block_gemv_equals_per_pair_gemvs(tiles: tuple[int, ...]) -> None:
    from worker.device.kernels.moe_block_gemv import BlockTiles, moe_quant_block_gemv
    from worker.device.kernels.moe_gemv import moe_quant_gemv
    from worker.layers.quant import QuantFormat
    from worker.layers.quant_experts import QuantExperts

    x, weights, ids, shared, shared_gate, residual = _inputs(3)
    experts = QuantExperts(EXPERTS, HIDDEN, INNER, QuantFormat("int4", 32)).cuda()
    experts.draw_random(0.05, torch.Generator(device="cuda").manual_seed(4), torch.bfloat16)
    gu, dn = experts.matrix("gate_up_proj"), experts.matrix("down_proj")
    want = moe_quant_gemv(x, gu, dn, weights, ids, shared, shared_gate, residual)
    t = BlockTiles(*tiles)

    def run() -> torch.Tensor:
        return moe_quant_block_gemv(x, gu, dn, weights, ids, shared, shared_gate, residual, t=t)

    eager = run()
    assert _rel(eager, want) < 2e-3  # the same fp32 sums, bf16 roundings of the outputs
    assert torch.equal(_graphed(run), eager)


def test_int4_per_pair_gemvs_in_expert_order_give_the_same_bits() -> None:
    from worker.device.kernels.moe_gemv import moe_quant_gemv
    from worker.layers.quant import QuantFormat
    from worker.layers.quant_experts import QuantExperts

    x, weights, ids, shared, shared_gate, residual = _inputs(5)
    experts = QuantExperts(EXPERTS, HIDDEN, INNER, QuantFormat("int4", 32)).cuda()
    experts.draw_random(0.05, torch.Generator(device="cuda").manual_seed(6), torch.bfloat16)
    gu, dn = experts.matrix("gate_up_proj"), experts.matrix("down_proj")
    plain = moe_quant_gemv(x, gu, dn, weights, ids, shared, shared_gate, residual, ordered=False)

    def run() -> torch.Tensor:
        return moe_quant_gemv(x, gu, dn, weights, ids, shared, shared_gate, residual,
                              ordered=True)  # fmt: skip

    assert torch.equal(run(), plain)
    assert torch.equal(_graphed(run), plain)
