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


WIDE_STEP_ROWS = 16
"""Decode batches of at least this many rows take the wide step tiles (``step_tiles``)."""


def step_tiles(batch: int) -> tuple[int, int]:
    """(value dims per program, warps) of the decode step at ``batch`` rows (pure). H200,
    35B-A3B shape (Hv 32, Dk = Dv 128), one layer: 32 rows 39.5 us at (64, 4) against 70.0 at
    (16, 2) (3.40 against 1.92 TB/s of state read and written); one row 3.3 us at (16, 2)."""
    return (64, 4) if batch >= WIDE_STEP_ROWS else (16, 2)


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
    num_warps: int | None = None,
) -> torch.Tensor:
    """conv_out [B, 2 * Hk * Dk + Hv * Dv] (q | k | v after the conv); a, b [B, Hv] (raw
    ``in_proj_a`` / ``in_proj_b`` outputs); A_log, dt_bias [Hv]; state [S, Hv, Dk, Dv] float32,
    updated in place at each live row's slot -> o [B, Hv, Dv] float32. ``block_v`` value dims
    per program and ``num_warps`` (default ``step_tiles``)."""
    batch = conv_out.shape[0]
    _, heads_v, dk, dv = state.shape
    assert state.is_contiguous() and state.dtype == torch.float32 and dk == key_dim
    assert conv_out.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    out = torch.empty(batch, heads_v, dv, dtype=torch.float32, device=conv_out.device)
    default_v, default_warps = step_tiles(batch)
    block_v = min(block_v or default_v, triton.next_power_of_2(dv))
    num_warps = num_warps or default_warps
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
    form: str = "",
    precision: str = "tf32",
    block_v: int = 0,
    num_warps: int = 0,
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


# -- a short prefill of one sequence, in place and capturable (the prefill graphs) -----------
#
# meta: int64 [5] on the device: (slot, cached, n, split, entry). Rows 0 .. n - 1 of the step
# continue the slot's state (zeros when cached == 0); rows n .. N - 1 are padding (zero
# outputs, nothing stored; n == 0 stores nothing at all). When 0 < split < n the state after
# `split` rows also goes to snapshot `entry` of the slot (a snapshot inside the chunk).


@triton.jit
def _conv_seq_kernel(
    x_ptr, state_ptr, snap_ptr, w_ptr, out_ptr, meta_ptr, C, N, stride_x, stride_out,
    stride_snap_slot, stride_snap_entry,
    KM1: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program (channel block, row block): the conv + SiLU of its rows; the row block 0
    program also writes the new conv state (and the snapshot's) after reading the old one."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    block_t = tl.program_id(1)
    rows = block_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_c = offs_c < C
    slot = tl.load(meta_ptr).to(tl.int64)
    cached = tl.load(meta_ptr + 1)
    n = tl.load(meta_ptr + 2)
    split = tl.load(meta_ptr + 3)
    entry = tl.load(meta_ptr + 4).to(tl.int64)
    held = (offs_c * 0 + cached) > 0  # [BLOCK_C] (vector conditions: the interpreter's too)
    base = state_ptr + slot * C * KM1 + offs_c.to(tl.int64) * KM1  # [BLOCK_C]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KM1 + 1):
        src = rows - KM1 + j  # the input row this tap reads; < 0: the held history
        from_x = (src >= 0) & (rows < n)
        from_state = (src < 0) & (rows < n)
        xs = tl.load(
            x_ptr + tl.maximum(src, 0)[:, None].to(tl.int64) * stride_x + offs_c[None, :],
            mask=from_x[:, None] & mask_c[None, :],
            other=0.0,
        )
        hs = tl.load(base[None, :] + (KM1 + tl.minimum(src, -1))[:, None],
                     mask=from_state[:, None] & (mask_c & held)[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + offs_c * (KM1 + 1) + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += (xs.to(tl.float32) + hs.to(tl.float32)) * w[None, :]
    conv = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the conv's output, rounded
    silu = tl.where((rows < n)[:, None], conv / (1.0 + tl.exp(-conv)), 0.0)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_out + offs_c[None, :],
        silu.to(out_ptr.dtype.element_ty),
        mask=(rows < N)[:, None] & mask_c[None, :],
    )
    if block_t == 0:
        tl.debug_barrier()  # every thread has read the old history
        snap = snap_ptr + slot * stride_snap_slot + entry * stride_snap_entry
        snap = snap + offs_c.to(tl.int64) * KM1
        take_snap = (offs_c * 0 + split > 0) & (offs_c * 0 + split < n)  # [BLOCK_C]
        for i in tl.static_range(KM1):  # the snapshot first: it reads the old history too
            value = _held_input(x_ptr, base, offs_c, mask_c, held, split - KM1 + i, stride_x, KM1)
            tl.store(snap + i, value.to(snap_ptr.dtype.element_ty), mask=mask_c & take_snap)
        for i in tl.static_range(KM1):  # entry i is read (at n + i > i) before it is written
            value = _held_input(x_ptr, base, offs_c, mask_c, held, n - KM1 + i, stride_x, KM1)
            tl.store(
                base + i, value.to(state_ptr.dtype.element_ty), mask=mask_c & (offs_c * 0 + n > 0)
            )


@triton.jit
def _held_input(x_ptr, base, offs_c, mask_c, held, src, stride_x, KM1: tl.constexpr):
    """Input row `src` of the sequence ([BLOCK_C] float32): a row of x, or (src < 0) an entry
    of the held history (zeros when nothing is held)."""
    src = offs_c * 0 + src  # [BLOCK_C]
    xv = tl.load(x_ptr + tl.maximum(src, 0).to(tl.int64) * stride_x + offs_c,
                 mask=mask_c & (src >= 0), other=0.0)  # fmt: skip
    hv = tl.load(base + KM1 + tl.minimum(src, -1), mask=mask_c & (src < 0) & held, other=0.0)
    return tl.where(src >= 0, xv.to(tl.float32), hv.to(tl.float32))


def conv_seq_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    snap_conv: torch.Tensor,
    weight: torch.Tensor,
    meta: torch.Tensor,
) -> torch.Tensor:
    """The causal conv + SiLU of one sequence's rows (see above for ``meta``): x [N, C] (rows
    may be strided); conv_state [S, C, K - 1] and snap_conv [S, snapshots, C, K - 1], updated
    in place; weight [C, K] -> [N, C] in x's dtype (padding rows zero).
    ``worker.layers.deltanet.causal_conv1d`` of rows 0 .. n - 1, capturable."""
    rows, channels = x.shape
    kernel = weight.shape[-1]
    assert conv_state.is_contiguous() and conv_state.shape[1:] == (channels, kernel - 1)
    assert snap_conv.stride(-1) == 1 and snap_conv.stride(-2) == kernel - 1
    assert x.stride(1) == 1
    weight = weight.contiguous()
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    block_t, block_c = 16, 128
    _conv_seq_kernel[(triton.cdiv(channels, block_c), triton.cdiv(rows, block_t))](
        x, conv_state, snap_conv, weight, out, meta, channels, rows, x.stride(0), out.stride(0),
        snap_conv.stride(0), snap_conv.stride(1),
        KM1=kernel - 1, BLOCK_T=max(block_t, triton.next_power_of_2(kernel)), BLOCK_C=block_c,
        num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _delta_rows_kernel(
    conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, snap_ptr, out_ptr, meta_ptr,
    N, stride_conv, stride_a, stride_b, stride_snap_slot, stride_snap_entry, scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Program (value head, block of value dims): the recurrence over the sequence's rows,
    its state tile held in registers from the slot's state to the end (and to the snapshot
    at `split`)."""
    hv = tl.program_id(0)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    mask_v = offs_v < DV
    mask_k = offs_k < DK
    mask = mask_k[:, None] & mask_v[None, :]
    hk = hv // (HV // HK)
    slot = tl.load(meta_ptr).to(tl.int64)
    cached = tl.load(meta_ptr + 1)
    n = tl.load(meta_ptr + 2)
    split = tl.load(meta_ptr + 3)
    entry = tl.load(meta_ptr + 4).to(tl.int64)
    cells = (slot * HV + hv) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    zero = offs_v[None, :] * 0  # [1, BLOCK_V]: scalar conditions as tensors (the interpreter)
    h = tl.load(state_ptr + cells, mask=mask & (zero + cached > 0), other=0.0)
    snap_cells = (slot * stride_snap_slot + entry * stride_snap_entry + hv * DK * DV
                  + offs_k[:, None] * DV + offs_v[None, :])  # fmt: skip
    a_log = tl.load(a_log_ptr + hv).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    line = conv_ptr  # row 0 (N >= 1 rows are there; read even when n == 0)
    q_next = tl.load(line + hk * DK + offs_k, mask=mask_k, other=0.0)
    k_next = tl.load(line + HK * DK + hk * DK + offs_k, mask=mask_k, other=0.0)
    v_next = tl.load(line + 2 * HK * DK + hv * DV + offs_v, mask=mask_v, other=0.0)
    a_next = tl.load(a_ptr + hv)
    b_next = tl.load(b_ptr + hv)
    for t in range(0, n):
        q = q_next.to(tl.float32)
        k = k_next.to(tl.float32)
        v = v_next
        a = a_next.to(tl.float32) + dt_bias
        beta = b_next.to(tl.float32)
        after = tl.minimum(t + 1, N - 1)  # the next row's loads go out before this row's math
        line = conv_ptr + after * stride_conv
        q_next = tl.load(line + hk * DK + offs_k, mask=mask_k, other=0.0)
        k_next = tl.load(line + HK * DK + hk * DK + offs_k, mask=mask_k, other=0.0)
        v_next = tl.load(line + 2 * HK * DK + hv * DV + offs_v, mask=mask_v, other=0.0)
        a_next = tl.load(a_ptr + after * stride_a + hv)
        b_next = tl.load(b_ptr + after * stride_b + hv)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        g = -tl.exp(a_log) * softplus
        beta = 1.0 / (1.0 + tl.exp(-beta))
        h = h * tl.exp(g)
        update = (v.to(tl.float32) - tl.sum(h * k[:, None], axis=0)) * beta
        h += k[:, None] * update[None, :]
        o = tl.sum(h * q[:, None], axis=0)
        tl.store(out_ptr + (t * HV + hv) * DV + offs_v, o, mask=mask_v)
        at_split = (zero + t + 1 == split) & (zero + split < n)
        tl.store(snap_ptr + snap_cells, h, mask=mask & at_split)
    tl.store(state_ptr + cells, h, mask=mask & (zero + n > 0))
    for t in range(n, N):  # padding rows: zeros
        tl.store(out_ptr + (t * HV + hv) * DV + offs_v,
                 tl.zeros([BLOCK_V], dtype=tl.float32), mask=mask_v)  # fmt: skip


@triton.jit
def _delta_chunk_kernel(
    conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, snap_ptr, out_ptr, meta_ptr,
    N, stride_conv, stride_a, stride_b, stride_snap_slot, stride_snap_entry, scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (value head, block of value dims): the sequence's rows CHUNK at a time in the
    chunked (WY) form, its state tile [DK, BLOCK_V] held in registers from the slot's state to
    the end (and to the snapshot at `split`). Within a chunk, with G the cumulative log decay,
    A[i, j] = beta_i exp(G_i - G_j) k_i.k_j (j < i) and S the state before the chunk:
    U = (I + A)^-1 beta (V - exp(G) K S), O = exp(G) Q S + (exp(G_i - G_j) q_i.k_j, j <= i) U,
    S' = exp(G_last) S + K^T (exp(G_last - G) U). A is strictly lower triangular, so
    (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8) exactly for CHUNK 16: six small products
    instead of a row-by-row solve. Rows past n get g = 0 and beta = 0 (they change nothing)."""
    hv = tl.program_id(0)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    mask_v = offs_v < DV
    mask_k = offs_k < DK
    mask = mask_k[:, None] & mask_v[None, :]
    hk = hv // (HV // HK)
    slot = tl.load(meta_ptr).to(tl.int64)
    cached = tl.load(meta_ptr + 1)
    n = tl.load(meta_ptr + 2)
    split = tl.load(meta_ptr + 3)
    entry = tl.load(meta_ptr + 4).to(tl.int64)
    cells = (slot * HV + hv) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    zero = offs_v[None, :] * 0  # [1, BLOCK_V]: scalar conditions as tensors (the interpreter)
    h = tl.load(state_ptr + cells, mask=mask & (zero + cached > 0), other=0.0)
    snap_cells = (slot * stride_snap_slot + entry * stride_snap_entry + hv * DK * DV
                  + offs_k[:, None] * DV + offs_v[None, :])  # fmt: skip
    a_log = tl.load(a_log_ptr + hv).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    step = tl.arange(0, CHUNK)
    ii = step[:, None]
    jj = step[None, :]
    eye = tl.where(ii == jj, 1.0, 0.0)
    for t0 in range(0, n, CHUNK):
        rows = t0 + step
        live = rows < n
        line = conv_ptr + rows[:, None].to(tl.int64) * stride_conv
        kmask = live[:, None] & mask_k[None, :]
        q = tl.load(line + hk * DK + offs_k[None, :], mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(line + HK * DK + hk * DK + offs_k[None, :], mask=kmask, other=0.0)
        k = k.to(tl.float32)
        v = tl.load(line + 2 * HK * DK + hv * DV + offs_v[None, :],
                    mask=live[:, None] & mask_v[None, :], other=0.0).to(tl.float32)  # fmt: skip
        q = q / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        a = tl.load(a_ptr + rows * stride_a + hv, mask=live, other=0.0).to(tl.float32) + dt_bias
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        g = tl.where(live, -tl.exp(a_log) * softplus, 0.0)
        beta = tl.load(b_ptr + rows * stride_b + hv, mask=live, other=0.0).to(tl.float32)
        beta = tl.where(live, 1.0 / (1.0 + tl.exp(-beta)), 0.0)
        big_g = tl.cumsum(g, axis=0)  # [CHUNK] log decay from the chunk's start
        decay = tl.exp(tl.where(ii >= jj, big_g[:, None] - big_g[None, :], 0.0))
        kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        lower = tl.where(ii > jj, beta[:, None] * decay * kk, 0.0)
        square = tl.dot(lower, lower, input_precision=PRECISION)
        inverse = tl.dot(eye - lower, eye + square, input_precision=PRECISION)
        square = tl.dot(square, square, input_precision=PRECISION)
        inverse = tl.dot(inverse, eye + square, input_precision=PRECISION)
        square = tl.dot(square, square, input_precision=PRECISION)
        inverse = tl.dot(inverse, eye + square, input_precision=PRECISION)
        grow = tl.exp(big_g)
        ks = tl.dot(k, h, input_precision=PRECISION)  # [CHUNK, BLOCK_V]
        u = tl.dot(inverse, beta[:, None] * (v - grow[:, None] * ks), input_precision=PRECISION)
        qk = tl.where(ii >= jj, decay * tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0)
        o = grow[:, None] * tl.dot(q, h, input_precision=PRECISION)
        o += tl.dot(qk, u, input_precision=PRECISION)
        tl.store(out_ptr + (rows[:, None] * HV + hv) * DV + offs_v[None, :], o,
                 mask=(rows < N)[:, None] & mask_v[None, :])  # fmt: skip
        # the snapshot after `split` rows, when it falls in this chunk
        inside = split - t0  # rows of this chunk before the snapshot
        g_at = tl.sum(tl.where(step == inside - 1, big_g, 0.0), axis=0)
        weight = tl.where(step < inside, tl.exp(tl.where(step < inside, g_at - big_g, 0.0)), 0.0)
        at = tl.dot(tl.trans(k * weight[:, None]), u, input_precision=PRECISION)
        at += tl.exp(g_at) * h
        at_split = (zero + inside > 0) & (zero + inside <= CHUNK) & (zero + split < n)
        tl.store(snap_ptr + snap_cells, at, mask=mask & at_split)
        g_end = tl.sum(tl.where(step == CHUNK - 1, big_g, 0.0), axis=0)
        weight = tl.exp(g_end - big_g)
        change = tl.dot(tl.trans(k * weight[:, None]), u, input_precision=PRECISION)
        h = tl.exp(g_end) * h + change
    tl.store(state_ptr + cells, h, mask=mask & (zero + n > 0))
    for t0 in range(tl.cdiv(n, CHUNK) * CHUNK, N, CHUNK):  # padding rows: zeros
        rows = t0 + step
        tl.store(out_ptr + (rows[:, None] * HV + hv) * DV + offs_v[None, :],
                 tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32),
                 mask=(rows < N)[:, None] & mask_v[None, :])  # fmt: skip


def gated_delta_seq_triton(
    conv_out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    snap_state: torch.Tensor,
    meta: torch.Tensor,
    num_key_heads: int,
    key_dim: int,
    form: str = "",
    precision: str = "tf32",
    block_v: int = 0,
    num_warps: int = 0,
) -> torch.Tensor:
    """The gated delta rule over one sequence's rows (see above for ``meta``): conv_out
    [N, 2 * Hk * Dk + Hv * Dv]; a, b [N, Hv] (raw projections); state [S, Hv, Dk, Dv] and
    snap_state [S, snapshots, Hv, Dk, Dv] float32, updated in place -> o [N, Hv, Dv] float32
    (padding rows zero). ``recurrent_gated_delta_rule`` over the rows, capturable, one launch.

    ``form`` "chunk" (the default for bf16/fp16 inputs): 16 rows a step of small matrix
    products at ``precision`` (tf32: 17 us for a warm turn's 64 rows on the 35B-A3B heads,
    outputs within 2e-3 of exact; "ieee" float32 products are slower than the row loop on
    Hopper); "rows" (the default for float32): one row after the other, exact (38 us).
    BENCHMARKS.md, session 11, has the sweep behind the defaults."""
    rows = conv_out.shape[0]
    _, heads_v, dk, dv = state.shape
    assert state.is_contiguous() and state.dtype == torch.float32 and dk == key_dim
    assert snap_state.stride(-1) == 1 and snap_state.stride(2) == dk * dv
    assert conv_out.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    out = torch.empty(rows, heads_v, dv, dtype=torch.float32, device=conv_out.device)
    args = (
        conv_out, a, b, a_log, dt_bias, state, snap_state, out, meta, rows,
        conv_out.stride(0), a.stride(0), b.stride(0), snap_state.stride(0),
        snap_state.stride(1), dk**-0.5,
    )  # fmt: skip
    form = form or ("rows" if conv_out.dtype == torch.float32 else "chunk")
    if form == "rows":
        block_v, num_warps = min(block_v or 16, triton.next_power_of_2(dv)), num_warps or 1
        _delta_rows_kernel[(heads_v, triton.cdiv(dv, block_v))](
            *args, HK=num_key_heads, HV=heads_v, DK=dk, DV=dv,
            BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=num_warps,
        )  # fmt: skip
        return out
    block_v = max(16, min(block_v or 32, triton.next_power_of_2(dv)))  # tl.dot: 16 at least
    num_warps = num_warps or 4
    _delta_chunk_kernel[(heads_v, triton.cdiv(dv, block_v))](
        *args, HK=num_key_heads, HV=heads_v, DK=dk, DV=dv,
        BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v, CHUNK=16,
        PRECISION=precision, num_warps=num_warps,
    )  # fmt: skip
    return out
