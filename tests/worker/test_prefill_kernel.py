"""The Triton prefill attention kernel (Triton's CPU interpreter here, CUDA on the GPU box)
against plain attention over an explicit token history: full and sliding layers, a fresh
sequence and one continuing over a cached prefix or a wrapped ring, GQA, and prompt lengths
that are not multiples of the tile; and the slot variant's torch reference. The Triton tests
need the `triton_ready` fixture (tests/conftest.py: a skip without triton, a failure in CI)."""

from __future__ import annotations

import pytest
import torch

from worker.layers.attention import ring_positions

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _history_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cached: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """q [n, Hq, D] at positions cached.., over keys/values [cached + n, Hkv, D] (position =
    index) with a causal (and sliding) mask -> [n, Hq, D] float64."""
    n, q_heads, _ = q.shape
    group = q_heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), k) * scale  # [Hq, n, L]
    q_pos = torch.arange(cached, cached + n)[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnk,khd->nhd", torch.softmax(scores, dim=-1), v)


CASES = [
    # n, cached, window, ring capacity (sliding), Hq, Hkv, D
    (37, 0, 0, 0, 4, 2, 16),  # fresh, full layer, n not a multiple of the tile
    (70, 0, 9, 0, 4, 1, 16),  # fresh, sliding window inside the prompt
    (21, 30, 0, 0, 2, 2, 32),  # full layer over a cached prefix
    (19, 40, 8, 10, 4, 2, 16),  # sliding over a wrapped ring
    (5, 3, 8, 10, 4, 4, 16),  # sliding, ring not yet full
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_prefill_kernel_matches_history(case: tuple[int, ...], triton_ready: None) -> None:
    from worker.device.kernels.prefill_attention import prefill_attention_triton

    n, cached, window, ring, q_heads, kv_heads, dim = case
    gen = torch.Generator().manual_seed(sum(case))
    total = cached + n
    keys = torch.randn(total, kv_heads, dim, generator=gen)
    values = torch.randn(total, kv_heads, dim, generator=gen)
    q = torch.randn(n, q_heads, dim, generator=gen)
    scale = dim**-0.5
    k_prev = v_prev = prev_pos = None
    if cached and ring:  # the ring as it was: position p at entry p % ring, older ones gone
        pos = ring_positions(cached, ring, torch.device("cpu"))
        k_prev = torch.randn(kv_heads, ring, dim, generator=gen)  # garbage where empty
        v_prev = torch.randn(kv_heads, ring, dim, generator=gen)
        held = pos >= 0
        k_prev[:, held] = keys[pos[held]].transpose(0, 1)
        v_prev[:, held] = values[pos[held]].transpose(0, 1)
        prev_pos = pos.to(torch.int32)
    elif cached:  # a full layer's cached prefix, inside a larger slot (a strided view)
        k_slot = torch.randn(kv_heads, cached + 50, dim, generator=gen)
        v_slot = torch.randn(kv_heads, cached + 50, dim, generator=gen)
        k_slot[:, :cached] = keys[:cached].transpose(0, 1)
        v_slot[:, :cached] = values[:cached].transpose(0, 1)
        k_prev, v_prev = k_slot[:, :cached], v_slot[:, :cached]
    expected = _history_attention(q, keys, values, cached, window, scale)
    q, keys, values, k_prev, v_prev, prev_pos = (
        None if t is None else t.to(DEVICE) for t in (q, keys, values, k_prev, v_prev, prev_pos)
    )
    out = torch.full_like(q, float("nan"))
    prefill_attention_triton(
        q, keys[cached:], values[cached:], out, cached=cached, sm_scale=scale, window=window,
        k_prev=k_prev, v_prev=v_prev, prev_pos=prev_pos, config=(16, 16, 4, 1),
    )  # fmt: skip
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-4, atol=1e-4)


SLOT_CASES = [
    # n, padding rows, cached, window, pool entries (ring size when window > 0), Hq, Hkv, D
    (7, 9, 0, 0, 40, 4, 2, 16),  # fresh, full layer
    (21, 11, 30, 0, 64, 2, 2, 32),  # full layer over a cached prefix
    (19, 13, 40, 8, 10, 4, 2, 16),  # sliding over a wrapped ring
    (5, 3, 3, 8, 10, 4, 4, 16),  # sliding, ring not yet full
    (12, 4, 9, 8, 10, 4, 1, 16),  # sliding, ring wraps within the new tokens
]


@pytest.mark.parametrize("case", SLOT_CASES, ids=[str(c) for c in SLOT_CASES])
@pytest.mark.parametrize("impl", ["triton", "triton-3-splits", "reference"])
def test_slot_variant_matches_history(
    case: tuple[int, ...], impl: str, request: pytest.FixtureRequest
) -> None:
    """The capturable variant (slot and lengths from a device tensor, rows padded, the pool
    read in place): real rows equal attention over the explicit history."""
    from worker.device.kernels.reference import prefill_attention_slot_reference

    if impl.startswith("triton"):
        request.getfixturevalue("triton_ready")

    n, pad, cached, window, entries, q_heads, kv_heads, dim = case
    gen = torch.Generator().manual_seed(sum(case))
    keys = torch.randn(cached + n, kv_heads, dim, generator=gen)
    values = torch.randn(cached + n, kv_heads, dim, generator=gen)
    q = torch.randn(n + pad, q_heads, dim, generator=gen)  # padding rows: garbage
    k_new = torch.cat([keys[cached:], torch.randn(pad, kv_heads, dim, generator=gen)])
    v_new = torch.cat([values[cached:], torch.randn(pad, kv_heads, dim, generator=gen)])
    k_pool = torch.randn(3, kv_heads, entries, dim, generator=gen)  # garbage where unused
    v_pool = torch.randn(3, kv_heads, entries, dim, generator=gen)
    slot = 1
    for p in range(max(0, cached - entries), cached):  # what the slot holds before the step
        k_pool[slot, :, p % entries] = keys[p]
        v_pool[slot, :, p % entries] = values[p]
    expected = _history_attention(q[:n], keys, values, cached, window, dim**-0.5)
    meta = torch.tensor([slot, cached, n], dtype=torch.int64, device=DEVICE)
    q, k_new, v_new, k_pool, v_pool = (t.to(DEVICE) for t in (q, k_new, v_new, k_pool, v_pool))
    if impl.startswith("triton"):
        from worker.device.kernels.prefill_attention import prefill_attention_slot

        # 3 splits: some take nothing (short prefixes), or only keys out of the window
        out = torch.full_like(q, float("nan"))
        prefill_attention_slot(
            q, k_new, v_new, out, k_pool, v_pool, meta, sm_scale=dim**-0.5, window=window,
            config=(16, 16, 4, 1), splits=3 if impl.endswith("splits") else 1,
        )  # fmt: skip
    else:
        out = prefill_attention_slot_reference(
            q, k_new, v_new, k_pool, v_pool, meta, sm_scale=dim**-0.5, window=window
        )
    torch.testing.assert_close(out[:n].double().cpu(), expected, rtol=1e-4, atol=1e-4)
    assert out[n:].isfinite().all()  # padding rows: ignored, but never NaN


def test_prefill_kernel_reads_strided_rows_of_a_step(triton_ready: None) -> None:
    """q, k, v as slices of a flattened step [T, H, D] (another sequence before this one)."""
    from worker.device.kernels.prefill_attention import prefill_attention_triton

    gen = torch.Generator().manual_seed(7)
    q_all = torch.randn(30, 4, 16, generator=gen)
    k_all = torch.randn(30, 2, 16, generator=gen)
    v_all = torch.randn(30, 2, 16, generator=gen)
    expected = _history_attention(q_all[10:], k_all[10:], v_all[10:], 0, 0, 0.25)
    q_all, k_all, v_all = q_all.to(DEVICE), k_all.to(DEVICE), v_all.to(DEVICE)
    out_all = torch.zeros_like(q_all)
    prefill_attention_triton(
        q_all[10:], k_all[10:], v_all[10:], out_all[10:], cached=0, sm_scale=0.25,
        config=(16, 16, 4, 1),
    )  # fmt: skip
    torch.testing.assert_close(out_all[10:].double().cpu(), expected, rtol=1e-4, atol=1e-4)
    assert out_all[:10].eq(0).all()


@pytest.mark.parametrize("dim,window", [(256, 1024), (512, 0)])
def test_prefill_kernel_bf16_31b_shapes_match_sdpa(
    dim: int, window: int, triton_ready: None
) -> None:
    """The 31B layer heads in bf16 with the default tiles: close to torch's SDPA. On CUDA a
    1,500-token prompt with the 31B head counts; in the interpreter 300 tokens (query tiles
    of 128 or 64 rows, the last one partial), fewer heads and a window inside the prompt."""
    from worker.device.kernels.prefill_attention import prefill_attention_triton
    from worker.layers.attention import _sdpa

    if DEVICE.type == "cuda":
        n, hq, hkv = 1500, 32, 16 if dim == 256 else 4
    else:
        n, hq, hkv = 300, 4, 2 if dim == 256 else 1
        window = min(window, 100)
    gen = torch.Generator(device=DEVICE).manual_seed(dim)
    q, k, v = (
        torch.randn(n, h, dim, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        for h in (hq, hkv, hkv)
    )
    pos = torch.arange(n, device=DEVICE)
    mask = None
    if window:
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    ref = _sdpa(*(t.transpose(0, 1)[None] for t in (q, k, v)), mask, mask is None, dim**-0.5)
    out = torch.empty_like(q)
    prefill_attention_triton(q, k, v, out, cached=0, sm_scale=dim**-0.5, window=window)
    torch.testing.assert_close(out.float(), ref[0].transpose(0, 1).float(), rtol=2e-2, atol=2e-2)


def test_fit_config_shrinks_tiles_for_fp32_only(triton_ready: None) -> None:
    from worker.device.kernels.prefill_attention import CONFIGS, fit_config

    assert fit_config(CONFIGS[256], 256, 2) == CONFIGS[256]  # bf16: as tuned
    block_m, block_n, _, stages = fit_config(CONFIGS[256], 256, 4)
    assert (block_m + 2 * block_n * stages) * 256 * 4 <= 200 << 10
    assert fit_config((64, 64, 8, 2), 512, 4)[1] >= 16
