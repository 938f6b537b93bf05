"""The CUDA kernels of qwen3_5_moe (Triton's CPU interpreter here, CUDA on the GPU box) against
the layers' torch paths: the grouped-GEMM MoE against the per-expert loop, the in-place
DeltaNet decode step (conv + gated delta rule) against the batched torch step, padding rows
included; and the pair alignment (plain torch). The Triton tests need the `triton_ready`
fixture (tests/conftest.py: a skip without triton, a failure in CI)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layers.deltanet import causal_conv1d_step, l2_normalize, recurrent_gated_delta_rule

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] distinct expert ids per token, some experts unused, one expert crowded."""
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, 0] += 0.5  # expert 0 picked by most tokens: several blocks
    return torch.topk(scores, top_k, dim=-1).indices


@pytest.mark.parametrize("tokens,block_m", [(1, 16), (7, 4), (40, 16)])
def test_align_pairs_groups_each_expert_in_whole_blocks(tokens: int, block_m: int) -> None:
    pytest.importorskip("triton")
    from worker.device.kernels.moe import align_pairs, padded_length

    gen = torch.Generator().manual_seed(tokens)
    experts, top_k = 8, 2
    ids = _routing(tokens, experts, top_k, gen)
    aligned = align_pairs(ids, experts, block_m)
    pairs = tokens * top_k
    sorted_pairs = aligned.sorted_pairs.tolist()
    assert len(sorted_pairs) == padded_length(pairs, experts, block_m)
    assert sorted(p for p in sorted_pairs if p < pairs) == list(range(pairs))  # each pair once
    flat = ids.reshape(-1).tolist()
    for block, expert in enumerate(aligned.block_expert.tolist()):
        rows = sorted_pairs[block * block_m : (block + 1) * block_m]
        real = [p for p in rows if p < pairs]
        if expert >= experts:
            assert not real  # blocks past the used ones hold padding only
        else:
            assert real and all(flat[p] == expert for p in real)
            assert real == sorted(real)  # token order kept within an expert
            assert rows[: len(real)] == real  # padding at the end of a run


@pytest.mark.parametrize("tokens,block_m", [(1, 16), (7, 4), (40, 16), (700, 64)])
def test_align_kernel_equals_torch_alignment(triton_ready: None, tokens: int, block_m: int) -> None:
    from worker.device.kernels.moe import align_pairs, align_pairs_triton

    experts, top_k = 8 if tokens < 700 else 48, 2
    ids = _routing(tokens, experts, top_k, torch.Generator().manual_seed(tokens))
    want = align_pairs(ids, experts, block_m)
    got = align_pairs_triton(ids.to(DEVICE), experts, block_m)
    blocks = got.block_expert.cpu()
    assert torch.equal(blocks, want.block_expert)
    used = int((blocks < experts).sum()) * block_m  # rows past the used blocks are unset
    assert torch.equal(got.sorted_pairs.cpu()[:used], want.sorted_pairs[:used])


def test_route_kernel_equals_router(triton_ready: None) -> None:
    from worker.device.kernels.moe import route_triton

    logits = torch.randn(9, 40, generator=torch.Generator().manual_seed(4)) * 3
    probs = torch.softmax(logits, dim=-1)
    want_weights, want_ids = torch.topk(probs, 6, dim=-1)
    want_weights = want_weights / want_weights.sum(dim=-1, keepdim=True)
    weights, ids = route_triton(logits.to(DEVICE), 6)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-6, atol=1e-6)
    ties = torch.zeros(2, 40)
    ties[1, [3, 7, 30]] = 1.0  # three top experts, then 37 equal ones
    _, ids = route_triton(ties.to(DEVICE), 6)
    assert ids.cpu().tolist() == [[0, 1, 2, 3, 4, 5], [3, 7, 30, 0, 1, 2]]  # lowest index first


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 40, 6), (5, 256, 8), (16, 24, 8)])
def test_route_align_kernel_equals_route_then_align(
    triton_ready: None, tokens: int, experts: int, top_k: int
) -> None:
    """The one-launch routing and alignment of a decode step = the router then the torch
    alignment (weights, ids, pair order, blocks), from strided logits."""
    from worker.device.kernels.moe import align_pairs, route_align_triton

    gen = torch.Generator().manual_seed(tokens)
    wide = torch.randn(tokens, experts + 3, generator=gen) * 3
    wide[:, 2] += 2.0  # one expert crowded: several blocks
    logits = wide[:, 1 : experts + 1]  # strided rows, as in_proj's columns
    probs = torch.softmax(logits, dim=-1)
    want_weights, want_ids = torch.topk(probs, top_k, dim=-1)
    want_weights = want_weights / want_weights.sum(dim=-1, keepdim=True)
    weights, ids, aligned = route_align_triton(logits.to(DEVICE), top_k, 4)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-6, atol=1e-6)
    want = align_pairs(want_ids, experts, 4)
    blocks = aligned.block_expert.cpu()
    assert torch.equal(blocks, want.block_expert)
    used = int((blocks < experts).sum()) * 4  # rows past the used blocks are unset
    assert torch.equal(aligned.sorted_pairs.cpu()[:used], want.sorted_pairs[:used])


def _experts_loop(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """worker.layers.moe's CPU path (the per-expert loop), as a function."""
    from worker.layers.moe import SparseMoE

    moe = SparseMoE.__new__(SparseMoE)
    torch.nn.Module.__init__(moe)
    moe.experts = torch.nn.Module()
    moe.experts.gate_up_proj = gate_up  # type: ignore[assignment]
    moe.experts.down_proj = down  # type: ignore[assignment]
    moe.experts.num_experts = gate_up.shape[0]  # type: ignore[assignment]
    moe.experts.inner = down.shape[2]  # type: ignore[assignment]
    moe.act = F.silu
    moe.act_name = "silu"  # CPU tensors: the loop (use_triton is off)
    return moe._experts(x, weights, ids)


@pytest.mark.parametrize(
    "tokens,hidden,inner,path",
    [(1, 64, 24, "grouped"), (5, 64, 32, "grouped"), (70, 48, 24, "grouped"),
     (3, 32, 16, "grouped"), (1, 64, 24, "gemv"), (1, 48, 24, "gemv_split"),
     (3, 64, 40, "gemv_split")],
)  # fmt: skip
def test_fused_moe_matches_expert_loop(
    triton_ready: None, tokens: int, hidden: int, inner: int, path: str
) -> None:
    """The grouped GEMMs and the per-pair GEMVs (``moe_gemv.moe_float_gemv``; gemv_split:
    narrow tiles, K split over programs, outputs past N masked) against the CPU loop."""
    from worker.device.kernels.moe import fused_moe_triton
    from worker.device.kernels.moe_gemv import FloatTiles, float_split_for, moe_float_gemv

    if path != "grouped":
        tiles = FloatTiles(16, 16, 2, 400) if path == "gemv_split" else FloatTiles()
        assert (float_split_for(2 * tokens, hidden, inner, tiles)[0] > 1) == (path != "gemv")

        def fused_moe_triton(*args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
            return moe_float_gemv(*args, **kwargs, t=tiles)  # type: ignore[arg-type]

    gen = torch.Generator().manual_seed(tokens * 1000 + hidden)
    experts, top_k = 8, 2
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inner, generator=gen) * inner**-0.5
    ids = _routing(tokens, experts, top_k, gen)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    want = _experts_loop(x, gate_up, down, weights, ids)
    args = [t.to(DEVICE) for t in (x, gate_up, down, weights, ids)]
    got = fused_moe_triton(*args).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the shared expert and the decoder layer's residual, summed in the same launch
    shared, residual = torch.randn(2, tokens, hidden, generator=gen)
    wide_gate = torch.randn(tokens, 3, generator=gen)  # a strided column, as in_proj's
    extra = {"shared": shared, "shared_gate": wide_gate[:, 1:2], "residual": residual}
    got = fused_moe_triton(*args, **{k: v.to(DEVICE) for k, v in extra.items()}).cpu()
    want = residual + (want + torch.sigmoid(wide_gate[:, 1:2]) * shared)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _decode_inputs(
    gen: torch.Generator, batch: int, slots_total: int
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    hk, hv, dk, dv, kernel = 2, 4, 8, 12, 4
    conv_dim = 2 * hk * dk + hv * dv
    tensors = {
        "x": torch.randn(batch, conv_dim + 5, generator=gen)[:, :conv_dim],  # strided rows
        "conv_state": torch.randn(slots_total, conv_dim, kernel - 1, generator=gen),
        "weight": torch.randn(conv_dim, kernel, generator=gen),
        "a": torch.randn(batch, hv, generator=gen) * 3,
        "b": torch.randn(batch, hv, generator=gen),
        "a_log": torch.randn(hv, generator=gen),
        "dt_bias": torch.randn(hv, generator=gen),
        "state": torch.randn(slots_total, hv, dk, dv, generator=gen),
    }
    return tensors, {"hk": hk, "hv": hv, "dk": dk, "dv": dv}


def test_deltanet_decode_step_matches_torch_step(triton_ready: None) -> None:
    from worker.device.kernels.deltanet_decode import conv_step_triton, gated_delta_step_triton

    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([2, -1, 0, -1])  # rows 1 and 3: padding
    t, dims = _decode_inputs(gen, len(slots), slots_total=4)
    live = slots >= 0
    live_slots = slots[live]
    hk, hv, dk, dv = dims["hk"], dims["hv"], dims["dk"], dims["dv"]

    # the torch step over the live rows
    conv_out, conv_state = causal_conv1d_step(
        t["x"][live], t["conv_state"][live_slots], t["weight"]
    )
    q, k, v = torch.split(conv_out, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2_normalize(q.reshape(-1, hk, dk)).repeat_interleave(hv // hk, dim=1) * dk**-0.5
    k = l2_normalize(k.reshape(-1, hk, dk)).repeat_interleave(hv // hk, dim=1)
    g = -t["a_log"].exp() * F.softplus(t["a"][live] + t["dt_bias"])
    beta = t["b"][live].sigmoid()
    want_out, want_state = recurrent_gated_delta_rule(
        q, k, v.reshape(-1, hv, dv), g, beta, t["state"][live_slots]
    )

    dev = {name: tensor.to(DEVICE) for name, tensor in t.items()}
    dev_slots = slots.to(DEVICE)
    conv_before, state_before = t["conv_state"].clone(), t["state"].clone()
    got_conv = conv_step_triton(dev["x"], dev["conv_state"], dev["weight"], dev_slots)
    got_out = gated_delta_step_triton(
        got_conv, dev["a"], dev["b"], dev["a_log"], dev["dt_bias"], dev["state"], dev_slots,
        num_key_heads=hk, key_dim=dk,
    )  # fmt: skip
    torch.testing.assert_close(got_conv.cpu()[live], conv_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_out.cpu()[live], want_out, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got_out).all()  # padding rows too
    new_conv, new_state = dev["conv_state"].cpu(), dev["state"].cpu()
    torch.testing.assert_close(new_conv[live_slots], conv_state, rtol=0, atol=0)
    torch.testing.assert_close(new_state[live_slots], want_state, rtol=1e-5, atol=1e-5)
    untouched = [1, 3]  # no live row's slot: padding rows wrote nothing
    assert torch.equal(new_conv[untouched], conv_before[untouched])
    assert torch.equal(new_state[untouched], state_before[untouched])


def test_deltanet_step_tiles_agree(triton_ready: None) -> None:
    """The decode step's wide tiles (batches of WIDE_STEP_ROWS rows and more: 64 value dims,
    4 warps) and narrow ones (16, 2) give the same outputs and states; ``step_tiles`` picks
    them by batch (pure)."""
    from worker.device.kernels.deltanet_decode import (
        WIDE_STEP_ROWS,
        gated_delta_step_triton,
        step_tiles,
    )

    assert step_tiles(1) == (16, 2) and step_tiles(WIDE_STEP_ROWS) == (64, 4)
    gen = torch.Generator().manual_seed(5)
    batch, hk, hv, dk, dv = 3, 1, 2, 16, 64
    conv_out = torch.randn(batch, 2 * hk * dk + hv * dv, generator=gen).to(DEVICE)
    a, b = (torch.randn(batch, hv, generator=gen).to(DEVICE) for _ in range(2))
    a_log, dt_bias = (torch.randn(hv, generator=gen).to(DEVICE) for _ in range(2))
    state = torch.randn(4, hv, dk, dv, generator=gen).to(DEVICE)
    slots = torch.tensor([3, -1, 1]).to(DEVICE)
    results = []
    for block_v, warps in ((16, 2), (64, 4)):
        s = state.clone()
        o = gated_delta_step_triton(conv_out, a, b, a_log, dt_bias, s, slots, num_key_heads=hk,
                                    key_dim=dk, block_v=block_v, num_warps=warps)  # fmt: skip
        results.append((o.cpu()[[0, 2]], s.cpu()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deltanet_step_with_norm_equals_step_then_norm(
    triton_ready: None, dtype: torch.dtype
) -> None:
    """The delta step and the layer's gated norm in one launch = the two kernels (padding rows
    store no state), value dims in several tiles."""
    from worker.device.kernels.deltanet_decode import (
        gated_delta_norm_step_triton,
        gated_delta_step_triton,
        gated_rms_norm_triton,
    )

    gen = torch.Generator().manual_seed(4)
    slots = torch.tensor([2, -1, 0])
    t, dims = _decode_inputs(gen, len(slots), slots_total=4)
    hk, hv, dk, dv = dims["hk"], dims["hv"], dims["dk"], dims["dv"]
    wide_z = torch.randn(len(slots), hv * dv + 7, generator=gen)
    weight = torch.randn(dv, generator=gen)
    dev = {name: tensor.to(DEVICE) for name, tensor in t.items()}
    conv_out = dev["x"].to(dtype)
    z = wide_z.to(DEVICE, dtype)[:, 3 : 3 + hv * dv].view(len(slots), hv, dv)  # strided rows
    w = weight.to(DEVICE, dtype)
    args = (dev["a"], dev["b"], dev["a_log"], dev["dt_bias"])
    state_two, state_one = dev["state"].clone(), dev["state"].clone()
    o = gated_delta_step_triton(conv_out, *args, state_two, slots.to(DEVICE),
                                num_key_heads=hk, key_dim=dk)  # fmt: skip
    want = gated_rms_norm_triton(o, z, w, 1e-6, dtype)
    got = gated_delta_norm_step_triton(conv_out, *args, state_one, slots.to(DEVICE), z, w, 1e-6,
                                       num_key_heads=hk, key_dim=dk, block_v=4)  # fmt: skip
    live = slots >= 0
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu()[live].float(), want.cpu()[live].float(), **tol)
    assert torch.equal(state_one.cpu(), state_two.cpu())  # the same updates, nothing for padding


@pytest.mark.parametrize(
    "cached,n,split,rows",
    [(5, 7, 6, 12), (0, 10, 3, 12), (2, 1, 0, 12), (4, 0, 0, 12), (3, 37, 16, 40), (0, 48, 33, 64)],
)
@pytest.mark.parametrize("form", ["chunk", "rows"])
def test_deltanet_seq_kernels_equal_torch_prefill(
    triton_ready: None, cached: int, n: int, split: int, rows: int, form: str
) -> None:
    """The short prefill of one sequence (conv + recurrence over its rows, in place, with a
    snapshot inside the chunk, padding rows after n) = the torch path's conv and per-token
    recurrence; n == 0 changes nothing."""
    from worker.device.kernels.deltanet_decode import conv_seq_triton, gated_delta_seq_triton
    from worker.layers.deltanet import causal_conv1d

    gen = torch.Generator().manual_seed(10 + n)
    slot, entry = 2, 1
    t, dims = _decode_inputs(gen, rows, slots_total=4)
    hk, hv, dk, dv = dims["hk"], dims["hv"], dims["dk"], dims["dv"]
    snap_conv = torch.randn(4, 3, *t["conv_state"].shape[1:], generator=gen)
    snap_state = torch.randn(4, 3, hv, dk, dv, generator=gen)
    # the torch path over rows 0 .. n - 1 from the slot's state (zeros when nothing is cached)
    conv0 = t["conv_state"][slot] if cached else None
    state0 = t["state"][slot] if cached else torch.zeros(hv, dk, dv)
    want_conv, want_conv_state = causal_conv1d(t["x"][: max(n, 1)], conv0, t["weight"])
    q, k, v = torch.split(want_conv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2_normalize(q.reshape(-1, hk, dk)).repeat_interleave(hv // hk, dim=1) * dk**-0.5
    k = l2_normalize(k.reshape(-1, hk, dk)).repeat_interleave(hv // hk, dim=1)
    g = -t["a_log"].exp() * F.softplus(t["a"][:n] + t["dt_bias"])
    beta = t["b"][:n].sigmoid()
    state, outs, snap_at_split = state0[None], [], None
    for i in range(n):
        o, state = recurrent_gated_delta_rule(q[i : i + 1], k[i : i + 1],
                                              v[i : i + 1].reshape(1, hv, dv), g[i : i + 1],
                                              beta[i : i + 1], state)  # fmt: skip
        outs.append(o[0])
        if i + 1 == split:
            snap_at_split = state[0].clone()
    dev = {name: tensor.to(DEVICE) for name, tensor in t.items()}
    dev_snap_conv, dev_snap_state = snap_conv.to(DEVICE), snap_state.to(DEVICE)
    meta = torch.tensor([slot, cached, n, split, entry], device=DEVICE)
    got_conv = conv_seq_triton(dev["x"], dev["conv_state"], dev_snap_conv, dev["weight"], meta)
    got = gated_delta_seq_triton(got_conv, dev["a"], dev["b"], dev["a_log"], dev["dt_bias"],
                                 dev["state"], dev_snap_state, meta, num_key_heads=hk,
                                 key_dim=dk, form=form)  # fmt: skip
    got_conv, got = got_conv.cpu(), got.cpu()
    assert not got_conv[n:].any() and not got[n:].any()  # padding rows
    others = [s for s in range(4) if s != slot]
    assert torch.equal(dev["conv_state"].cpu()[others], t["conv_state"][others])
    if n == 0:
        assert torch.equal(dev["conv_state"].cpu(), t["conv_state"])
        assert torch.equal(dev["state"].cpu(), t["state"])
        return
    torch.testing.assert_close(got_conv[:n], want_conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:n], torch.stack(outs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev["conv_state"].cpu()[slot], want_conv_state, rtol=0, atol=0)
    torch.testing.assert_close(dev["state"].cpu()[slot], state[0], rtol=1e-5, atol=1e-5)
    if 0 < split < n:
        _, conv_at_split = causal_conv1d(t["x"][:split], conv0, t["weight"])
        assert torch.equal(dev_snap_conv.cpu()[slot, entry], conv_at_split)
        torch.testing.assert_close(dev_snap_state.cpu()[slot, entry], snap_at_split,
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
    else:
        assert torch.equal(dev_snap_state.cpu(), snap_state)
