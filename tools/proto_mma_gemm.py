# ruff: noqa  (a prototype kept in history only: removed in the next commit)
"""Session 24 prototype: the 32-row int4 g32 GEMM on mma.sync (m16n8k16) with the weights as the
B operand, dequantized straight into B's registers from today's blocked K-major words (no layout
change): a thread loads the words of its 8 k rows x 4 word columns (LDG.128 a row), keeps the
nibble of its lane's code position (lane / 4), and each warp's accumulators are its own
[32 rows, 32 outputs] (32 registers), so 16 warps an SM fit where today's wgmma tile allows 8.

python3 tools/proto_mma_gemm.py   (on a GPU: correctness against qgemm, then us per matrix;
needs graph_us from tools/proto_tma_gemv.py at 7069b4a beside it as tma_gemv.py)
"""

from __future__ import annotations

import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

W = 4  # warps a program
CB = 16  # word columns a program (8 outputs each): 128 outputs
M = 32
PROGRAMS = ((528, 6), (528, 10), (660, 6))
TILE = (64, 32, 4, 4, 1, 264)  # session 20's best qgemm tile at 32 rows

MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8])
A_L = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
B_L = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
# (k, c, p): a thread holds k in {2(l%4), +1, +8, +16 ...}, 4 adjacent word columns, position l/4
L3 = gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [8, 0, 0], [16, 0, 0]],
    lane_bases=[[2, 0, 0], [4, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
    warp_bases=[[0, 4, 0], [0, 8, 0]],
    block_bases=[],
    shape=[32, CB, 8],
)
# the same by k pairs: (k pair, c, p); a pair's two words are split apart
L3P = gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [0, 2, 0], [4, 0, 0], [8, 0, 0]],
    lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
    warp_bases=[[0, 4, 0], [0, 8, 0]],
    block_bases=[],
    shape=[16, CB, 8],
)


@gluon.jit
def _mma_gemm_kernel(x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, rows, N, C, K, span,
                     CB: gl.constexpr, L3: gl.constexpr, L3P: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr,
                     MMA: gl.constexpr):  # fmt: skip
    pid_c = gl.program_id(0)
    split = gl.program_id(1)
    groups = K // 32
    first = split * span
    last = gl.minimum(first + span, groups)
    LW: gl.constexpr = gl.SliceLayout(2, L3)  # (k, c)
    LM: gl.constexpr = gl.SliceLayout(0, L3P)  # (c, p)
    LWP: gl.constexpr = gl.SliceLayout(2, L3P)  # (k pair, c)
    k_w = gl.arange(0, 32, layout=gl.SliceLayout(1, LW))
    c_w = gl.arange(0, CB, layout=gl.SliceLayout(0, LW))
    c0 = pid_c * CB  # blocked layout: 32 word columns a block, a k row of a block contiguous
    col = c0 + c_w
    words_at = (col // 32).to(gl.int64) * (K * 32) + col % 32  # [CB]
    w_ptrs = w_ptr + words_at[None, :] + k_w[:, None] * 32  # + g * 32 * 32 per group
    c_m = gl.arange(0, CB, layout=gl.SliceLayout(1, LM))
    p_m = gl.arange(0, 8, layout=gl.SliceLayout(0, LM))
    colm = c0 + c_m
    meta_at = (colm // 32) * (groups * 256) + colm % 32  # + g * 256 + p * 32
    m_ptrs = meta_at[:, None] + p_m[None, :] * 32
    m_mask = (colm < C)[:, None] & (p_m[None, :] < 8)
    shift = gl.expand_dims(gl.expand_dims(p_m * 4, 0), 0)  # [1, 1, 8] in L3
    rm = gl.arange(0, 32, layout=gl.SliceLayout(1, A_L))
    ka = gl.arange(0, 32, layout=gl.SliceLayout(0, A_L))
    x_ptrs = x_ptr + rm[:, None] * K + ka[None, :]
    x_mask = (rm[:, None] < rows) & (ka[None, :] < 32)
    acc = gl.zeros([32, CB * 8], gl.float32, MMA)
    # split the words by k parity: (k pair, c) each, the pair's two words side by side
    sh3 = gl.expand_dims(gl.expand_dims(p_m, 0), 0)  # [1, 1, 8] position
    sel = (sh3 // 2) | ((sh3 // 2 + 4) << 8)  # PRMT: byte p/2 of a -> byte 0, of b -> byte 2
    nsh = (sh3 % 2) * 4
    for g in range(first, last):
        words = gl.load(w_ptrs + g * 1024)
        s = gl.load(s_ptr + m_ptrs + g * 256)
        o = gl.load(o_ptr + m_ptrs + g * 256)
        xa = gl.load(x_ptrs + g * 32)
        w4 = gl.permute(gl.reshape(words, [16, 2, CB]), [0, 2, 1])  # (k pair, c, k bit 0)
        we, wo = gl.split(w4)  # [16, CB] each
        we3 = gl.expand_dims(gl.convert_layout(we, LWP), 2)
        wo3 = gl.expand_dims(gl.convert_layout(wo, LWP), 2)
        s3 = gl.expand_dims(s, 0)
        o3 = gl.expand_dims(o, 0)
        lo, hi = gl.inline_asm_elementwise(
            "{ .reg .b32 t, s2, o2, c;\n"
            "prmt.b32 t, $2, $3, $4;\n"
            "shr.b32 t, t, $5;\n"
            "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;\n"
            "mov.b32 c, 0x43004300;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "mov.b32 s2, {$6, $6};\n"
            "mov.b32 o2, {$7, $7};\n"
            "fma.rn.bf16x2 t, t, s2, o2;\n"
            "mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r,r,h,h",
            [we3, wo3, sel, nsh, s3, o3],
            dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1,
        )  # fmt: skip
        w = gl.join(lo, hi)  # [16, CB, 8, 2]: (k pair, c, p, k bit 0)
        w = gl.permute(w, [0, 3, 1, 2])  # (k pair, k bit 0, c, p)
        w = gl.reshape(w, [16, 2, CB // 4, 4, 8])  # c = c_hi * 4 + c_lo
        w = gl.permute(w, [0, 1, 3, 2, 4])  # (k pair, k bit, c_lo, c_hi, p)
        w = gl.reshape(w, [32, CB * 8])  # n = c_lo * 32 + c_hi * 8 + p
        wb = gl.convert_layout(w, B_L)
        acc = mma_v2(xa, wb, acc)
    # n -> output: c = (n // 8 % (CB // 4)) * 4 + n // 32 ... c_hi = n // 8 % (CB//4), c_lo = n // 32
    rn = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    nn = gl.arange(0, CB * 8, layout=gl.SliceLayout(0, MMA))
    c_of = ((nn // 8) % (CB // 4)) * 4 + nn // (8 * (CB // 4))
    out = (c0 + c_of) * 8 + nn % 8
    y_ptrs = y_ptr + rn[:, None] * N + out[None, :]
    gl.atomic_add(y_ptrs, acc, mask=(rn[:, None] < rows) & (out[None, :] < N), sem="relaxed")


def mma_gemm(x, packed, y32, programs=528):
    n, k = packed.shape
    C = packed.columns
    blocks = triton.cdiv(C, CB)
    groups = k // 32
    split = max(1, min(groups, programs // blocks))
    span = triton.cdiv(groups, split)
    split = triton.cdiv(groups, span)
    _mma_gemm_kernel[(blocks, split)](
        x, packed.words, packed.scales, packed.offsets, y32, x.shape[0], n, C, k, span,
        CB=CB, L3=L3, L3P=L3P, A_L=A_L, B_L=B_L, MMA=MMA, num_warps=W,
    )  # fmt: skip
    return y32


from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

SL_W = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
SL_H = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


@gluon.jit
def _mma_gemm_tma_kernel(wd, sd, od, xd, y_ptr, rows, N, C, K, span,
                         CB: gl.constexpr, STAGES: gl.constexpr, L3: gl.constexpr,
                         L3P: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr,
                         MMA: gl.constexpr):  # fmt: skip
    """The same math, the words, scales, offsets and x of each group by TMA into STAGES
    shared-memory stages (one mbarrier a stage), so many groups are in flight a program."""
    pid_c = gl.program_id(0)
    split = gl.program_id(1)
    groups = K // 32
    first = split * span
    last = gl.minimum(first + span, groups)
    n = last - first
    c0 = pid_c * CB
    blk = c0 // 32
    lane0 = c0 % 32
    wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 32, CB], wd.layout)
    sbuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8, CB], sd.layout)
    obuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8, CB], od.layout)
    xbuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 32, 32], xd.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    NB: gl.constexpr = 32 * CB * 4 + 2 * 8 * CB * 2 + 32 * 32 * 2
    for i in gl.static_range(STAGES - 1):
        pred = i < n
        g = first + i
        bar = bars.index(i)
        mbarrier.expect(bar, NB, pred=pred)
        tma.async_copy_global_to_shared(
            wd, [blk * K + g * 32, lane0], bar, wbuf.index(i), pred=pred
        )
        tma.async_copy_global_to_shared(
            sd, [(blk * groups + g) * 8, lane0], bar, sbuf.index(i), pred=pred
        )
        tma.async_copy_global_to_shared(
            od, [(blk * groups + g) * 8, lane0], bar, obuf.index(i), pred=pred
        )
        tma.async_copy_global_to_shared(xd, [0, g * 32], bar, xbuf.index(i), pred=pred)
    LW: gl.constexpr = gl.SliceLayout(2, L3)
    LM: gl.constexpr = gl.SliceLayout(0, L3P)
    LWP: gl.constexpr = gl.SliceLayout(2, L3P)
    p_m = gl.arange(0, 8, layout=gl.SliceLayout(0, LM))
    sh3 = gl.expand_dims(gl.expand_dims(p_m, 0), 0)
    sel = (sh3 // 2) | ((sh3 // 2 + 4) << 8)
    nsh = (sh3 % 2) * 4
    acc = gl.zeros([32, CB * 8], gl.float32, MMA)
    for t in range(n):
        nt = t + STAGES - 1
        slot_n = nt % STAGES
        pred = nt < n
        gl.thread_barrier()  # every warp is done with slot_n (read at t - 1)
        g = first + nt
        bar = bars.index(slot_n)
        mbarrier.expect(bar, NB, pred=pred)
        tma.async_copy_global_to_shared(
            wd, [blk * K + g * 32, lane0], bar, wbuf.index(slot_n), pred=pred
        )
        tma.async_copy_global_to_shared(
            sd, [(blk * groups + g) * 8, lane0], bar, sbuf.index(slot_n), pred=pred
        )
        tma.async_copy_global_to_shared(
            od, [(blk * groups + g) * 8, lane0], bar, obuf.index(slot_n), pred=pred
        )
        tma.async_copy_global_to_shared(xd, [0, g * 32], bar, xbuf.index(slot_n), pred=pred)
        slot = t % STAGES
        mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
        words = wbuf.index(slot).load(LW)
        s = sbuf.index(slot).permute([1, 0]).load(LM)
        o = obuf.index(slot).permute([1, 0]).load(LM)
        xa = xbuf.index(slot).load(A_L)
        w4 = gl.permute(gl.reshape(words, [16, 2, CB]), [0, 2, 1])
        we, wo = gl.split(w4)
        we3 = gl.expand_dims(gl.convert_layout(we, LWP), 2)
        wo3 = gl.expand_dims(gl.convert_layout(wo, LWP), 2)
        s3 = gl.expand_dims(s, 0)
        o3 = gl.expand_dims(o, 0)
        lo, hi = gl.inline_asm_elementwise(
            "{ .reg .b32 t, s2, o2, c;\n"
            "prmt.b32 t, $2, $3, $4;\n"
            "shr.b32 t, t, $5;\n"
            "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;\n"
            "mov.b32 c, 0x43004300;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "mov.b32 s2, {$6, $6};\n"
            "mov.b32 o2, {$7, $7};\n"
            "fma.rn.bf16x2 t, t, s2, o2;\n"
            "mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r,r,h,h",
            [we3, wo3, sel, nsh, s3, o3],
            dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1,
        )  # fmt: skip
        w = gl.join(lo, hi)
        w = gl.permute(w, [0, 3, 1, 2])
        w = gl.reshape(w, [16, 2, CB // 4, 4, 8])
        w = gl.permute(w, [0, 1, 3, 2, 4])
        w = gl.reshape(w, [32, CB * 8])
        wb = gl.convert_layout(w, B_L)
        acc = mma_v2(xa, wb, acc)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    rn = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    nn = gl.arange(0, CB * 8, layout=gl.SliceLayout(0, MMA))
    c_of = ((nn // 8) % (CB // 4)) * 4 + nn // (8 * (CB // 4))
    out = (c0 + c_of) * 8 + nn % 8
    y_ptrs = y_ptr + rn[:, None] * N + out[None, :]
    gl.atomic_add(y_ptrs, acc, mask=(rn[:, None] < rows) & (out[None, :] < N), sem="relaxed")


class MmaTma:
    def __init__(self, packed, x, programs=528, stages=6):
        n, k = packed.shape
        self.C = packed.columns
        self.n, self.k, self.stages = n, k, stages
        w2 = packed.words.view(-1, 32)
        s2 = packed.scales.view(-1, 32)
        o2 = packed.offsets.view(-1, 32)
        self.wd = TensorDescriptor(w2, list(w2.shape), list(w2.stride()), [32, CB], SL_W)
        self.sd = TensorDescriptor(s2, list(s2.shape), list(s2.stride()), [8, CB], SL_H)
        self.od = TensorDescriptor(o2, list(o2.shape), list(o2.stride()), [8, CB], SL_H)
        self.xd = TensorDescriptor(x, list(x.shape), list(x.stride()), [32, 32], SL_H)
        self.blocks = triton.cdiv(self.C, CB)
        groups = k // 32
        split = max(1, min(groups, programs // self.blocks))
        self.span = triton.cdiv(groups, split)
        self.split = triton.cdiv(groups, self.span)
        self.rows = x.shape[0]

    def __call__(self, y32):
        _mma_gemm_tma_kernel[(self.blocks, self.split)](
            self.wd, self.sd, self.od, self.xd, y32, self.rows, self.n, self.C, self.k,
            self.span, CB=CB, STAGES=self.stages, L3=L3, L3P=L3P, A_L=A_L, B_L=B_L, MMA=MMA,
            num_warps=W,
        )  # fmt: skip
        return y32


def main() -> int:
    from worker.device.kernels import quant_matmul as qm
    from worker.layers import quant as Q

    sys.path.insert(0, ".dev")
    from tma_gemv import graph_us

    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [("qkv", 16384, 5376), ("o", 5376, 8192), ("gate_up", 43008, 5376),
              ("down", 5376, 21504)]  # fmt: skip
    copies = 8
    total_a, total_b = {}, 0.0
    for name, n, k in shapes:
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        qw = Q.quantize(w, Q.QuantFormat("int4", 32), search=False)
        base = qm.KMajorWeight.pack(qw, torch.bfloat16)
        del w, qw
        mats = [base] + [qm.KMajorWeight(base.kind, base.shape, base.group_size, base.words.clone(),
                                         base.scales.clone(), base.offsets.clone(), block=base.block,
                                         width=base.width) for _ in range(copies - 1)]  # fmt: skip
        for m in mats[1:]:
            m.counters(1)
        x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
        y32 = torch.zeros(M, n, device=dev, dtype=torch.float32)
        got = mma_gemm(x, base, y32)
        want = qm.qgemm(x, base, TILE).float()
        err = (got - want).abs().max().item() / want.abs().max().item()
        ys = [torch.zeros(M, n, device=dev, dtype=torch.float32) for _ in mats]

        def ref():
            for m in mats:
                qm.qgemm(x, m, TILE)

        b = graph_us(ref) / copies
        total_b += b
        line = f"{name}: rel err {err:.2e}; qgemm {b:.1f} us ({base.nbytes / b / 1e6:.2f} TB/s)"
        for programs in PROGRAMS:
            progs, stages = programs
            runners = [MmaTma(m, x, progs, stages) for m in mats]
            if programs == PROGRAMS[0]:
                y0 = torch.zeros(M, n, device=dev, dtype=torch.float32)
                err2 = (runners[0](y0) - want).abs().max().item() / want.abs().max().item()
                line += f"; tma rel err {err2:.2e}"

            def ours(runners=runners):
                for r, yy in zip(runners, ys, strict=True):
                    yy.zero_()
                    r(yy)

            a = graph_us(ours) / copies
            total_a[programs] = total_a.get(programs, 0.0) + a
            line += f"; mma.sync {programs}: {a:.1f} us ({base.nbytes / a / 1e6:.2f} TB/s)"
        print(line, flush=True)
    print(f"layer: qgemm {total_b:.1f} us; mma.sync " + ", ".join(
        f"{p} programs {t:.1f} us" for p, t in total_a.items()), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
