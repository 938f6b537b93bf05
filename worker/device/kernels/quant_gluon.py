"""The 32-row int4 decode GEMM in Gluon (Triton's explicit-layout dialect), code positions
stacked along M: a candidate beside `quant_matmul._qgemm_kernel`, off unless
TOKENPIPE_QUANT_GLUON_GEMM=1 (``quant_matmul.quant_linear``). Not yet run on a GPU (session 21
compiled it offline only); ``tools/proto_gluon_gemm.py`` checks it against ``qgemm`` and times
both.

Why: Nsight Compute shows today's GEMM at 8 warps an SM, held there by registers (128
accumulators a thread: 512 outputs x 32 rows over 4 warps), with half the issue slots busy and
the warps waiting on the dequantization's dependent instructions. Here each [64, K step] wgmma
tile holds two code positions of the same 32 words: rows 0-31 position 2j, rows 32-63 position
2j+1 (warps 0-1 and 2-3). Each thread loads its words straight into the wgmma A-operand
register layout and makes only its warp's position, once, as bf16 pairs (a byte permute, an
AND/OR into 128 + code, a bf16x2 subtract and FMA; odd positions from the words shifted right
by one, 128 + 8 code, with the scale / 8). A program: 4 warps, 256 outputs x 32 rows, 4
accumulators of [64, 32] fp32 = 64 registers a thread, so at 128 registers four programs (16
warps) fit an SM. Offline (Triton 3.6, sm_90a): 128 registers, ~4.3 SASS instructions a weight
(today's tile: 255 and 3.64). BLOCK_W 16 stacks four positions of 16 words a tile instead (2
accumulators, 32 registers; each warp's byte of a word then comes from a register selector):
104 registers at ~5.75 instructions a weight, five programs an SM.

Needs Triton with Gluon and a Hopper GPU; import it only then.
"""

from __future__ import annotations

from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.constexpr_function
def pair_asm(j: int) -> str:
    """PTX for a bf16x2 of K neighbours of code position p = 2j + (0 or 1): $1, $2 the two
    words (shifted right by p % 2), $3 the code's mask in both halves (0x000F000F, odd p
    0x00780078), $5 the bf16x2 scale (odd p: / 8), $7 the bf16x2 offset ($4, $6, $8 the same
    values again: inline asm packs two elements an operand)."""
    select = j | (4 + j) << 8  # byte j of each word, into the two halves
    return (
        "{ .reg .b32 t, base; mov.b32 base, 0x43004300; "
        f"prmt.b32 t, $1, $2, {select:#x}; "
        "lop3.b32 t, t, $3, base, 0xEA; "  # (t & mask) | 128.0 in each half: 128 + code (x 8)
        "sub.bf16x2 t, t, base; "
        "fma.rn.bf16x2 $0, t, $5, $7; }"
    )


# the same with the byte selector in a register ($9, $10): four positions a tile (BLOCK_W 16),
# where a warp's byte of the word depends on its position
PAIR_ASM_SELECT = gl.constexpr(
    "{ .reg .b32 t, base; mov.b32 base, 0x43004300; "
    "prmt.b32 t, $1, $2, $9; "
    "lop3.b32 t, t, $3, base, 0xEA; "
    "sub.bf16x2 t, t, base; "
    "fma.rn.bf16x2 $0, t, $5, $7; }"
)


@gluon.jit
def _stacked_gemm_kernel(
    x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, M, N, C, K, stride_xm,
    BLOCK_W: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_M: gl.constexpr, BW: gl.constexpr,
):  # fmt: skip
    """y[split] [M, N] (partials when the grid splits K) = x @ W^T over this program's
    BLOCK_W word columns (8 BLOCK_W outputs) and its K range; K-major int4 words (blocked by
    BW word columns, or plain for BW 0), bf16 scales and offsets, groups of BLOCK_K."""
    P: gl.constexpr = 8
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    pid_c = gl.program_id(0)
    split = gl.program_id(1)
    tiles = (K + BLOCK_K - 1) // BLOCK_K
    span = (tiles + gl.num_programs(1) - 1) // gl.num_programs(1)
    k_first = split * span * BLOCK_K
    k_last = gl.minimum((split + 1) * span, tiles) * BLOCK_K
    y_ptr += split * M * N

    STACK: gl.constexpr = 64 // BLOCK_W  # code positions a [64, K step] tile stacks: 2 or 4
    TILES: gl.constexpr = P // STACK
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, A))  # the stacked tile's rows
    ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, A))
    col = pid_c * BLOCK_W + rows % BLOCK_W  # each row's word column
    sub = rows // BLOCK_W  # the row's position within the tile's STACK
    half = sub % 2  # 0: an even position (low nibble), 1: an odd one
    if BW == 0:
        words_at = col.to(gl.int64)
        meta_at = col
        RS = C
    else:
        words_at = (col // BW).to(gl.int64) * (K * BW) + col % BW
        meta_at = (col // BW) * ((K // BLOCK_K) * (P * BW)) + col % BW
        RS = C * 0 + BW

    xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
    xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL))
    x_rows = x_ptr + xm[:, None].to(gl.int64) * stride_xm
    x_mask = (xm < M)[:, None]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], XS)

    acc0 = gl.zeros([64, BLOCK_M], gl.float32, MMA)
    acc1 = gl.zeros([64, BLOCK_M], gl.float32, MMA)
    acc2 = gl.zeros([64, BLOCK_M], gl.float32, MMA)
    acc3 = gl.zeros([64, BLOCK_M], gl.float32, MMA)
    for k0 in range(k_first, k_last, BLOCK_K):
        words = gl.load(w_ptr + (k0 + ks)[None, :].to(gl.int64) * RS + words_at[:, None])
        # odd positions: the words shifted right by one put each byte's high nibble in bits
        # 3-6, inside a bf16 mantissa under 0x4300 (128 + 8 code)
        shift, _ = gl.broadcast(half[:, None], words)
        words = words >> shift
        xt = gl.load(x_rows + (k0 + xk)[None, :], mask=x_mask, other=0.0)
        x_smem.store(xt)
        fence_async_shared()
        b = x_smem.permute((1, 0))  # [BLOCK_K, BLOCK_M]
        meta = (k0 // BLOCK_K) * (P * RS) + meta_at
        for j in gl.static_range(TILES):
            p = STACK * j + sub
            scale = gl.load(s_ptr + meta + p * RS).to(gl.float32)
            scale = (scale * gl.where(half == 1, 0.125, 1.0)).to(gl.bfloat16)
            offset = gl.load(o_ptr + meta + p * RS)
            sb = scale.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
            ob = offset.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
            sc, _ = gl.broadcast((sb | (sb << 16))[:, None], words)
            of, _ = gl.broadcast((ob | (ob << 16))[:, None], words)
            mask, _ = gl.broadcast(gl.where(half == 1, 0x00780078, 0x000F000F)[:, None], words)
            if STACK == 2:  # byte j of every word
                w = gl.inline_asm_elementwise(pair_asm(j), "=r,r,r,r,r,r,r,r,r",
                                              [words, mask, sc, of], dtype=gl.bfloat16,
                                              is_pure=True, pack=2)  # fmt: skip
            else:  # byte p // 2, by warp
                byte = p // 2
                sel, _ = gl.broadcast((byte | (byte + 4) << 8)[:, None], words)
                w = gl.inline_asm_elementwise(PAIR_ASM_SELECT, "=r,r,r,r,r,r,r,r,r,r,r",
                                              [words, mask, sc, of, sel], dtype=gl.bfloat16,
                                              is_pure=True, pack=2)  # fmt: skip
            if j == 0:
                acc0 = warpgroup_mma(w, b, acc0, is_async=True)
            elif j == 1:
                acc1 = warpgroup_mma(w, b, acc1, is_async=True)
            elif j == 2:
                acc2 = warpgroup_mma(w, b, acc2, is_async=True)
            else:
                acc3 = warpgroup_mma(w, b, acc3, is_async=True)
        # the step's MMAs done before x's tile is replaced
        if TILES == 4:
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(0, deps=(acc0, acc1, acc2, acc3))
        else:
            acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))

    # row r of tile j is output (column * 8 + STACK j + r // BLOCK_W); column n is x's row n
    orow = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    ocol = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    first = (pid_c * BLOCK_W + orow % BLOCK_W) * P + orow // BLOCK_W
    base = y_ptr + ocol[None, :].to(gl.int64) * N
    ty = y_ptr.dtype.element_ty
    for j in gl.static_range(TILES):
        out = first + STACK * j
        mask = (out < N)[:, None] & (ocol < M)[None, :]
        acc = acc0 if j == 0 else (acc1 if j == 1 else (acc2 if j == 2 else acc3))
        gl.store(base + out[:, None], acc.to(ty), mask=mask)


BLOCK_W = 32
PROGRAMS = 528  # four an SM of an H200
MAXNREG = 128


def stacked_gemm(
    x: Any, packed: Any, split: int | None = None, programs: int = PROGRAMS,
    maxnreg: int = MAXNREG, block_w: int = BLOCK_W,
) -> Any:  # fmt: skip
    """x [M <= 32, K] bf16 @ W^T -> [M, N] bf16 for an int4 g32 ``KMajorWeight`` with bf16
    scales and offsets; K split for about PROGRAMS programs, partials summed by
    ``quant_matmul._reduce_kernel``; ``maxnreg`` 0: no register cap; ``block_w`` 32 (two
    positions a tile) or 16 (four)."""
    import torch
    import triton

    from worker.device.kernels import quant_matmul as qm

    m, k = x.shape
    n = packed.shape[0]
    assert m <= 32 and x.dtype == torch.bfloat16 and packed.kind == qm.INT4
    assert packed.group_size == 32 and packed.scales.dtype == torch.bfloat16
    tiles = triton.cdiv(packed.columns, block_w)
    if split is None:
        split = max(1, min(k // 32, programs // tiles))
    partial = torch.bfloat16 if qm.PARTIALS_BF16 else torch.float32  # as qgemm's
    out = torch.empty((m, n) if split == 1 else (split, m, n), device=x.device,
                      dtype=x.dtype if split == 1 else partial)  # fmt: skip
    _stacked_gemm_kernel[(tiles, split)](
        x, packed.words, packed.scales, packed.offsets, out, m, n, packed.columns, k,
        x.stride(0), BLOCK_W=block_w, BLOCK_K=32, BLOCK_M=32, BW=packed.block, num_warps=4,
        maxnreg=maxnreg or None,
    )  # fmt: skip
    return out if split == 1 else qm.sum_splits(out, x.dtype)
