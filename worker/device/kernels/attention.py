"""Decode attention entry points the models call: Triton on CUDA, torch elsewhere.

The model's decode path (one new token per sequence, tensors only, so it can be captured
in a CUDA graph) does, per attention layer:

    store_kv(k_cache, v_cache, k, v, slots, positions)       # k, v: [B, Hkv, D]
    out = decode_attention(q, k_cache, v_cache, slots, positions + 1,
                           sm_scale=scale, window=W)          # q: [B, Hq, D] -> [B, Hq, D]

with `k_cache` / `v_cache` the layer's pool viewed as [slots, kv_heads, capacity, head_dim]
(see `reference.py` for the entry rule `position % capacity` and for padding rows).
"""

from __future__ import annotations

import os

import torch

from worker.device.kernels import triton_available
from worker.device.kernels.reference import (
    decode_attention_reference,
    prefill_attention_slot_reference,
    store_kv_reference,
)


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels serve CUDA tensors when Triton imports (TOKENPIPE_NO_TRITON=1 opts out;
    TOKENPIPE_TRITON_CPU=1, with TRITON_INTERPRET=1, sends CPU tensors through Triton's
    interpreter too: the tests of the fused paths)."""
    on_device = t.is_cuda or os.environ.get("TOKENPIPE_TRITON_CPU") == "1"
    return on_device and triton_available() and os.environ.get("TOKENPIPE_NO_TRITON") != "1"


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    *,
    sm_scale: float,
    window: int = 0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] over the pool [S, Hkv, R, D] -> [B, Hq, D]; see `reference.py`."""
    if use_triton(q):
        from worker.device.kernels.decode_attention import decode_attention_triton

        return decode_attention_triton(
            q, k_cache, v_cache, slots, lens,
            sm_scale=sm_scale, window=window, num_splits=num_splits,
        )  # fmt: skip
    return decode_attention_reference(
        q, k_cache, v_cache, slots, lens, sm_scale=sm_scale, window=window
    )


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Write k, v [B, Hkv, D] at entry `positions % R` of `slots` (negative slot: skip)."""
    if use_triton(k):
        from worker.device.kernels.decode_attention import store_kv_triton

        store_kv_triton(k_cache, v_cache, k, v, slots, positions)
        return
    store_kv_reference(k_cache, v_cache, k, v, slots, positions)


def prefill_attention_slot(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: torch.Tensor,
    *,
    sm_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One sequence's (padded) prefill over its slot, slot and lengths in `meta` on the
    device (see `worker.device.kernels.prefill_attention.prefill_attention_slot`) -> [N, Hq, D]."""
    if use_triton(q):
        from worker.device.kernels.prefill_attention import prefill_attention_slot as triton_slot

        out = torch.empty_like(q)
        return triton_slot(
            q, k_new, v_new, out, k_cache, v_cache, meta, sm_scale=sm_scale, window=window
        )
    return prefill_attention_slot_reference(
        q, k_new, v_new, k_cache, v_cache, meta, sm_scale=sm_scale, window=window
    )


# The same two functions as torch custom ops, so `torch.compile` keeps them as opaque calls
# (no graph break) when it compiles a whole decode step (worker/device/decode_graphs.py).


@torch.library.custom_op("tokenpipe::decode_attention", mutates_args=())
def decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    sm_scale: float,
    window: int,
) -> torch.Tensor:
    return decode_attention(q, k_cache, v_cache, slots, lens, sm_scale=sm_scale, window=window)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, slots, lens, sm_scale, window):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)


@torch.library.custom_op("tokenpipe::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv_op(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    store_kv(k_cache, v_cache, k, v, slots, positions)


@store_kv_op.register_fake
def _(k_cache, v_cache, k, v, slots, positions):  # type: ignore[no-untyped-def]
    return None
