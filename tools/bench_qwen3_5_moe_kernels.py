"""qwen3_5_moe's CUDA kernels alone, one layer of the 35B-A3B shape, bf16 (an H200 run):

- Gated DeltaNet prefill of one sequence (2,048 tokens): the torch chunked form against
  flash-linear-attention's ``chunk_gated_delta_rule`` (time, and the relative difference of
  their outputs and final states);
- Gated DeltaNet decode step at batch 1 and 32 (CUDA graphs): the torch step (gather the slots'
  states, update, scatter back), fla's ``fused_recurrent_gated_delta_rule`` with the same
  gather/scatter, and the in-place Triton step (``worker.device.kernels.deltanet_decode``);
- the routed experts at 1, 32 and 2,048 tokens: the grouped-GEMM Triton MoE against the
  per-expert loop, with the bandwidth of the expert weights it reads.

    python tools/bench_qwen3_5_moe_kernels.py [--out DIR] [--only moe_1,sweep_int4_1,...]

- ``sweep_{bf16,int4}_{1,32}``: the routed experts' time per tile choice (``SWEEP``);
  ``gemv_{int4,int8}_{1,4,32}``, ``gemv_bf16_1``: the per-pair GEMVs per tile (``GEMV_SWEEP``,
  ``FLOAT_GEMV_SWEEP``);
  ``routing_32``: the routing launches of 32 tokens alone;
  ``lanes_{1,4,32}``: int4 experts, the per-pair kernel against the lanes kernel's tiles and
  the expert order;
  ``sweep_deltanet_{1,32}``: the DeltaNet decode step's per value-dims tile and warps.

Prints one line per figure and writes DIR/bench_qwen3_5_moe_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HIDDEN, HK, HV, DK, DV, KERNEL = 2048, 16, 32, 128, 128, 4
EXPERTS, TOP_K, INNER = 256, 8, 512
CONV_DIM = 2 * HK * DK + HV * DV
results: dict[str, Any] = {}


def log(key: str, value: Any, note: str = "") -> None:
    results[key] = value
    print(f"{key}: {value} {note}", flush=True)


def graph_time(fn: Callable[[], Any], reps: int = 20) -> float:
    """Seconds per call of fn replayed from a CUDA graph (after a warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_time(graph.replay, reps)


def replay_time(fn: Callable[[], Any], reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def deltanet_prefill(n: int = 2048) -> None:
    from worker.layers.deltanet import chunked_gated_delta_rule, fla_chunk_rule, l2_normalize

    gen = torch.Generator(device="cuda").manual_seed(0)
    conv = torch.randn(n, CONV_DIM, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(n, HV, device="cuda", generator=gen) * 0.5
    beta = torch.rand(n, HV, device="cuda", generator=gen)
    state = torch.randn(HV, DK, DV, device="cuda", generator=gen) * 0.1

    def torch_form() -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = torch.split(conv.float(), [HK * DK, HK * DK, HV * DV], dim=-1)
        q = l2_normalize(q.reshape(n, HK, DK)).repeat_interleave(HV // HK, 1) * DK**-0.5
        k = l2_normalize(k.reshape(n, HK, DK)).repeat_interleave(HV // HK, 1)
        out, final = chunked_gated_delta_rule(
            q.transpose(0, 1), k.transpose(0, 1), v.reshape(n, HV, DV).transpose(0, 1),
            g.T, beta.T, state,
        )  # fmt: skip
        return out.transpose(0, 1), final

    want = torch_form()
    log(f"deltanet_prefill_{n}_torch_ms", round(replay_time(torch_form, 5) * 1e3, 3))
    rule = fla_chunk_rule()
    if rule is None:
        log("fla", "does not import")
        return

    def fla_form() -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = torch.split(conv, [HK * DK, HK * DK, HV * DV], dim=-1)
        out, final = rule(
            q.reshape(1, n, HK, DK), k.reshape(1, n, HK, DK), v.reshape(1, n, HV, DV),
            g[None], beta[None], scale=DK**-0.5, initial_state=state[None],
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return out[0], final[0]

    got = fla_form()
    log(f"deltanet_prefill_{n}_fla_ms", round(replay_time(fla_form, 5) * 1e3, 3))
    log("fla_vs_torch_rel_out", round(rel(got[0], want[0]), 5))
    log("fla_vs_torch_rel_state", round(rel(got[1], want[1]), 5))


def deltanet_decode(batch: int, slots_total: int = 40) -> None:
    from worker.device.kernels.deltanet_decode import conv_step_triton, gated_delta_step_triton
    from worker.layers.deltanet import (
        causal_conv1d_step,
        l2_normalize,
        recurrent_gated_delta_rule,
    )

    gen = torch.Generator(device="cuda").manual_seed(1)
    mixed = torch.randn(batch, CONV_DIM, device="cuda", generator=gen).bfloat16()
    a = torch.randn(batch, HV, device="cuda", generator=gen).bfloat16()
    b = torch.randn(batch, HV, device="cuda", generator=gen).bfloat16()
    a_log, dt_bias = torch.randn(HV, device="cuda"), torch.randn(HV, device="cuda")
    weight = torch.randn(CONV_DIM, KERNEL, device="cuda").bfloat16()
    conv_state = torch.randn(slots_total, CONV_DIM, KERNEL - 1, device="cuda").bfloat16()
    state = torch.randn(slots_total, HV, DK, DV, device="cuda") * 0.1
    slots = torch.arange(batch, device="cuda") * (slots_total // batch)

    def split(conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = torch.split(conv_out.float(), [HK * DK, HK * DK, HV * DV], dim=-1)
        q = l2_normalize(q.reshape(batch, HK, DK)).repeat_interleave(HV // HK, 1) * DK**-0.5
        k = l2_normalize(k.reshape(batch, HK, DK)).repeat_interleave(HV // HK, 1)
        return q, k, v.reshape(batch, HV, DV)

    def gates() -> tuple[torch.Tensor, torch.Tensor]:
        g = -a_log.exp() * F.softplus(a.float() + dt_bias)
        return g, b.float().sigmoid()

    def torch_step() -> torch.Tensor:
        conv_out, conv = causal_conv1d_step(mixed, conv_state[slots], weight)
        q, k, v = split(conv_out)
        o, new = recurrent_gated_delta_rule(q, k, v, *gates(), state[slots])
        conv_state[slots] = conv
        state[slots] = new
        return o

    def triton_step() -> torch.Tensor:
        conv_out = conv_step_triton(mixed, conv_state, weight, slots)
        return gated_delta_step_triton(
            conv_out, a, b, a_log, dt_bias, state, slots, num_key_heads=HK, key_dim=DK
        )

    for name, fn in (("torch", torch_step), ("triton_inplace", triton_step)):
        log(f"deltanet_decode_b{batch}_{name}_us", round(graph_time(fn) * 1e6, 1))
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as exc:  # noqa: BLE001
        log("fla_fused_recurrent", repr(exc))
        return

    def fla_step() -> torch.Tensor:
        conv_out, conv = causal_conv1d_step(mixed, conv_state[slots], weight)
        q, k, v = torch.split(conv_out, [HK * DK, HK * DK, HV * DV], dim=-1)
        g, beta = gates()
        o, new = fused_recurrent_gated_delta_rule(
            q.reshape(batch, 1, HK, DK), k.reshape(batch, 1, HK, DK),
            v.reshape(batch, 1, HV, DV), g[:, None], beta[:, None], scale=DK**-0.5,
            initial_state=state[slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        conv_state[slots] = conv
        state[slots] = new
        return o

    log(f"deltanet_decode_b{batch}_fla_gather_us", round(graph_time(fla_step) * 1e6, 1))
    # the same step from the same state: the three agree
    saved = (conv_state.clone(), state.clone())
    outs = []
    for fn in (torch_step, triton_step, fla_step):
        conv_state.copy_(saved[0])
        state.copy_(saved[1])
        outs.append(fn().float().reshape(batch, HV, DV))
    log(f"deltanet_decode_b{batch}_rel_triton", round(rel(outs[1], outs[0]), 6))
    log(f"deltanet_decode_b{batch}_rel_fla", round(rel(outs[2], outs[0]), 6))


def moe(tokens: int) -> None:
    from worker.device.kernels.moe import fused_moe_triton

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    gate_up = (torch.randn(EXPERTS, 2 * INNER, HIDDEN, device="cuda") * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INNER, device="cuda") * 0.04).bfloat16()
    probs = torch.softmax(torch.randn(tokens, EXPERTS, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()

    def loop() -> torch.Tensor:
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // TOP_K
        counts = torch.bincount(flat, minlength=EXPERTS)
        hit = torch.nonzero(counts).flatten()
        gathered = x[tok]
        out = torch.empty_like(gathered)
        start = 0
        for expert, size in zip(hit.tolist(), counts[hit].tolist(), strict=True):
            rows = slice(start, start + size)
            h = F.linear(gathered[rows], gate_up[expert])
            out[rows] = F.linear(F.silu(h[:, :INNER]) * h[:, INNER:], down[expert])
            start += size
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tok, out)

    def fused() -> torch.Tensor:
        return fused_moe_triton(x, gate_up, down, weights, ids)

    hit = int(torch.unique(ids).numel())
    weight_bytes = hit * 3 * INNER * HIDDEN * 2
    t_fused = graph_time(fused) if tokens <= 64 else replay_time(fused, 10)
    t_loop = replay_time(loop, 3)
    log(f"moe_t{tokens}_triton_us", round(t_fused * 1e6, 1),
        f"({hit} experts, {weight_bytes / t_fused / 1e12:.2f} TB/s of expert weights, "
        f"{2 * tokens * TOP_K * 3 * INNER * HIDDEN / t_fused / 1e12:.1f} TFLOP/s)")  # fmt: skip
    log(f"moe_t{tokens}_loop_us", round(t_loop * 1e6, 1))
    log(f"moe_t{tokens}_rel", round(rel(fused(), loop()), 5))


def deltanet_sweep(batch: int, slots_total: int = 40) -> None:
    """The in-place DeltaNet decode step's time per (value dims per program, warps)."""
    from worker.device.kernels.deltanet_decode import gated_delta_step_triton

    gen = torch.Generator(device="cuda").manual_seed(5)
    conv_out = torch.randn(batch, CONV_DIM, device="cuda", generator=gen).bfloat16()
    a = torch.randn(batch, HV, device="cuda", generator=gen).bfloat16()
    b = torch.randn(batch, HV, device="cuda", generator=gen).bfloat16()
    a_log, dt_bias = torch.randn(HV, device="cuda"), torch.randn(HV, device="cuda")
    state = torch.randn(slots_total, HV, DK, DV, device="cuda") * 0.1
    slots = torch.arange(batch, device="cuda") * (slots_total // batch)
    for block_v, warps in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)):

        def step(bv: int = block_v, w: int = warps) -> torch.Tensor:
            return gated_delta_step_triton(conv_out, a, b, a_log, dt_bias, state, slots,
                                           num_key_heads=HK, key_dim=DK, block_v=bv,
                                           num_warps=w)  # fmt: skip

        t = graph_time(step)
        log(f"deltanet_sweep_b{batch}_v{block_v}_w{warps}_us", round(t * 1e6, 1),
            f"{2 * batch * HV * DK * DV * 4 / t / 1e12:.2f} TB/s of state")  # fmt: skip
    from worker.device.kernels.deltanet_decode import (
        gated_delta_norm_step_triton,
        gated_rms_norm_triton,
    )

    z = torch.randn(batch, HV, DV, device="cuda", generator=gen).bfloat16()
    norm_w = torch.randn(DV, device="cuda", generator=gen).bfloat16()

    def two_kernels() -> torch.Tensor:
        o = gated_delta_step_triton(conv_out, a, b, a_log, dt_bias, state, slots,
                                    num_key_heads=HK, key_dim=DK)  # fmt: skip
        return gated_rms_norm_triton(o, z, norm_w, 1e-6, torch.bfloat16)

    log(f"deltanet_sweep_b{batch}_step_and_norm_us", round(graph_time(two_kernels) * 1e6, 1))
    for block_v, warps in ((32, 4), (32, 8), (64, 4), (64, 8), (16, 4)):

        def fused(bv: int = block_v, w: int = warps) -> torch.Tensor:
            return gated_delta_norm_step_triton(conv_out, a, b, a_log, dt_bias, state, slots, z,
                                                norm_w, 1e-6, num_key_heads=HK, key_dim=DK,
                                                block_v=bv, num_warps=w)  # fmt: skip

        log(f"deltanet_sweep_b{batch}_fused_norm_v{block_v}_w{warps}_us",
            round(graph_time(fused) * 1e6, 1))  # fmt: skip


# (block_m, gate_up_n, down_n, block_k, num_warps, num_stages)
SWEEP = [  # register-light tiles first (the quantized kernels dequantize whole tiles)
    (16, 16, 32, 64, 4, 2),
    (16, 16, 32, 32, 4, 2),
    (16, 32, 32, 64, 8, 2),
    (16, 16, 32, 64, 8, 3),
    (16, 16, 64, 64, 4, 3),
    (16, 32, 64, 32, 4, 3),
    (16, 32, 64, 128, 4, 3),
    (16, 16, 32, 128, 4, 3),
    (16, 16, 64, 256, 4, 3),
    (16, 32, 64, 256, 4, 3),
    (16, 64, 128, 128, 4, 3),
    (16, 32, 64, 128, 8, 4),
    (16, 32, 64, 128, 4, 5),
    (16, 64, 64, 64, 4, 4),
]


def moe_sweep(tokens: int, kind: str) -> None:
    """The routed experts' time per tile choice (SWEEP) at ``tokens`` tokens, float (bf16) or
    quantized (int4 / int8, group 32) experts, each in a CUDA graph."""
    from worker.device.kernels.moe import MoeBlocks, choose_blocks, fused_moe_triton

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(tokens, EXPERTS, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    if kind == "bf16":
        gate_up = (torch.randn(EXPERTS, 2 * INNER, HIDDEN, device="cuda") * 0.02).bfloat16()
        down = (torch.randn(EXPERTS, HIDDEN, INNER, device="cuda") * 0.04).bfloat16()
        per_expert = 3 * INNER * HIDDEN * 2

        def run(blocks: Any) -> torch.Tensor:
            return fused_moe_triton(x, gate_up, down, weights, ids, blocks)
    else:
        from worker.device.kernels.moe_quant import fused_moe_quant_triton
        from worker.layers.quant import QuantFormat
        from worker.layers.quant_experts import QuantExperts

        experts = QuantExperts(EXPERTS, HIDDEN, INNER, QuantFormat(kind, 32)).cuda()
        experts.draw_random(0.02, torch.Generator(device="cuda").manual_seed(4), torch.bfloat16)
        gu, dn = experts.matrix("gate_up_proj"), experts.matrix("down_proj")
        per_expert = experts.nbytes // EXPERTS

        def run(blocks: Any) -> torch.Tensor:
            return fused_moe_quant_triton(x, gu, dn, weights, ids, blocks, gemv=False,
                                          dequant=False)  # fmt: skip

    hit = int(torch.unique(ids).numel())
    default = choose_blocks(tokens, HIDDEN, INNER)
    log(f"moe_sweep_{kind}_t{tokens}_default", str(default))
    want = run(None)
    for choice in SWEEP:
        blocks = MoeBlocks(*choice)
        try:
            t = graph_time(lambda b=blocks: run(b))
            ok = rel(run(blocks), want) < 1e-2
        except Exception as exc:  # noqa: BLE001 - a tile this GPU cannot run
            log(f"moe_sweep_{kind}_t{tokens}_{choice}", repr(exc)[:120])
            continue
        log(f"moe_sweep_{kind}_t{tokens}_{choice}_us", round(t * 1e6, 1),
            f"{hit * per_expert / t / 1e12:.2f} TB/s{'' if ok else ' WRONG'}")  # fmt: skip


def quant_prefill(tokens: int, kind: str) -> None:
    """Quantized routed experts (group 32) over a prefill chunk of ``tokens``: the hit experts
    dequantized to a bf16 scratch + the float grouped GEMMs (the default), the dequantization
    alone, and the quantized grouped GEMMs, each in a CUDA graph."""
    from worker.device.kernels.moe_quant import (
        dequantize_experts,
        fused_moe_quant_triton,
        hit_experts,
    )
    from worker.layers.quant import QuantFormat
    from worker.layers.quant_experts import QuantExperts

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(tokens, EXPERTS, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    experts = QuantExperts(EXPERTS, HIDDEN, INNER, QuantFormat(kind, 32)).cuda()
    experts.draw_random(0.02, torch.Generator(device="cuda").manual_seed(4), torch.bfloat16)
    gu, dn = experts.matrix("gate_up_proj"), experts.matrix("down_proj")
    hit = hit_experts(ids, EXPERTS)

    def dequantize_only() -> None:
        dequantize_experts(gu, hit, torch.bfloat16)
        dequantize_experts(dn, hit, torch.bfloat16)

    def run(dequant: bool) -> torch.Tensor:
        return fused_moe_quant_triton(x, gu, dn, weights, ids, gemv=False, dequant=dequant)

    written = int(hit.sum()) * 3 * INNER * HIDDEN * 2 + experts.nbytes * int(hit.sum()) // EXPERTS
    t = graph_time(dequantize_only)
    log(f"prefill_{kind}_t{tokens}_dequantize_us", round(t * 1e6, 1),
        f"{written / t / 1e12:.2f} TB/s read + written")  # fmt: skip
    t_deq = graph_time(lambda: run(True))
    err = rel(run(True), run(False))
    log(f"prefill_{kind}_t{tokens}_dequant_gemm_us", round(t_deq * 1e6, 1), f"rel {err:.1e}")
    t_q = graph_time(lambda: run(False), reps=2)
    log(f"prefill_{kind}_t{tokens}_quant_gemm_us", round(t_q * 1e6, 1),
        f"dequant path {t_q / t_deq:.1f}x faster")  # fmt: skip


# the per-pair kernel's GemvTiles fields: (block_n, warps, programs); programs 1: no K split
# (gate_up's kernel gated)
GEMV_SWEEP = [(128, 4, 264), (128, 2, 264), (64, 4, 264), (128, 4, 132), (128, 2, 528),
              (64, 4, 528), (32, 4, 1), (64, 4, 1), (32, 8, 1), (64, 8, 1), (128, 4, 1),
              (16, 4, 1)]  # fmt: skip


def gemv_sweep(tokens: int, kind: str) -> None:
    """Quantized routed experts (group 32) at a few tokens: the per-pair GEMVs
    (``moe_gemv.moe_quant_gemv``) per tile choice (GEMV_SWEEP) against the grouped GEMMs, each in a
    CUDA graph, with the bandwidth of the expert bytes they read."""
    from worker.device.kernels.moe_gemv import GemvTiles, moe_quant_gemv
    from worker.device.kernels.moe_quant import fused_moe_quant_triton
    from worker.layers.quant import QuantFormat
    from worker.layers.quant_experts import QuantExperts

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(tokens, EXPERTS, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    experts = QuantExperts(EXPERTS, HIDDEN, INNER, QuantFormat(kind, 32)).cuda()
    experts.draw_random(0.02, torch.Generator(device="cuda").manual_seed(4), torch.bfloat16)
    gu, dn = experts.matrix("gate_up_proj"), experts.matrix("down_proj")
    read = int(torch.unique(ids).numel()) * experts.nbytes // EXPERTS
    want = fused_moe_quant_triton(x, gu, dn, weights, ids, gemv=False, dequant=False)
    t = graph_time(lambda: fused_moe_quant_triton(x, gu, dn, weights, ids, gemv=False,
                                                  dequant=False))  # fmt: skip
    log(f"gemv_sweep_{kind}_t{tokens}_grouped_us", round(t * 1e6, 1), f"{read / t / 1e12:.2f} TB/s")
    for choice in GEMV_SWEEP:
        tiles = GemvTiles(*choice, lanes=0)  # the per-pair kernel's tiles
        try:
            t = graph_time(lambda c=tiles: moe_quant_gemv(x, gu, dn, weights, ids, t=c))
            err = rel(moe_quant_gemv(x, gu, dn, weights, ids, t=tiles), want)
        except Exception as exc:  # noqa: BLE001 - a tile this GPU cannot run
            log(f"gemv_sweep_{kind}_t{tokens}_{choice}", repr(exc)[:120])
            continue
        note = f"{read / t / 1e12:.2f} TB/s rel {err:.1e}{'' if err < 1e-2 else ' WRONG'}"
        log(f"gemv_sweep_{kind}_t{tokens}_{choice}_us", round(t * 1e6, 1), note)


# GemvTiles fields: (block_n, warps, programs, lanes); lanes 0: the per-pair kernel
LANES_SWEEP = [(128, 4, 264, 0), (128, 4, 264, 2), (128, 4, 264, 4), (128, 8, 264, 2),
               (128, 8, 264, 4), (128, 2, 264, 2), (64, 4, 264, 2), (128, 4, 528, 2)]  # fmt: skip


def lanes_sweep(
    tokens: int, sweep: list[tuple[int, ...]] = LANES_SWEEP, order: bool = True
) -> None:
    """int4 routed experts (group 32) at a few tokens: the per-pair kernel against the lanes
    kernel per tile choice (LANES_SWEEP), in pair order and in expert order (the order
    computed outside the graph; ``expert_order`` timed alone), each in a CUDA graph, with
    the bandwidth of the distinct expert bytes."""
    from worker.device.kernels.moe_gemv import GemvTiles, expert_order, moe_quant_gemv
    from worker.layers.quant import QuantFormat
    from worker.layers.quant_experts import QuantExperts

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(tokens, EXPERTS, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    experts = QuantExperts(EXPERTS, HIDDEN, INNER, QuantFormat("int4", 32)).cuda()
    experts.draw_random(0.02, torch.Generator(device="cuda").manual_seed(4), torch.bfloat16)
    gu, dn = experts.matrix("gate_up_proj"), experts.matrix("down_proj")
    hit = int(torch.unique(ids).numel())
    read = hit * experts.nbytes // EXPERTS
    want = moe_quant_gemv(x, gu, dn, weights, ids, t=GemvTiles(lanes=0))
    ordered_too, order = order, expert_order(ids)
    t = graph_time(lambda: expert_order(ids))
    log(f"lanes_t{tokens}_expert_order_us", round(t * 1e6, 1), f"{hit} experts hit")
    for choice in sweep:
        tiles = GemvTiles(*choice)
        for ordered in (None, order) if choice[3] and ordered_too else (None,):
            name = f"lanes_t{tokens}_{choice}{'_ordered' if ordered is not None else ''}"
            try:
                t = graph_time(lambda c=tiles, o=ordered: moe_quant_gemv(x, gu, dn, weights, ids,
                                                                         t=c, order=o))  # fmt: skip
                err = rel(moe_quant_gemv(x, gu, dn, weights, ids, t=tiles, order=ordered), want)
            except Exception as exc:  # noqa: BLE001 - a tile this GPU cannot run
                log(name, repr(exc)[:160])
                continue
            note = f"{read / t / 1e12:.2f} TB/s rel {err:.1e}{'' if err < 1e-2 else ' WRONG'}"
            log(f"{name}_us", round(t * 1e6, 1), note)


def routing(tokens: int) -> None:
    """The routing launches of a decode batch alone (CUDA graphs): the router (``route_triton``),
    the pairs' alignment for the grouped GEMMs' 16-row blocks (``align_pairs_triton``), and both
    in one launch (``route_align_triton``, its pair limit lifted)."""
    import worker.device.kernels.moe as moe

    gen = torch.Generator(device="cuda").manual_seed(7)
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=gen).bfloat16()
    weights, ids = moe.route_triton(logits, TOP_K)
    t_route = graph_time(lambda: moe.route_triton(logits, TOP_K))
    t_align = graph_time(lambda: moe.align_pairs_triton(ids, EXPERTS, 16))
    saved = moe.ROUTE_ALIGN_MAX_PAIRS
    moe.ROUTE_ALIGN_MAX_PAIRS = max(saved, tokens * TOP_K)
    try:
        t_both = graph_time(lambda: moe.route_align_triton(logits, TOP_K, 16))
        _, got_ids, _ = moe.route_align_triton(logits, TOP_K, 16)
    finally:
        moe.ROUTE_ALIGN_MAX_PAIRS = saved
    log(f"routing_t{tokens}_us", {"route": round(t_route * 1e6, 1),
        "align": round(t_align * 1e6, 1), "route_align": round(t_both * 1e6, 1)},
        "" if torch.equal(got_ids, ids) else "(route_align ids DIFFER)")  # fmt: skip


# FloatTiles fields: (block_n, block_k, warps, programs)
FLOAT_GEMV_SWEEP = [(16, 256, 4, 528), (8, 256, 4, 528), (32, 128, 4, 528), (16, 512, 4, 528),
                    (16, 256, 8, 528), (4, 512, 4, 528), (16, 256, 4, 1056), (8, 512, 8, 1056),
                    (32, 256, 8, 528), (16, 128, 2, 1056)]  # fmt: skip


def float_gemv_sweep(tokens: int) -> None:
    """bf16 routed experts at a token or two: the per-pair GEMVs (``moe_gemv.moe_float_gemv``)
    per tile choice (FLOAT_GEMV_SWEEP) against the grouped GEMMs, each in a CUDA graph."""
    from worker.device.kernels.moe import fused_moe_triton
    from worker.device.kernels.moe_gemv import FloatTiles, moe_float_gemv

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(tokens, EXPERTS, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16()
    gate_up = (torch.randn(EXPERTS, 2 * INNER, HIDDEN, device="cuda") * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INNER, device="cuda") * 0.04).bfloat16()
    read = int(torch.unique(ids).numel()) * 3 * INNER * HIDDEN * 2
    want = fused_moe_triton(x, gate_up, down, weights, ids)
    t = graph_time(lambda: fused_moe_triton(x, gate_up, down, weights, ids))
    log(f"gemv_sweep_bf16_t{tokens}_grouped_us", round(t * 1e6, 1), f"{read / t / 1e12:.2f} TB/s")
    for choice in FLOAT_GEMV_SWEEP:
        tiles = FloatTiles(*choice)
        try:
            t = graph_time(lambda c=tiles: moe_float_gemv(x, gate_up, down, weights, ids, t=c))
            err = rel(moe_float_gemv(x, gate_up, down, weights, ids, t=tiles), want)
        except Exception as exc:  # noqa: BLE001 - a tile this GPU cannot run
            log(f"gemv_sweep_bf16_t{tokens}_{choice}", repr(exc)[:120])
            continue
        note = f"{read / t / 1e12:.2f} TB/s rel {err:.1e}{'' if err < 1e-2 else ' WRONG'}"
        log(f"gemv_sweep_bf16_t{tokens}_{choice}_us", round(t * 1e6, 1), note)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=".")
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = p.parse_args()
    log("gpu", torch.cuda.get_device_name())
    log("torch", torch.__version__)
    started = time.perf_counter()
    cases: list[tuple[str, Callable[[], None]]] = [
        ("moe_1", lambda: moe(1)),
        ("moe_32", lambda: moe(32)),
        ("moe_2048", lambda: moe(2048)),
        ("deltanet_decode_1", lambda: deltanet_decode(1)),
        ("deltanet_decode_32", lambda: deltanet_decode(32)),
        ("deltanet_prefill", deltanet_prefill),
        ("sweep_bf16_1", lambda: moe_sweep(1, "bf16")),
        ("sweep_bf16_32", lambda: moe_sweep(32, "bf16")),
        ("sweep_int4_1", lambda: moe_sweep(1, "int4")),
        ("sweep_int4_32", lambda: moe_sweep(32, "int4")),
        ("prefill_int4_2048", lambda: quant_prefill(2048, "int4")),
        ("prefill_int4_256", lambda: quant_prefill(256, "int4")),
        ("gemv_int4_1", lambda: gemv_sweep(1, "int4")),
        ("gemv_bf16_1", lambda: float_gemv_sweep(1)),
        ("gemv_int4_32", lambda: gemv_sweep(32, "int4")),
        ("gemv_int4_4", lambda: gemv_sweep(4, "int4")),
        ("gemv_int8_1", lambda: gemv_sweep(1, "int8")),
        ("routing_32", lambda: routing(32)),
        ("lanes_32", lambda: lanes_sweep(32)),
        ("lanes_1", lambda: lanes_sweep(1, LANES_SWEEP[:3], order=False)),
        ("lanes_4", lambda: lanes_sweep(4, LANES_SWEEP[:3], order=False)),
        ("sweep_deltanet_1", lambda: deltanet_sweep(1)),
        ("sweep_deltanet_32", lambda: deltanet_sweep(32)),
    ]
    only = [c for c in args.only.split(",") if c]
    for name, fn in cases:
        if only and name not in only:
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and go on
            log(f"{name}_failed", repr(exc))
        torch.cuda.empty_cache()
    log("seconds", round(time.perf_counter() - started, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_qwen3_5_moe_kernels.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
