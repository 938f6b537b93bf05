"""Fused RMSNorm kernels (Triton): one launch where the torch path takes five to ten.

The kernels, one program per row (the row fits in one block):

- `rms_norm_triton(x, w, eps, offset, round_first)`: y = norm(x) * (offset + w);
- `add_rms_norm_triton(y, r, w1, w2, scale, ...)`: h = (r + norm_w1(y)) * scale, and
  n = norm_w2(h): the sandwich layer's "residual add + next norm" in one pass;
- `rms_norm_rope_triton(x, w, cos, sin, ...)`: per (token, head) row, the q/k norm followed
  by the rotate-half rotary embedding; `rms_norm_partial_rope_triton` the same with only the
  first dims rotated (qwen3_5_moe's partial rotary);
- `qkv_norm_rope_store_triton(q, k, v, ...)`: a decode step's q and k norms and rotary, the
  V norm, and the store of the new key and value into the KV cache, in one launch.

Numerics: the sum of squares and the scaling run in float32; every value the torch path
stores in the input dtype (the norm's output, the residual sum, the scaled sum) is rounded to
that dtype here too, so the result equals the torch path up to float32 summation order.
Styles (see `worker.layers.blocks.NormStyle`): `round_first=False`: (normed * (offset + w))
rounded once (gemma); `round_first=True`: normed rounded, then times (offset + w) (llama).
No weight (`w is None`): normed rounded (gemma4's V norm).

The torch references are in `worker.device.kernels.reference`-style helpers of
`worker.layers.blocks`; this module imports Triton: import it only after
`worker.device.kernels.triton_available()`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.device.kernels import dependent_launch, dependent_small


@triton.jit
def dependent_start(WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    """The start of a kernel in the decode step's chain of dependent launches: WAIT (launched
    as a dependent, ``kernels.dependent_small``) first waits for the kernel before to finish,
    its writes visible, before any memory access; TRIGGER then lets the next kernel launch (a
    GEMV to load its first weights, a small kernel to be resident when this one ends).
    Every kernel of the chain waits before it triggers, so when one starts, all kernels but
    the one right before it have ended: a kernel may read, before it waits, what those wrote
    (the step's inputs, the KV cache's older entries, as attention's split kernel does)."""
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def to_cache(x, cache_ptr):
    """x in the KV cache's element type: into an fp8 cache (``--kv-cache-dtype fp8``) it
    saturates at +-448, e4m3's largest finite value, as `worker.layers.kv.as_cache` does."""
    ct = cache_ptr.dtype.element_ty
    if ct == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(ct)


@triton.jit
def _normed(x, w_ptr, offs, mask, n, eps, offset, HAS_W: tl.constexpr,
            ROUND_FIRST: tl.constexpr, OUT_DTYPE: tl.constexpr):  # fmt: skip
    """x [BLOCK] float32 -> the norm's output [BLOCK] float32, rounded to OUT_DTYPE."""
    ms = tl.sum(x * x, axis=0) / n
    normed = x * (1.0 / tl.sqrt(ms + eps))
    if HAS_W:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        if ROUND_FIRST:
            normed = normed.to(OUT_DTYPE).to(tl.float32)
            scale = (w + offset).to(OUT_DTYPE).to(tl.float32)
            out = normed * scale
        else:
            out = normed * (w.to(tl.float32) + offset)
    else:
        out = normed
    return out.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, stride_x0, stride_x1, stride_y0, stride_y1, n, eps, offset,
    HAS_W: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr,
    TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False,
):  # fmt: skip
    dependent_start(WAIT, TRIGGER)
    r0, r1 = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + r0 * stride_x0 + r1 * stride_x1 + offs, mask=mask, other=0.0)
    out_dtype = y_ptr.dtype.element_ty
    y = _normed(x.to(tl.float32), w_ptr, offs, mask, n, eps, offset, HAS_W, ROUND_FIRST,
                out_dtype)  # fmt: skip
    tl.store(y_ptr + r0 * stride_y0 + r1 * stride_y1 + offs, y.to(out_dtype), mask=mask)


def _rows3(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """x [..., N] with a unit last stride -> (x, rows0, rows1, stride0, stride1) over a
    2-D grid of rows (the last dim contiguous; the leading ones any stride)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    x = x.reshape(-1, x.shape[-1]) if x.dim() != 1 else x[None]
    return x, x.shape[0], 1, x.stride(0), 0


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, round_first: bool
) -> torch.Tensor:
    """x [..., N] (2-D or 3-D, last dim contiguous) -> y, contiguous, same shape and dtype."""
    shape = x.shape
    x, rows0, rows1, s0, s1 = _rows3(x)
    n = x.shape[-1]
    y = torch.empty((rows0, rows1, n), dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(rows0, rows1)](
        x, weight if weight is not None else x, y, s0, s1, y.stride(0), y.stride(1), n,
        float(eps), float(offset),
        HAS_W=weight is not None, ROUND_FIRST=round_first, BLOCK=triton.next_power_of_2(n),
        TRIGGER=dependent_launch(x.device), WAIT=dependent_small(x.device),
        launch_pdl=dependent_small(x.device), num_warps=_warps(n),
    )  # fmt: skip
    return y.view(shape)


def _warps(n: int) -> int:
    """Warps of a one-row program: about 16 elements per thread, 1 to 16 warps."""
    return max(1, min(16, triton.next_power_of_2(n) // 512))


@triton.jit
def _add_rms_norm_kernel(
    y_ptr, r_ptr, w1_ptr, w2_ptr, scale_ptr, h_ptr, out_ptr,
    stride_y, stride_r, stride_h, stride_o, n, eps, offset,
    NORM1: tl.constexpr, NORM2: tl.constexpr, HAS_SCALE: tl.constexpr,
    ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr = False,
    WAIT: tl.constexpr = False,
):  # fmt: skip
    dependent_start(WAIT, TRIGGER)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dt = h_ptr.dtype.element_ty
    y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM1:
        y = _normed(y, w1_ptr, offs, mask, n, eps, offset, True, ROUND_FIRST, dt)
    r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    h = (r + y).to(dt).to(tl.float32)
    if HAS_SCALE:
        s = tl.load(scale_ptr).to(tl.float32)
        h = (h * s).to(dt).to(tl.float32)
    tl.store(h_ptr + row * stride_h + offs, h.to(dt), mask=mask)
    if NORM2:
        o = _normed(h, w2_ptr, offs, mask, n, eps, offset, True, ROUND_FIRST, dt)
        tl.store(out_ptr + row * stride_o + offs, o.to(dt), mask=mask)


def add_rms_norm_triton(
    y: torch.Tensor,
    residual: torch.Tensor,
    w1: torch.Tensor | None,
    w2: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
    offset: float,
    round_first: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y, residual [T, N] -> (h, norm_w2(h)) with h = (residual + norm_w1(y)) * scale.

    w1 None: no norm on y; w2 None: the second output is None; scale: a [1] tensor or None.
    """
    if y.stride(-1) != 1:
        y = y.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    rows, n = residual.shape
    h = torch.empty_like(residual, memory_format=torch.contiguous_format)
    out = torch.empty_like(h) if w2 is not None else h
    _add_rms_norm_kernel[(rows,)](
        y, residual, w1 if w1 is not None else y, w2 if w2 is not None else y,
        scale if scale is not None else y, h, out,
        y.stride(0), residual.stride(0), h.stride(0), out.stride(0), n, float(eps), float(offset),
        NORM1=w1 is not None, NORM2=w2 is not None, HAS_SCALE=scale is not None,
        ROUND_FIRST=round_first, BLOCK=triton.next_power_of_2(n),
        TRIGGER=dependent_launch(y.device), WAIT=dependent_small(y.device),
        launch_pdl=dependent_small(y.device), num_warps=_warps(n),
    )  # fmt: skip
    return h, (out if w2 is not None else None)


@triton.jit
def _norm_rope_row(base, w_ptr, cos_ptr, sin_ptr, t, stride_c, half, eps, offset,
                   NORM: tl.constexpr, HAS_W: tl.constexpr, ROUND_FIRST: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, dt: tl.constexpr):  # fmt: skip
    """The row of D = 2 * half values at ``base`` (token t): its q/k norm (NORM), then the
    rotate-half rotary embedding -> the two halves, float32 (the caller rounds to dt)."""
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        n = 2 * half
        ms = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / n
        inv = 1.0 / tl.sqrt(ms + eps)
        x1, x2 = x1 * inv, x2 * inv
        if HAS_W:
            w1 = tl.load(w_ptr + offs, mask=mask, other=0.0)
            w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0)
            if ROUND_FIRST:
                x1 = x1.to(dt).to(tl.float32) * (w1 + offset).to(dt).to(tl.float32)
                x2 = x2.to(dt).to(tl.float32) * (w2 + offset).to(dt).to(tl.float32)
            else:
                x1 = x1 * (w1.to(tl.float32) + offset)
                x2 = x2 * (w2.to(tl.float32) + offset)
        x1, x2 = x1.to(dt).to(tl.float32), x2.to(dt).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + half + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_c + half + offs, mask=mask, other=0.0).to(tl.float32)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr,
    stride_x0, stride_x1, stride_y0, stride_y1, stride_c, half, eps, offset,
    NORM: tl.constexpr, HAS_W: tl.constexpr, ROUND_FIRST: tl.constexpr,
    BLOCK_HALF: tl.constexpr, TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False,
):  # fmt: skip
    dependent_start(WAIT, TRIGGER)
    t, hd = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    dt = y_ptr.dtype.element_ty
    y1, y2 = _norm_rope_row(x_ptr + t * stride_x0 + hd * stride_x1, w_ptr, cos_ptr, sin_ptr, t,
                            stride_c, half, eps, offset, NORM, HAS_W, ROUND_FIRST, BLOCK_HALF,
                            dt)  # fmt: skip
    out = y_ptr + t * stride_y0 + hd * stride_y1
    tl.store(out + offs, y1.to(dt), mask=mask)
    tl.store(out + half + offs, y2.to(dt), mask=mask)


def rms_norm_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    offset: float,
    round_first: bool,
    norm: bool = True,
) -> torch.Tensor:
    """x [T, H, D] (any strides, last dim contiguous); cos, sin [T, D] -> [T, H, D] contiguous:
    rotary(norm(x)) (or rotary(x) when ``norm`` is false)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    t, heads, dim = x.shape
    y = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    half = dim // 2
    _rms_norm_rope_kernel[(t, heads)](
        x, weight if weight is not None else x, cos, sin, y,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0), half,
        float(eps), float(offset),
        NORM=norm, HAS_W=weight is not None, ROUND_FIRST=round_first,
        BLOCK_HALF=triton.next_power_of_2(half), TRIGGER=dependent_launch(x.device),
        WAIT=dependent_small(x.device), launch_pdl=dependent_small(x.device),
        num_warps=_warps(dim),
    )  # fmt: skip
    return y


@triton.jit
def _qkv_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, w_q_ptr, w_k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr,
    v_cache_ptr, slots_ptr, positions_ptr,
    stride_q0, stride_q1, stride_k0, stride_k1, stride_v0, stride_v1, stride_o0, stride_o1,
    stride_c, stride_ks, stride_kh, stride_kr, stride_vs, stride_vh, stride_vr,
    heads, capacity, half, eps, v_eps, offset,
    NORM: tl.constexpr, HAS_W: tl.constexpr, V_NORM: tl.constexpr, ROUND_FIRST: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, TRIGGER: tl.constexpr = False,
    WAIT: tl.constexpr = False,
):  # fmt: skip
    """Program (t, h): q head h (h < heads) normed and rotated into q_out; or KV head
    h - heads, its key normed and rotated and its value normed (V_NORM), both written into
    the caches at entry positions[t] % capacity of slots[t] (a negative slot: nothing)."""
    t, hd = tl.program_id(0), tl.program_id(1)
    # the step's slots and positions, before the wait (from the step's start, not from the
    # kernel before: `dependent_start`); the KV programs then branch without a round trip
    slot = tl.load(slots_ptr + t).to(tl.int64)
    entry = tl.load(positions_ptr + t).to(tl.int64) % capacity
    dependent_start(WAIT, TRIGGER)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    dt = q_out_ptr.dtype.element_ty
    if hd < heads:
        y1, y2 = _norm_rope_row(q_ptr + t * stride_q0 + hd * stride_q1, w_q_ptr, cos_ptr,
                                sin_ptr, t, stride_c, half, eps, offset, NORM, HAS_W, ROUND_FIRST,
                                BLOCK_HALF, dt)  # fmt: skip
        out = q_out_ptr + t * stride_o0 + hd * stride_o1
        tl.store(out + offs, y1.to(dt), mask=mask)
        tl.store(out + half + offs, y2.to(dt), mask=mask)
    else:
        j = hd - heads
        if slot >= 0:
            y1, y2 = _norm_rope_row(k_ptr + t * stride_k0 + j * stride_k1, w_k_ptr, cos_ptr,
                                    sin_ptr, t, stride_c, half, eps, offset, NORM, HAS_W,
                                    ROUND_FIRST, BLOCK_HALF, dt)  # fmt: skip
            k_dst = k_cache_ptr + slot * stride_ks + j * stride_kh + entry * stride_kr
            tl.store(k_dst + offs, to_cache(y1.to(dt), k_cache_ptr), mask=mask)
            tl.store(k_dst + half + offs, to_cache(y2.to(dt), k_cache_ptr), mask=mask)
            offs_d = tl.arange(0, BLOCK_D)
            mask_d = offs_d < 2 * half
            v = tl.load(v_ptr + t * stride_v0 + j * stride_v1 + offs_d, mask=mask_d, other=0.0)
            v = v.to(tl.float32)
            if V_NORM:
                v = _normed(v, v_ptr, offs_d, mask_d, 2 * half, v_eps, 0.0, False, False, dt)
            v_dst = v_cache_ptr + slot * stride_vs + j * stride_vh + entry * stride_vr
            tl.store(v_dst + offs_d, to_cache(v.to(dt), v_cache_ptr), mask=mask_d)


def qkv_norm_rope_store_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    norms: tuple[torch.Tensor | None, torch.Tensor | None, float, float, bool] | None,
    v_eps: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """A decode step's attention inputs in one launch: q [B, H, D] -> rotary(q_norm(q)),
    returned contiguous; k [B, KVH, D] -> rotary(k_norm(k)) and v -> v_norm(v) (weightless),
    written into the caches [S, KVH, R, D] at entry ``positions % R`` of ``slots`` (a
    negative slot writes nothing). ``norms``: (q weight, k weight, eps, offset, round_first),
    or None for rotary alone; ``v_eps`` None: no V norm. The same values, roundings included,
    as `rms_norm_rope_triton` on q and k, `rms_norm_triton` on v and
    `decode_attention.store_kv_triton`: four launches in one."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    w_q, w_k, eps, offset, round_first = norms or (None, None, 0.0, 0.0, False)
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    half = dim // 2
    _qkv_norm_rope_store_kernel[(batch, heads + kv_heads)](
        q, k, v, w_q if w_q is not None else q, w_k if w_k is not None else q, cos, sin, out,
        k_cache, v_cache, slots, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        heads, k_cache.shape[2], half, float(eps), float(v_eps or 0.0), float(offset),
        NORM=norms is not None, HAS_W=w_q is not None, V_NORM=v_eps is not None,
        ROUND_FIRST=round_first, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_D=triton.next_power_of_2(dim), TRIGGER=dependent_launch(q.device),
        WAIT=dependent_small(q.device), launch_pdl=dependent_small(q.device),
        num_warps=_warps(dim),
    )  # fmt: skip
    return out


@triton.jit
def _rms_norm_partial_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr,
    stride_x0, stride_x1, stride_y0, stride_y1, stride_c, eps, offset,
    D: tl.constexpr, HALF: tl.constexpr, ROUND_FIRST: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t, hd = tl.program_id(0), tl.program_id(1)
    dt = y_ptr.dtype.element_ty
    src = x_ptr + t * stride_x0 + hd * stride_x1
    dst = y_ptr + t * stride_y0 + hd * stride_y1
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    normed = _normed(x, w_ptr, offs, mask, D, eps, offset, True, ROUND_FIRST, dt)
    tl.store(dst + offs, normed.to(dt), mask=mask & (offs >= 2 * HALF))  # passes through
    # the rotated dims again, as two halves (their norm from the same row sum)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    r = tl.arange(0, BLOCK_HALF)
    in_half = r < HALF
    x1 = _scaled(tl.load(src + r, mask=in_half, other=0.0).to(tl.float32) * inv, w_ptr, r,
                 in_half, offset, ROUND_FIRST, dt)  # fmt: skip
    x2 = _scaled(tl.load(src + HALF + r, mask=in_half, other=0.0).to(tl.float32) * inv, w_ptr,
                 HALF + r, in_half, offset, ROUND_FIRST, dt)  # fmt: skip
    c1 = tl.load(cos_ptr + t * stride_c + r, mask=in_half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + r, mask=in_half, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_c + r, mask=in_half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_c + HALF + r, mask=in_half, other=0.0).to(tl.float32)
    # apply_rotary's roundings: each product in the dtype, then their sum
    y1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(dst + r, y1.to(dt), mask=in_half)
    tl.store(dst + HALF + r, y2.to(dt), mask=in_half)


@triton.jit
def _scaled(normed, w_ptr, offs, mask, offset, ROUND_FIRST: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """``_normed``'s weighting of already-normalised values (float32, rounded to OUT_DTYPE)."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if ROUND_FIRST:
        out = normed.to(OUT_DTYPE).to(tl.float32) * (w + offset).to(OUT_DTYPE).to(tl.float32)
    else:
        out = normed * (w.to(tl.float32) + offset)
    return out.to(OUT_DTYPE).to(tl.float32)


def rms_norm_partial_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    offset: float,
    round_first: bool,
) -> torch.Tensor:
    """x [T, H, D] (any strides, last dim contiguous); cos, sin [T, R] (R <= D, even) ->
    [T, H, D] contiguous: the norm of each row, then its first R dims rotated (rotate-half
    within them, the rest passed through): ``apply_partial_rotary(norm(x))`` in one launch,
    with its roundings."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    t, heads, dim = x.shape
    half = cos.shape[-1] // 2
    y = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    if t:
        _rms_norm_partial_rope_kernel[(t, heads)](
            x, weight, cos, sin, y, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            cos.stride(0), float(eps), float(offset),
            D=dim, HALF=half, ROUND_FIRST=round_first, BLOCK_D=triton.next_power_of_2(dim),
            BLOCK_HALF=max(16, triton.next_power_of_2(half)), num_warps=_warps(dim),
        )  # fmt: skip
    return y


@triton.jit
def _gated_act_kernel(
    g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, n,
    ACT: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr = False,
    WAIT: tl.constexpr = False,
):  # fmt: skip
    dependent_start(WAIT, TRIGGER)
    row, blk = tl.program_id(0), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dt = y_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, gated_activation(g, u, ACT, dt), mask=mask)


@triton.jit
def gated_activation(g, u, ACT: tl.constexpr, dt: tl.constexpr):
    """act(g) * u in ``dt`` from fp32 g, u: act rounded to ``dt`` first (as torch's
    ``act(gate) * up`` in that dtype). ACT: 0 silu, 1 gelu (tanh approximation), 2 sigmoid.
    Shared by ``_gated_act_kernel`` and the gated GEMV (``gemv._gated_gemv_kernel``), which
    must round alike."""
    if ACT == 1:  # gelu, tanh approximation
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        a = 0.5 * g * (1.0 + tanh)
    elif ACT == 2:  # sigmoid (qwen3_5_moe's attention output gate)
        a = tl.sigmoid(g)
    else:  # silu
        a = g * tl.sigmoid(g)
    return (a.to(dt).to(tl.float32) * u).to(dt)


GATED_ACTIVATIONS = {"gelu_pytorch_tanh": 1, "gelu_new": 1, "silu": 0, "swish": 0, "sigmoid": 2}


def gated_act_triton(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """gate, up [T, I] (rows may be strided, e.g. halves of one gate_up output) ->
    act(gate) * up, [T, I] contiguous. act: a key of GATED_ACTIVATIONS."""
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    rows, n = gate.shape
    y = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    block = 1024
    _gated_act_kernel[(rows, triton.cdiv(n, block))](
        gate, up, y, gate.stride(0), up.stride(0), y.stride(0), n,
        ACT=GATED_ACTIVATIONS[act], BLOCK=block, TRIGGER=dependent_launch(y.device),
        WAIT=dependent_small(y.device), launch_pdl=dependent_small(y.device), num_warps=4,
    )  # fmt: skip
    return y
