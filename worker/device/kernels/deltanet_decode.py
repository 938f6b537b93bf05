"""Triton kernels of a Gated DeltaNet decode step (one new token per row), in place in the
slot pool: no gather of each row's state before the step, no scatter after it.

- `conv_step_triton(x, conv_state, weight, slots)`: the depthwise causal conv + SiLU of one
  token per row, continuing after ``conv_state[slot]`` (its last K - 1 inputs, oldest first),
  which it shifts by the new input. ``worker.layers.deltanet.causal_conv1d_step`` in one
  launch.
- `gated_delta_step_triton(conv_out, a, b, A_log, dt_bias, state, slots, ...)`: the rest of the
  step from the conv output, per (row, value head, block of value dims): q, k split out of
  ``conv_out`` and L2-normalised (key heads shared by consecutive value heads), q scaled,
  ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, then the delta-rule
  update of ``state[slot]`` and ``o = S^T q`` (``recurrent_gated_delta_rule``).

- `gated_rms_norm_triton(x, gate, weight, eps, dtype)`: the layer's output norm
  (``worker.layers.deltanet.GatedRMSNorm`` of ``x.to(dtype)``) in one launch, any step.

Rows whose slot is negative are padding (the decode graphs' unused rows): they read a zero
state, write nothing, and their outputs are finite and ignored. Slots are int64 tensors, so
both kernels run inside a captured CUDA graph.

Numerics: float32 throughout (the state is float32); the conv output is rounded to the
input's dtype as the torch path rounds it. This module imports Triton: import it only after
`worker.device.kernels.triton_available()`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(
    x_ptr, state_ptr, w_ptr, out_ptr, slots_ptr, C, stride_x, stride_out,
    KM1: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < C
    slot = tl.load(slots_ptr + row)
    live = (offs * 0 + slot) >= 0  # [BLOCK_C]: padding rows (slot < 0) store no state
    base = state_ptr + tl.maximum(slot, 0).to(tl.int64) * C * KM1 + offs.to(tl.int64) * KM1
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + offs * (KM1 + 1) + KM1, mask=mask).to(tl.float32)
    for j in tl.static_range(KM1):
        held = tl.load(base + j, mask=mask & live, other=0.0)
        acc += held.to(tl.float32) * tl.load(w_ptr + offs * (KM1 + 1) + j, mask=mask).to(tl.float32)
        if j > 0:  # the state keeps the last K - 1 inputs: shift by one
            tl.store(base + j - 1, held, mask=mask & live)
    tl.store(base + KM1 - 1, x.to(state_ptr.dtype.element_ty), mask=mask & live)
    conv = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the conv's output, rounded
    silu = conv / (1.0 + tl.exp(-conv))
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, silu.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


def conv_step_triton(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """x [B, C] (rows may be strided); conv_state [S, C, K - 1] contiguous, updated in place
    at each live row's slot; weight [C, K]; slots [B] int64 -> silu(conv) [B, C] in x's dtype."""
    batch, channels = x.shape
    kernel = weight.shape[-1]
    assert conv_state.is_contiguous() and conv_state.shape[1:] == (channels, kernel - 1)
    assert x.stride(1) == 1
    weight = weight.contiguous()
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    block = 256
    grid = (batch, triton.cdiv(channels, block))
    _conv_step_kernel[grid](
        x, conv_state, weight, out, slots, channels, x.stride(0), out.stride(0),
        KM1=kernel - 1, BLOCK_C=block, num_warps=2,
    )  # fmt: skip
    return out


@triton.jit
def _gated_delta_step_kernel(
    conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, out_ptr, slots_ptr,
    stride_conv, stride_a, stride_b, scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    hv = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    mask_v = offs_v < DV
    mask_k = offs_k < DK
    hk = hv // (HV // HK)
    slot = tl.load(slots_ptr + row)
    live = (offs_v * 0 + slot) >= 0  # [BLOCK_V]: padding rows read zeros, store no state
    line = conv_ptr + row.to(tl.int64) * stride_conv
    q = tl.load(line + hk * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(line + HK * DK + hk * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(line + 2 * HK * DK + hv * DV + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    a = tl.load(a_ptr + row.to(tl.int64) * stride_a + hv).to(tl.float32)
    a = a + tl.load(dt_bias_ptr + hv).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    g = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus
    beta = tl.load(b_ptr + row.to(tl.int64) * stride_b + hv).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-beta))
    base = state_ptr + (tl.maximum(slot, 0).to(tl.int64) * HV + hv) * DK * DV
    cells = base + offs_k[:, None] * DV + offs_v[None, :]  # [BLOCK_K, BLOCK_V]
    mask = mask_k[:, None] & (mask_v & live)[None, :]
    h = tl.load(cells, mask=mask, other=0.0) * tl.exp(g)
    update = (v - tl.sum(h * k[:, None], axis=0)) * beta  # [BLOCK_V]
    h += k[:, None] * update[None, :]
    tl.store(cells, h, mask=mask)
    o = tl.sum(h * q[:, None], axis=0)
    tl.store(out_ptr + (row.to(tl.int64) * HV + hv) * DV + offs_v, o, mask=mask_v)


def gated_delta_step_triton(
    conv_out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    num_key_heads: int,
    key_dim: int,
    block_v: int | None = None,
    num_warps: int = 2,
) -> torch.Tensor:
    """conv_out [B, 2 * Hk * Dk + Hv * Dv] (q | k | v after the conv); a, b [B, Hv] (raw
    ``in_proj_a`` / ``in_proj_b`` outputs); A_log, dt_bias [Hv]; state [S, Hv, Dk, Dv] float32,
    updated in place at each live row's slot -> o [B, Hv, Dv] float32. ``block_v`` value dims
    per program (default 16)."""
    batch = conv_out.shape[0]
    _, heads_v, dk, dv = state.shape
    assert state.is_contiguous() and state.dtype == torch.float32 and dk == key_dim
    assert conv_out.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    out = torch.empty(batch, heads_v, dv, dtype=torch.float32, device=conv_out.device)
    block_v = block_v or min(16, triton.next_power_of_2(dv))
    grid = (batch, heads_v, triton.cdiv(dv, block_v))
    _gated_delta_step_kernel[grid](
        conv_out, a, b, a_log, dt_bias, state, out, slots,
        conv_out.stride(0), a.stride(0), b.stride(0), dk**-0.5,
        HK=num_key_heads, HV=heads_v, DK=dk, DV=dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=num_warps,
    )  # fmt: skip
    return out


@triton.jit
def _gated_delta_norm_kernel(
    conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, o_ptr, slots_ptr,
    z_ptr, w_ptr, out_ptr, stride_conv, stride_a, stride_b, stride_z, scale, eps,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """``_gated_delta_step_kernel`` for a whole value head (its value dims BLOCK_V at a time)
    and then ``_gated_rms_norm_kernel`` of that head, one program per (row, value head)."""
    row = tl.program_id(0)
    hv = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < DK
    hk = hv // (HV // HK)
    slot = tl.load(slots_ptr + row)
    line = conv_ptr + row.to(tl.int64) * stride_conv
    q = tl.load(line + hk * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(line + HK * DK + hk * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    a = tl.load(a_ptr + row.to(tl.int64) * stride_a + hv).to(tl.float32)
    a = a + tl.load(dt_bias_ptr + hv).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus)
    beta = tl.load(b_ptr + row.to(tl.int64) * stride_b + hv).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-beta))
    base = state_ptr + (tl.maximum(slot, 0).to(tl.int64) * HV + hv) * DK * DV
    o_row = o_ptr + (row.to(tl.int64) * HV + hv) * DV
    out_ty = out_ptr.dtype.element_ty
    squares = tl.sum(tl.zeros([BLOCK_V], dtype=tl.float32), axis=0)
    for v0 in tl.static_range(0, DV, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < DV
        live = (offs_v * 0 + slot) >= 0  # padding rows read zeros, store no state
        v = tl.load(line + 2 * HK * DK + hv * DV + offs_v, mask=mask_v, other=0.0)
        cells = base + offs_k[:, None] * DV + offs_v[None, :]  # [BLOCK_K, BLOCK_V]
        mask = mask_k[:, None] & (mask_v & live)[None, :]
        h = tl.load(cells, mask=mask, other=0.0) * decay
        update = (v.to(tl.float32) - tl.sum(h * k[:, None], axis=0)) * beta
        h += k[:, None] * update[None, :]
        tl.store(cells, h, mask=mask)
        o = tl.sum(h * q[:, None], axis=0)
        tl.store(o_row + offs_v, o, mask=mask_v)
        rounded = o.to(out_ty).to(tl.float32)
        squares += tl.sum(tl.where(mask_v, rounded * rounded, 0.0), axis=0)
    tl.debug_barrier()  # the head's outputs, written by every thread, read back below
    root = tl.sqrt(squares / DV + eps)
    z_row = z_ptr + row.to(tl.int64) * stride_z + hv * DV
    out_row = out_ptr + (row.to(tl.int64) * HV + hv) * DV
    for v0 in tl.static_range(0, DV, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < DV
        x = tl.load(o_row + offs_v, mask=mask_v, other=0.0).to(out_ty).to(tl.float32)
        normed = (x / root).to(out_ty).to(tl.float32)
        w = tl.load(w_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        scaled = (w * normed).to(out_ty).to(tl.float32)
        gate = tl.load(z_row + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        tl.store(out_row + offs_v, (scaled * (gate / (1.0 + tl.exp(-gate)))).to(out_ty),
                 mask=mask_v)  # fmt: skip


def gated_delta_norm_step_triton(
    conv_out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_key_heads: int,
    key_dim: int,
    block_v: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """``gated_delta_step_triton`` followed by ``gated_rms_norm_triton`` (gate z [B, Hv, Dv],
    rows may be strided, heads packed; weight [Dv]) in one launch -> [B, Hv, Dv] in z's dtype,
    the same roundings."""
    batch = conv_out.shape[0]
    _, heads_v, dk, dv = state.shape
    assert state.is_contiguous() and state.dtype == torch.float32 and dk == key_dim
    assert conv_out.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert z.stride(2) == 1 and z.stride(1) == dv
    scratch = torch.empty(batch, heads_v, dv, dtype=torch.float32, device=conv_out.device)
    out = torch.empty(batch, heads_v, dv, dtype=z.dtype, device=conv_out.device)
    _gated_delta_norm_kernel[(batch, heads_v)](
        conv_out, a, b, a_log, dt_bias, state, scratch, slots, z, norm_weight, out,
        conv_out.stride(0), a.stride(0), b.stride(0), z.stride(0), dk**-0.5, float(eps),
        HK=num_key_heads, HV=heads_v, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=min(block_v, triton.next_power_of_2(dv)), num_warps=num_warps,
    )  # fmt: skip
    return out


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr, HEADS, stride_gate_row, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # (token, head)
    token, head = row // HEADS, row % HEADS
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    out_ty = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(out_ty).to(tl.float32)
    normed = x / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = normed.to(out_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scaled = (w * normed).to(out_ty).to(tl.float32)
    gate = tl.load(gate_ptr + token * stride_gate_row + head * D + offs, mask=mask, other=0.0)
    gate = gate.to(tl.float32)
    out = scaled * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + row * D + offs, out.to(out_ty), mask=mask)


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """x [T, H, D] (float32, contiguous); gate [T, H, D] (rows may be strided, heads packed);
    weight [D] -> (weight * rms_norm(x.to(dtype))) * silu(gate) [T, H, D] in dtype, rounded
    where the torch path rounds."""
    tokens, heads, dim = x.shape
    assert x.is_contiguous() and gate.stride(2) == 1 and gate.stride(1) == dim
    out = torch.empty(tokens, heads, dim, dtype=dtype, device=x.device)
    if tokens:
        _gated_rms_norm_kernel[(tokens * heads,)](
            x, gate, weight, out, heads, gate.stride(0), eps,
            D=dim, BLOCK_D=max(16, 1 << (dim - 1).bit_length()), num_warps=1,
        )  # fmt: skip
    return out
