# ruff: noqa
"""Session 25 prototype: the 32-row int4 g32 GEMM on warpgroup MMA (wgmma) with the weights as
the A operand **from registers** (M = outputs, N = the 32 rows, K = inputs) and x as B from
shared memory. The words are stored in A's register-fragment order: a thread's 32-bit word is
its 8 bf16 values of one m16 x k16 fragment (pairs i = dr + 2 dk at bits (4 i, 16 + 4 i), the
low half k, the high half k + 1), so a 16-byte load is 32 weights it uses and a pair costs
LOP3 (0x43004300 magic) + HSUB2 + HFMA2. Accumulators: 16 fp32 a thread per 64 outputs.

Program: WG warpgroups, 64 R WG outputs, K in chunks of KG groups of 32; outputs added into
an fp32 y by atomics (a prototype: not deterministic).

python3 tools/proto_rs_wgmma.py --check                 (CPU: the packing and the kernel's index chain)
python3 tools/proto_rs_wgmma.py SPEC[,SPEC..] [ROWS]   (GPU: error against the exact product and
                                                        us per matrix, beside qgemm / qgemv)
python3 tools/proto_rs_wgmma.py --one SPEC SHAPE ROWS  (three calls of one variant, for ncu)

SPEC: R:KG:programs:wait:WG:D:stream:maxnreg:stages[:bn] (`_rs_gemm_kernel`: x through registers
into shared memory, or cp.async stages), T:R:KG:S:stream:programs:bn:maxnreg (`_rs_tma_kernel`:
x by TMA), W:R:KG:S:programs:bn:maxnreg[:wait] (`_rs_ws_kernel`: a TMA producer warp beside one
consumer warpgroup), V:R:KG:S:programs:bn:maxnreg:cregs (`_rs_ws2_kernel`: two consumer
warpgroups sharing the producer's stages). Session 25 ran R/T variants (s25r1-r5, BENCHMARKS
"Gemma 4 31B on one H200, session 25"); W and V were compiled offline only.
"""

from __future__ import annotations

import sys

import torch


def _index(R: int, KG: int, WG: int = 1):
    """(m, k, bit) of each nibble in one (block, chunk) tile, dims (w, g, t, kg, r, ks, h, dr, dk)
    in memory order of the words [w, g, t, kg, r, ks] (a thread = (w, g, t))."""
    shape = (4 * WG, 8, 4, KG, R, 2, 2, 2, 2)

    def ax(n, d):
        v = [1] * len(shape)
        v[d] = n
        return torch.arange(n).view(v)

    w, g, t, kg, r, ks, h, dr, dk = (ax(n, d) for d, n in enumerate(shape))
    m = r * 64 * WG + w * 16 + dr * 8 + g
    k = kg * 32 + ks * 16 + dk * 8 + t * 2 + h
    bit = 4 * (dr + 2 * dk) + 16 * h
    return m.expand(shape), k.expand(shape), bit.expand(shape)


def _meta_index(R: int, KG: int, WG: int = 1):
    """(m, group in chunk) of each meta int32, dims (w, g, kg, r, dr) (memory order)."""
    shape = (4 * WG, 8, KG, R, 2)

    def ax(n, d):
        v = [1] * len(shape)
        v[d] = n
        return torch.arange(n).view(v)

    w, g, kg, r, dr = (ax(n, d) for d, n in enumerate(shape))
    m = r * 64 * WG + w * 16 + dr * 8 + g
    return m.expand(shape), kg.expand(shape)


def pack(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, R: int, KG: int, WG: int = 1
):
    """codes uint8 [N, K] (0..15), scales/offsets [N, K / 32] -> words int32
    [N / 64R, K / 32KG, 4, 8, 4, KG, R, 2] and meta int32 [N / 64R, K / 32KG, 4, 8, KG, R, 2]
    (bf16 scale in the low half, bf16 offset in the high half)."""
    n_out, k_in = codes.shape
    bm, bk = 64 * R * WG, 32 * KG
    assert n_out % bm == 0 and k_in % bk == 0
    nb, nc = n_out // bm, k_in // bk
    m, k, bit = (v.to(codes.device) for v in _index(R, KG, WG))
    tiles = codes.view(nb, bm, nc, bk).permute(0, 2, 1, 3)  # [nb, nc, m, k]
    q = tiles[:, :, m, k].to(torch.int64)  # [nb, nc, 4, 8, 4, KG, R, 2, 2, 2, 2]
    word = (q << bit).sum(dim=(-1, -2, -3))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)

    def b16(v: torch.Tensor) -> torch.Tensor:
        return v.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF

    both = b16(scales) | (b16(offsets) << 16)  # [N, G]
    both = torch.where(both >= 2**31, both - 2**32, both).to(torch.int32)
    mm, kg = (v.to(codes.device) for v in _meta_index(R, KG, WG))
    tb = both.view(nb, bm, nc, KG).permute(0, 2, 1, 3)  # [nb, nc, m, kg]
    meta = tb[:, :, mm, kg]  # [nb, nc, 4, 8, KG, R, 2]
    return word.contiguous(), meta.contiguous()


def emulate(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor, R: int, KG: int, n: int,
            k: int, WG: int = 1) -> torch.Tensor:  # fmt: skip
    """y = x @ W^T from the packed tensors by the kernel's own chain (CPU, fp32 math with the
    kernel's bf16 roundings): per (block, chunk) the thread tensors [128, KG, R, 2] of words
    and meta, the pairs, the joins and the permute into A [64R, 32KG]."""
    nb, nc = n // (64 * R * WG), k // (32 * KG)
    T = 128 * WG
    y = torch.zeros(x.shape[0], n)
    for b in range(nb):
        acc = torch.zeros(64 * R * WG, x.shape[0])
        for c in range(nc):
            wv = words[b, c].reshape(T, KG, R, 2).to(torch.int64) & 0xFFFFFFFF  # (.., ks)
            mv = meta[b, c].reshape(T // 4, KG, R, 2).to(torch.int64) & 0xFFFFFFFF  # (w g, .., dr)
            mv = mv.repeat_interleave(4, dim=0)  # the 4 lanes t of a (w, g) load the same
            s = [_bf(mv[..., dr] & 0xFFFF) for dr in range(2)]  # [128, KG, R]
            o = [_bf(mv[..., dr] >> 16) for dr in range(2)]
            vals = {}
            for dr in range(2):
                for dk in range(2):
                    for h in range(2):
                        code = ((wv >> (4 * (dr + 2 * dk) + 16 * h)) & 15).float()
                        v = code * s[dr][..., None] + o[dr][..., None]  # one fma, bf16 out
                        vals[(h, dr, dk)] = v.to(torch.bfloat16).float()
            p = [torch.stack([vals[(0, i % 2, i // 2)], vals[(1, i % 2, i // 2)]], -1)
                 for i in range(4)]  # fmt: skip
            q0 = torch.stack([p[0], p[1]], -1)  # (.., h, dr) dk = 0
            q1 = torch.stack([p[2], p[3]], -1)
            rr = torch.stack([q0, q1], -1)  # [128, KG, R, ks, h, dr, dk]
            rr = rr.reshape(4 * WG, 8, 4, KG, R, 2, 2, 2, 2)  # (w, g, t, kg, r, ks, h, dr, dk)
            a = rr.permute(4, 0, 7, 1, 3, 5, 8, 2, 6).reshape(64 * R * WG, 32 * KG)
            xs = x[:, c * 32 * KG : (c + 1) * 32 * KG].to(torch.bfloat16).float()
            acc += a @ xs.t()
        y[:, b * 64 * R * WG : (b + 1) * 64 * R * WG] = acc.t()
    return y


def _bf(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def check() -> int:
    torch.manual_seed(0)
    for R, KG, WG in ((2, 2, 1), (1, 1, 1), (4, 2, 1), (2, 2, 2), (1, 2, 2)):
        n, k = 64 * R * WG * 2, 32 * KG * 3
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        s = (torch.rand(n, k // 32) * 0.01).to(torch.bfloat16).float()
        o = (torch.randn(n, k // 32) * 0.01).to(torch.bfloat16).float()
        words, meta = pack(codes, s, o, R, KG, WG)
        x = torch.randn(5, k)
        w = codes.float().view(n, k // 32, 32) * s[..., None] + o[..., None]
        exact = x.to(torch.bfloat16).float() @ w.view(n, k).t()
        got = emulate(x, words, meta, R, KG, n, k, WG)
        err = (got - exact).abs().max().item() / exact.abs().max().item()
        assert err < 1e-2, (R, KG, err)
        print(
            f"R {R} KG {KG} WG {WG}: emulated kernel chain matches the product, rel err {err:.1e}"
        )
    return 0


if __name__ == "__main__" and "--check" in sys.argv:
    sys.exit(check())


# ---- the GPU kernel (Gluon) ---------------------------------------------------------------------
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

M = 32

PAIRS_ASM = (
    "{ .reg .b32 c, sa, sb, oa, ob, u, t;\n"
    "mov.b32 c, 0x43004300;\n"
    "prmt.b32 sa, $10, 0, 0x1010;\n"
    "prmt.b32 oa, $10, 0, 0x3232;\n"
    "prmt.b32 sb, $11, 0, 0x1010;\n"
    "prmt.b32 ob, $11, 0, 0x3232;\n"
    + "".join(
        (f"shr.b32 u, ${8 + e}, {4 * i};\n" if i else f"mov.b32 u, ${8 + e};\n")
        + "lop3.b32 t, u, 0x000F000F, 0x43004300, 0xEA;\n"
        + "sub.rn.bf16x2 t, t, c;\n"
        + f"fma.rn.bf16x2 ${2 * i + e}, t, {'sb' if i % 2 else 'sa'}, {'ob' if i % 2 else 'oa'};\n"
        for e in range(2)
        for i in range(4)
    )
    + "}"
)
PAIRS_ASM = gl.constexpr(PAIRS_ASM)
# outputs $0..$7: pair i (= dr + 2 dk) of element e (ks) is $(2 i + e); inputs $8, $9 the two
# words (ks 0, 1), $10, $11 the meta of dr 0, 1 (pack=2 pairs ks with dr: both the last dim)


def layouts(R: int, KG: int, WG: int = 1, BN: int = 32):
    mma = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4 * WG, 1], instr_shape=[16, BN, 16]
    )
    a_l = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    ld = gl.BlockedLayout([1, 2 * R * KG], [32, 1], [4 * WG, 1], [1, 0])
    xl = gl.BlockedLayout([1, 8], [4, 8], [4 * WG, 1], [1, 0])
    xs = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 64 * KG), element_bitwidth=16, rank=2)
    return mma, a_l, ld, xl, xs


SMEM_PLAIN = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])


@gluon.jit
def _rs_gemm_kernel(x_ptr, w_ptr, m_ptr, y_ptr, rows, N, K, span, R: gl.constexpr,
                    KG: gl.constexpr, MMA: gl.constexpr, A_L: gl.constexpr, LD: gl.constexpr,
                    XL: gl.constexpr, XS: gl.constexpr, WAIT: gl.constexpr, WG: gl.constexpr,
                    D: gl.constexpr, STREAM: gl.constexpr, S: gl.constexpr = 0,
                    SMEM_L: gl.constexpr = None):  # fmt: skip
    """STREAM: the grid is P programs, each taking an equal run of the (block, chunk) units in
    block order (stream-K), flushing its accumulator at each block end; else the grid is
    (blocks, splits) and ``span`` chunks a split."""
    BK: gl.constexpr = 32 * KG
    J: gl.constexpr = 2 * R * KG  # words (and metas) a thread a chunk
    T: gl.constexpr = 128 * WG  # threads
    tid = gl.arange(0, T, layout=gl.SliceLayout(1, LD))
    jj = gl.arange(0, J, layout=gl.SliceLayout(0, LD))
    w_off = tid[:, None] * J + jj[None, :]
    m_off = (tid // 4)[:, None] * J + jj[None, :]
    BN: gl.constexpr = MMA.instr_shape[1]  # rows of x a program (the MMA's N)
    xr = gl.arange(0, BN, layout=gl.SliceLayout(1, XL))
    xk = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
    x_ptrs = x_ptr + xr[:, None] * K + xk[None, :]
    x_mask = xr[:, None] < rows
    if S > 0:  # cp.async stages: words, metas (each thread its own row), x
        xbuf = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], XS)
        wsm = gl.allocate_shared_memory(gl.int32, [S, T, J], SMEM_L)
        msm = gl.allocate_shared_memory(gl.int32, [S, T, J], SMEM_L)
    else:
        xbuf = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BK], XS)
        wsm = xbuf
        msm = xbuf
    chunks = K // BK
    if STREAM:
        p = gl.program_id(0)
        units = (N // (64 * R * WG)) * chunks
        u = (p * units) // gl.num_programs(0)
        u1 = ((p + 1) * units) // gl.num_programs(0)
        while u < u1:
            b = u // chunks
            first = u - b * chunks
            last = gl.minimum(u1 - b * chunks, chunks)
            if S > 0:
                _segment_cp(
                    x_ptrs,
                    x_mask,
                    w_ptr,
                    m_ptr,
                    y_ptr,
                    rows,
                    N,
                    b,
                    first,
                    last,
                    chunks,
                    w_off,
                    m_off,
                    xbuf,
                    wsm,
                    msm,
                    R,
                    KG,
                    MMA,
                    A_L,
                    LD,
                    WG,
                    S,
                )
            else:
                _segment(
                    x_ptrs,
                    x_mask,
                    w_ptr,
                    m_ptr,
                    y_ptr,
                    rows,
                    N,
                    b,
                    first,
                    last,
                    chunks,
                    w_off,
                    m_off,
                    xbuf,
                    R,
                    KG,
                    MMA,
                    A_L,
                    WAIT,
                    WG,
                    D,
                )
            u = b * chunks + last
    else:
        b = gl.program_id(0)
        first = gl.program_id(1) * span
        last = gl.minimum(first + span, chunks)
        if S > 0:
            _segment_cp(
                x_ptrs,
                x_mask,
                w_ptr,
                m_ptr,
                y_ptr,
                rows,
                N,
                b,
                first,
                last,
                chunks,
                w_off,
                m_off,
                xbuf,
                wsm,
                msm,
                R,
                KG,
                MMA,
                A_L,
                LD,
                WG,
                S,
            )
        else:
            _segment(
                x_ptrs,
                x_mask,
                w_ptr,
                m_ptr,
                y_ptr,
                rows,
                N,
                b,
                first,
                last,
                chunks,
                w_off,
                m_off,
                xbuf,
                R,
                KG,
                MMA,
                A_L,
                WAIT,
                WG,
                D,
            )


@gluon.jit
def _segment(x_ptrs, x_mask, w_ptr, m_ptr, y_ptr, rows, N, b, first, last, chunks,
             w_off, m_off, xbuf, R: gl.constexpr, KG: gl.constexpr, MMA: gl.constexpr,
             A_L: gl.constexpr, WAIT: gl.constexpr, WG: gl.constexpr, D: gl.constexpr):  # fmt: skip
    """Chunks first..last-1 of output block b, added into y (fp32 atomics)."""
    BK: gl.constexpr = 32 * KG
    J: gl.constexpr = 2 * R * KG
    T: gl.constexpr = 128 * WG
    BM: gl.constexpr = 64 * R * WG  # outputs a program
    BN: gl.constexpr = MMA.instr_shape[1]
    acc = gl.zeros([BM, BN], gl.float32, MMA)
    tile = b * chunks
    wn = gl.load(w_ptr + (tile + first).to(gl.int64) * (T * J) + w_off)
    mn = gl.load(m_ptr + (tile + first).to(gl.int64) * (T // 4 * J) + m_off)
    xn = gl.load(x_ptrs + first * BK, mask=x_mask, other=0.0)
    if D == 2:
        c2 = gl.minimum(first + 1, last - 1)
        wn2 = gl.load(w_ptr + (tile + c2).to(gl.int64) * (T * J) + w_off)
        mn2 = gl.load(m_ptr + (tile + c2).to(gl.int64) * (T // 4 * J) + m_off)
        xn2 = gl.load(x_ptrs + c2 * BK, mask=x_mask, other=0.0)
    for c in range(first, last):
        words, meta, xv = wn, mn, xn
        if D == 2:
            wn, mn, xn = wn2, mn2, xn2
            cn = gl.minimum(c + 2, last - 1)
            wn2 = gl.load(w_ptr + (tile + cn).to(gl.int64) * (T * J) + w_off)
            mn2 = gl.load(m_ptr + (tile + cn).to(gl.int64) * (T // 4 * J) + m_off)
            xn2 = gl.load(x_ptrs + cn * BK, mask=x_mask, other=0.0)
        else:
            cn = gl.minimum(c + 1, last - 1)
            wn = gl.load(w_ptr + (tile + cn).to(gl.int64) * (T * J) + w_off)
            mn = gl.load(m_ptr + (tile + cn).to(gl.int64) * (T // 4 * J) + m_off)
            xn = gl.load(x_ptrs + cn * BK, mask=x_mask, other=0.0)
        buf = xbuf.index(c % 2)
        buf.store(xv)
        fence_async_shared()
        gl.thread_barrier()
        w4 = gl.reshape(words, [T, KG, R, 2])
        m4 = gl.reshape(meta, [T, KG, R, 2])
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w4, m4],
            dtype=(gl.int32,) * 4, is_pure=True, pack=2,
        )  # fmt: skip
        a = _assemble(p0, p1, p2, p3, R, KG, WG)
        a = gl.convert_layout(a, A_L)
        acc = warpgroup_mma(a, buf.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=WAIT, deps=[acc])
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    rn = gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    cm = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    out = b * BM + rn
    y_ptrs = y_ptr + cm[None, :] * N + out[:, None]
    gl.atomic_add(y_ptrs, acc, mask=(cm[None, :] < rows) & (out[:, None] < N), sem="relaxed")


@gluon.jit
def _segment_cp(x_ptrs, x_mask, w_ptr, m_ptr, y_ptr, rows, N, b, first, last, chunks,
                w_off, m_off, xbuf, wsm, msm, R: gl.constexpr, KG: gl.constexpr,
                MMA: gl.constexpr, A_L: gl.constexpr, LD: gl.constexpr, WG: gl.constexpr,
                S: gl.constexpr):  # fmt: skip
    """The same segment with its chunks brought by cp.async, S stages deep: words and metas
    (each thread copies its own row, the 4 lanes of a meta row the same bytes) and x."""
    BK: gl.constexpr = 32 * KG
    J: gl.constexpr = 2 * R * KG
    T: gl.constexpr = 128 * WG
    BM: gl.constexpr = 64 * R * WG
    BN: gl.constexpr = MMA.instr_shape[1]
    acc = gl.zeros([BM, BN], gl.float32, MMA)
    tile = b * chunks
    for i in gl.static_range(S - 1):
        ci = gl.minimum(first + i, last - 1)
        async_copy.async_copy_global_to_shared(
            wsm.index(i), w_ptr + (tile + ci).to(gl.int64) * (T * J) + w_off
        )
        async_copy.async_copy_global_to_shared(
            msm.index(i), m_ptr + (tile + ci).to(gl.int64) * (T // 4 * J) + m_off
        )
        async_copy.async_copy_global_to_shared(xbuf.index(i), x_ptrs + ci * BK, mask=x_mask)
        async_copy.commit_group()
    for c in range(first, last):
        async_copy.wait_group(S - 2)
        gl.thread_barrier()
        fence_async_shared()
        st = (c - first) % S
        cn = gl.minimum(c + S - 1, last - 1)
        sn = (c - first + S - 1) % S
        async_copy.async_copy_global_to_shared(
            wsm.index(sn), w_ptr + (tile + cn).to(gl.int64) * (T * J) + w_off
        )
        async_copy.async_copy_global_to_shared(
            msm.index(sn), m_ptr + (tile + cn).to(gl.int64) * (T // 4 * J) + m_off
        )
        async_copy.async_copy_global_to_shared(xbuf.index(sn), x_ptrs + cn * BK, mask=x_mask)
        async_copy.commit_group()
        words = wsm.index(st).load(LD)
        meta = msm.index(st).load(LD)
        w4 = gl.reshape(words, [T, KG, R, 2])
        m4 = gl.reshape(meta, [T, KG, R, 2])
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w4, m4],
            dtype=(gl.int32,) * 4, is_pure=True, pack=2,
        )  # fmt: skip
        a = _assemble(p0, p1, p2, p3, R, KG, WG)
        a = gl.convert_layout(a, A_L)
        acc = warpgroup_mma(a, xbuf.index(st).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    async_copy.wait_group(0)
    gl.thread_barrier()
    rn = gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    cm = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    out = b * BM + rn
    y_ptrs = y_ptr + cm[None, :] * N + out[:, None]
    gl.atomic_add(y_ptrs, acc, mask=(cm[None, :] < rows) & (out[:, None] < N), sem="relaxed")


@gluon.jit
def _rs_tma_kernel(x_desc, w_ptr, m_ptr, y_ptr, N, K, span, R: gl.constexpr, KG: gl.constexpr,
                   MMA: gl.constexpr, A_L: gl.constexpr, LD: gl.constexpr, S: gl.constexpr,
                   STREAM: gl.constexpr):  # fmt: skip
    """One warpgroup a program; x's chunks by TMA into S stages (mbarriers: no CTA barrier),
    the words and metas by register loads one chunk ahead. Grids as ``_rs_gemm_kernel``."""
    BK: gl.constexpr = 32 * KG
    J: gl.constexpr = 2 * R * KG
    tid = gl.arange(0, 128, layout=gl.SliceLayout(1, LD))
    jj = gl.arange(0, J, layout=gl.SliceLayout(0, LD))
    w_off = tid[:, None] * J + jj[None, :]
    m_off = (tid // 4)[:, None] * J + jj[None, :]
    BN: gl.constexpr = MMA.instr_shape[1]
    xbuf = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(bars.index(i), count=1)
    chunks = K // BK
    it = gl.program_id(0) * 0
    if STREAM:
        p = gl.program_id(0)
        units = (N // (64 * R)) * chunks
        u = (p * units) // gl.num_programs(0)
        u1 = ((p + 1) * units) // gl.num_programs(0)
        while u < u1:
            b = u // chunks
            first = u - b * chunks
            last = gl.minimum(u1 - b * chunks, chunks)
            it = _segment_tma(
                x_desc,
                w_ptr,
                m_ptr,
                y_ptr,
                N,
                b,
                first,
                last,
                chunks,
                w_off,
                m_off,
                xbuf,
                bars,
                it,
                R,
                KG,
                MMA,
                A_L,
                S,
            )
            u = b * chunks + last
    else:
        b = gl.program_id(0)
        first = gl.program_id(1) * span
        last = gl.minimum(first + span, chunks)
        it = _segment_tma(
            x_desc,
            w_ptr,
            m_ptr,
            y_ptr,
            N,
            b,
            first,
            last,
            chunks,
            w_off,
            m_off,
            xbuf,
            bars,
            it,
            R,
            KG,
            MMA,
            A_L,
            S,
        )
    for i in gl.static_range(S):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _segment_tma(x_desc, w_ptr, m_ptr, y_ptr, N, b, first, last, chunks, w_off, m_off, xbuf,
                 bars, it0, R: gl.constexpr, KG: gl.constexpr, MMA: gl.constexpr,
                 A_L: gl.constexpr, S: gl.constexpr):  # fmt: skip
    BK: gl.constexpr = 32 * KG
    J: gl.constexpr = 2 * R * KG
    BM: gl.constexpr = 64 * R
    BN: gl.constexpr = MMA.instr_shape[1]
    XB: gl.constexpr = BN * BK * 2
    n = last - first
    for q in gl.static_range(S - 1):
        sl = (it0 + q) % S
        mbarrier.expect(bars.index(sl), XB, pred=q < n)
        tma.async_copy_global_to_shared(x_desc, [0, (first + q) * BK], bars.index(sl),
                                        xbuf.index(sl), pred=q < n)  # fmt: skip
    acc = gl.zeros([BM, BN], gl.float32, MMA)
    tile = b * chunks
    wn = gl.load(w_ptr + (tile + first).to(gl.int64) * (128 * J) + w_off)
    mn = gl.load(m_ptr + (tile + first).to(gl.int64) * (32 * J) + m_off)
    for c in range(first, last):
        i = c - first
        it = it0 + i
        words, meta = wn, mn
        cn = gl.minimum(c + 1, last - 1)
        wn = gl.load(w_ptr + (tile + cn).to(gl.int64) * (128 * J) + w_off)
        mn = gl.load(m_ptr + (tile + cn).to(gl.int64) * (32 * J) + m_off)
        sn = (it + S - 1) % S  # read by the MMA before, waited for
        mbarrier.expect(bars.index(sn), XB, pred=i + S - 1 < n)
        tma.async_copy_global_to_shared(x_desc, [0, (c + S - 1) * BK], bars.index(sn),
                                        xbuf.index(sn), pred=i + S - 1 < n)  # fmt: skip
        w4 = gl.reshape(words, [128, KG, R, 2])
        m4 = gl.reshape(meta, [128, KG, R, 2])
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w4, m4],
            dtype=(gl.int32,) * 4, is_pure=True, pack=2,
        )  # fmt: skip
        a = gl.convert_layout(_assemble(p0, p1, p2, p3, R, KG, 1), A_L)
        sl = it % S
        mbarrier.wait(bars.index(sl), (it // S) & 1)
        acc = warpgroup_mma(a, xbuf.index(sl).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    rn = gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    cm = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    out = b * BM + rn
    y_ptrs = y_ptr + cm[None, :] * N + out[:, None]
    gl.atomic_add(y_ptrs, acc, mask=(out[:, None] < N) & (cm[None, :] < BN), sem="relaxed")
    return it0 + n


@gluon.jit
def _rs_ws_kernel(x_desc, w_ptr, m_ptr, y_ptr, N, K, span, R: gl.constexpr, KG: gl.constexpr,
                  MMA: gl.constexpr, A_L: gl.constexpr, LD: gl.constexpr, S: gl.constexpr,
                  WAIT: gl.constexpr = 0):  # fmt: skip
    """Warp-specialized: one producer warp brings x's chunks by TMA into S stages (ready /
    empty mbarriers); the consumer warpgroup loads its words, dequantizes and runs the MMA
    with no CTA barrier in its loop. Grid (blocks, splits)."""
    BK: gl.constexpr = 32 * KG
    BN: gl.constexpr = MMA.instr_shape[1]
    xbuf = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    chunks = K // BK
    b = gl.program_id(0)
    first = gl.program_id(1) * span
    last = gl.minimum(first + span, chunks)
    gl.warp_specialize([
        (_ws_consumer, (w_ptr, m_ptr, y_ptr, N, b, first, last, chunks, xbuf, ready, empty, R, KG,
                        MMA, A_L, LD, S, WAIT)),
        (_ws_producer, (x_desc, xbuf, ready, empty, first, last, BK, S)),
    ], [1], [40])  # fmt: skip


@gluon.jit
def _rs_ws2_kernel(x_desc, w_ptr, m_ptr, y_ptr, N, K, span, R: gl.constexpr, KG: gl.constexpr,
                   MMA: gl.constexpr, A_L: gl.constexpr, LD: gl.constexpr, S: gl.constexpr,
                   CREGS: gl.constexpr):  # fmt: skip
    """Two consumer warpgroups (blocks 2 p and 2 p + 1) over the same K range, sharing one TMA
    producer warp's x stages (empty barriers count both): while one waits on its MMA the
    other dequantizes, and x is read once for 2 x 64 R outputs. Grid (ceil(blocks / 2), splits)."""
    BK: gl.constexpr = 32 * KG
    BN: gl.constexpr = MMA.instr_shape[1]
    xbuf = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    chunks = K // BK
    b = gl.program_id(0) * 2
    first = gl.program_id(1) * span
    last = gl.minimum(first + span, chunks)
    gl.warp_specialize([
        (_ws_consumer, (w_ptr, m_ptr, y_ptr, N, b, first, last, chunks, xbuf, ready, empty, R, KG,
                        MMA, A_L, LD, S, 0)),
        (_ws_consumer, (w_ptr, m_ptr, y_ptr, N, b + 1, first, last, chunks, xbuf, ready, empty, R,
                        KG, MMA, A_L, LD, S, 0)),
        (_ws_producer, (x_desc, xbuf, ready, empty, first, last, BK, S)),
    ], [4, 1], [CREGS, 40])  # fmt: skip


@gluon.jit
def _ws_producer(x_desc, xbuf, ready, empty, first, last, BK: gl.constexpr, S: gl.constexpr):
    XB: gl.constexpr = xbuf.type.shape[1] * BK * 2
    for c in range(first, last):
        i = c - first
        sl = i % S
        mbarrier.wait(empty.index(sl), ((i // S) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(sl), XB)
        tma.async_copy_global_to_shared(x_desc, [0, c * BK], ready.index(sl), xbuf.index(sl))


@gluon.jit
def _ws_consumer(w_ptr, m_ptr, y_ptr, N, b, first, last, chunks, xbuf, ready, empty,
                 R: gl.constexpr, KG: gl.constexpr, MMA: gl.constexpr, A_L: gl.constexpr,
                 LD: gl.constexpr, S: gl.constexpr, WAIT: gl.constexpr):  # fmt: skip
    """WAIT 1: one MMA left in flight while the next step dequantizes; its A is carried into the
    next wait's deps so its registers stay reserved until that MMA is done, and its stage is
    released one step late."""
    J: gl.constexpr = 2 * R * KG
    BM: gl.constexpr = 64 * R
    BN: gl.constexpr = MMA.instr_shape[1]
    tid = gl.arange(0, 128, layout=gl.SliceLayout(1, LD))
    jj = gl.arange(0, J, layout=gl.SliceLayout(0, LD))
    w_off = tid[:, None] * J + jj[None, :]
    m_off = (tid // 4)[:, None] * J + jj[None, :]
    acc = gl.zeros([BM, BN], gl.float32, MMA)
    tile = b * chunks
    wn = gl.load(w_ptr + (tile + first).to(gl.int64) * (128 * J) + w_off)
    mn = gl.load(m_ptr + (tile + first).to(gl.int64) * (32 * J) + m_off)
    a_keep = gl.zeros([BM, 32 * KG], gl.bfloat16, A_L)
    for c in range(first, last):
        i = c - first
        words, meta = wn, mn
        cn = gl.minimum(c + 1, last - 1)
        wn = gl.load(w_ptr + (tile + cn).to(gl.int64) * (128 * J) + w_off)
        mn = gl.load(m_ptr + (tile + cn).to(gl.int64) * (32 * J) + m_off)
        w4 = gl.reshape(words, [128, KG, R, 2])
        m4 = gl.reshape(meta, [128, KG, R, 2])
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w4, m4],
            dtype=(gl.int32,) * 4, is_pure=True, pack=2,
        )  # fmt: skip
        a = gl.convert_layout(_assemble(p0, p1, p2, p3, R, KG, 1), A_L)
        sl = i % S
        mbarrier.wait(ready.index(sl), (i // S) & 1)
        acc = warpgroup_mma(a, xbuf.index(sl).permute((1, 0)), acc, is_async=True)
        if WAIT == 0:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(empty.index(sl), count=1)
        else:
            acc, a_keep = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a_keep])
            mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
            a_keep = a
    if WAIT != 0:
        acc, a_keep = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a_keep])
        mbarrier.arrive(empty.index((last - first + S - 1) % S), count=1, pred=last > first)
    rn = gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    cm = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    out = b * BM + rn
    y_ptrs = y_ptr + cm[None, :] * N + out[:, None]
    gl.atomic_add(y_ptrs, acc, mask=(out[:, None] < N) & (cm[None, :] < BN), sem="relaxed")


@gluon.jit
def _halves(p):
    """int32 pairs -> (bf16 low half, bf16 high half): register renames."""
    lo, hi = gl.inline_asm_elementwise(
        "mov.b32 {$0, $1}, $2;", "=h,=h,r", [p], dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True, pack=1,
    )  # fmt: skip
    return gl.join(lo, hi)  # (.., h)


@gluon.jit
def _assemble(p0, p1, p2, p3, R: gl.constexpr, KG: gl.constexpr, WG: gl.constexpr):
    """Pairs [128, KG, R, 2 ks] (i = dr + 2 dk) -> A [64 R, 32 KG] (m = r 64 + w 16 + dr 8 + g,
    k = kg 32 + ks 16 + dk 8 + t 2 + h)."""
    q0 = gl.join(_halves(p0), _halves(p1))  # (.., ks, h, dr) dk 0
    q1 = gl.join(_halves(p2), _halves(p3))
    r = gl.join(q0, q1)  # [128, KG, R, ks, h, dr, dk]
    r = gl.reshape(r, [4 * WG, 8, 4, KG, R, 2, 2, 2, 2])  # (w, g, t, kg, r, ks, h, dr, dk)
    r = gl.permute(r, [4, 0, 7, 1, 3, 5, 8, 2, 6])
    return gl.reshape(r, [64 * R * WG, 32 * KG])


class RsGemm:
    def __init__(
        self,
        qw,
        R: int = 2,
        KG: int = 2,
        programs: int = 528,
        wait: int = 0,
        WG: int = 1,
        D: int = 1,
        stream: int = 0,
        maxnreg: int = 0,
        stages: int = 0,
        bn: int = 32,
    ):
        from worker.layers.quant import unpack_nibbles

        n, k = qw.shape
        codes = unpack_nibbles(qw.qdata)
        words, meta = pack(codes, qw.scales.float(), qw.offsets.float(), R, KG, WG)
        dev = qw.qdata.device
        self.words, self.meta = words.to(dev), meta.to(dev)
        self.n, self.k, self.R, self.KG, self.wait, self.WG, self.D = n, k, R, KG, wait, WG, D
        self.blocks = n // (64 * R * WG)
        chunks = k // (32 * KG)
        split = max(1, min(chunks, programs // self.blocks))
        self.span = triton.cdiv(chunks, split)
        self.split = triton.cdiv(chunks, self.span)
        self.lay = layouts(R, KG, WG, bn)
        self.stream = stream  # > 0: a stream-K grid of this many programs
        self.stages = stages
        self.opts = {"maxnreg": maxnreg} if maxnreg else {}

    def __call__(self, x, y32):
        mma, a_l, ld, xl, xs = self.lay
        grid = (self.stream,) if self.stream else (self.blocks, self.split)
        _rs_gemm_kernel[grid](
            x, self.words, self.meta, y32, x.shape[0], self.n, self.k, self.span,
            R=self.R, KG=self.KG, MMA=mma, A_L=a_l, LD=ld, XL=xl, XS=xs, WAIT=self.wait,
            WG=self.WG, D=self.D, STREAM=bool(self.stream), S=self.stages, SMEM_L=SMEM_PLAIN,
            num_warps=4 * self.WG, **self.opts,
        )  # fmt: skip
        return y32


class RsTma:
    """`_rs_tma_kernel`: one warpgroup, x by TMA. stream > 0: a stream-K grid of that many
    programs; else blocks x splits to about ``programs``."""

    def __init__(self, qw, R: int = 2, KG: int = 2, S: int = 4, stream: int = 0,
                 programs: int = 528, bn: int = 32, maxnreg: int = 0):  # fmt: skip
        self.g = RsGemm(qw, R, KG, programs, 0, 1, 1, stream, maxnreg, 0, bn)
        self.words, self.meta = self.g.words, self.g.meta
        self.S, self.bn = S, bn

    def __call__(self, x, y32):
        g = self.g
        mma, a_l, ld, xl, xs = g.lay
        if x.shape[0] < self.bn:  # a TMA box may not pass the tensor's rows
            x = F.pad(x, (0, 0, 0, self.bn - x.shape[0]))
        desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [self.bn, 32 * g.KG], xs)
        grid = (g.stream,) if g.stream else (g.blocks, g.split)
        _rs_tma_kernel[grid](
            desc, self.words, self.meta, y32, g.n, g.k, g.span, R=g.R, KG=g.KG, MMA=mma,
            A_L=a_l, LD=ld, S=self.S, STREAM=bool(g.stream), num_warps=4, **g.opts,
        )  # fmt: skip
        return y32


class RsWs(RsTma):
    """`_rs_ws_kernel`: a TMA producer warp beside the consumer warpgroup; split grid only."""

    def __call__(self, x, y32):
        g = self.g
        mma, a_l, ld, xl, xs = g.lay
        if x.shape[0] < self.bn:  # a TMA box may not pass the tensor's rows
            x = F.pad(x, (0, 0, 0, self.bn - x.shape[0]))
        desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [self.bn, 32 * g.KG], xs)
        _rs_ws_kernel[(g.blocks, g.split)](
            desc, self.words, self.meta, y32, g.n, g.k, g.span, R=g.R, KG=g.KG, MMA=mma,
            A_L=a_l, LD=ld, S=self.S, WAIT=getattr(self, "wait", 0), num_warps=4, **g.opts,
        )  # fmt: skip
        return y32


class RsWs2(RsTma):
    """`_rs_ws2_kernel`: two consumer warpgroups (two blocks) and a TMA producer warp."""

    def __init__(self, qw, R, KG, S, programs, bn, maxnreg, cregs):
        super().__init__(qw, R, KG, S, 0, programs, bn, maxnreg)
        g = self.g
        assert g.blocks % 2 == 0
        chunks = g.k // (32 * KG)
        split = max(1, min(chunks, programs // (g.blocks // 2)))
        g.span = triton.cdiv(chunks, split)
        g.split = triton.cdiv(chunks, g.span)
        self.cregs = cregs

    def __call__(self, x, y32):
        g = self.g
        mma, a_l, ld, xl, xs = g.lay
        if x.shape[0] < self.bn:
            x = F.pad(x, (0, 0, 0, self.bn - x.shape[0]))
        desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [self.bn, 32 * g.KG], xs)
        _rs_ws2_kernel[(g.blocks // 2, g.split)](
            desc, self.words, self.meta, y32, g.n, g.k, g.span, R=g.R, KG=g.KG, MMA=mma,
            A_L=a_l, LD=ld, S=self.S, CREGS=self.cregs, num_warps=4, **g.opts,
        )  # fmt: skip
        return y32


def make(qw, spec: str):
    """'T:R:KG:S:stream:programs:bn:maxnreg' (TMA) or the RsGemm fields."""
    v = spec.split(":")
    if v[0] == "V":  # V:R:KG:S:programs:bn:maxnreg:cregs
        R, KG, S, programs, bn, nreg, cregs = (int(t) for t in v[1:])
        return RsWs2(qw, R, KG, S, programs, bn, nreg, cregs), spec
    if v[0] == "W":  # W:R:KG:S:programs:bn:maxnreg[:wait]
        R, KG, S, programs, bn, nreg, wait = (*(int(t) for t in v[1:]), 0)[:7]
        g = RsWs(qw, R, KG, S, 0, programs, bn, nreg)
        g.wait = wait
        return g, spec
    if v[0] == "T":
        R, KG, S, stream, programs, bn, nreg = (int(t) for t in v[1:])
        return RsTma(qw, R, KG, S, stream, programs, bn, nreg), spec
    R, KG, programs, wait, WG, D, stream, nreg, stages, bn = (*(int(t) for t in v), 32)[:10]
    key = f"R{R}/KG{KG}/WG{WG}/{programs}/D{D}/s{stream}/r{nreg}/S{stages}/N{bn}"
    return RsGemm(qw, R, KG, programs, wait, WG, D, stream, nreg, stages, bn), key


def graph_us(fn, reps: int = 20) -> float:
    """us a replay of fn captured in one CUDA graph (best of 5 x reps)."""
    import time

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / reps)
    return min(best) * 1e6


def main() -> int:

    from worker.device.kernels import quant_matmul as qm
    from worker.layers import quant as Q

    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [("qkv", 16384, 5376), ("o", 5376, 8192), ("gate_up", 43008, 5376),
              ("down", 5376, 21504)]  # fmt: skip
    tile = (64, 32, 4, 4, 1, 264)
    M = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    gemv_tiles = {"gate_up": (64, 264, 8, 8)}
    variants = [s for s in
                (sys.argv[1] if len(sys.argv) > 1 else "1:4:0:0:2:1:264:0:0,1:4:0:0:2:1:264:0:4,1:4:0:0:2:1:264:0:3,2:2:0:0:1:1:528:0:4,2:2:0:0:1:1:396:0:6,2:2:528:0:1:1:0:0:4,2:4:0:0:1:1:264:0:4,1:2:0:0:1:1:660:0:4,1:2:0:0:1:1:528:0:6").split(",")]  # fmt: skip
    copies = 8
    totals = {}
    for name, n, k in shapes:
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        qw = Q.quantize(w, Q.QuantFormat("int4", 32), search=False)
        del w
        qw = Q.QuantizedWeight(qw.kind, qw.shape, qw.group_size, qw.qdata,
                               qw.scales.to(torch.bfloat16), qw.offsets.to(torch.bfloat16))  # fmt: skip
        base = qm.KMajorWeight.pack(qw, torch.bfloat16)
        mats = [base] + [qm.KMajorWeight(base.kind, base.shape, base.group_size, base.words.clone(),
                                         base.scales.clone(), base.offsets.clone(), block=base.block,
                                         width=base.width) for _ in range(copies - 1)]  # fmt: skip
        for m in mats[1:]:
            m.counters(1)
        x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
        exact = x.float() @ qw.dequantize().to(dev).t()
        scale = exact.abs().max().item()
        if M == 1:
            gt = gemv_tiles.get(name, qm.GEMV_CONFIG)
            ref = qm.qgemv(x, base, gt).float()
            line = f"{name}: qgemv err {(ref - exact).abs().max().item() / scale:.1e}"
            b = graph_us(lambda: [qm.qgemv(x, m, gt) for m in mats]) / copies
            totals["qgemv"] = totals.get("qgemv", 0.0) + b
        else:
            ref = qm.qgemm(x, base, tile).float()
            line = f"{name}: qgemm err {(ref - exact).abs().max().item() / scale:.1e}"
            b = graph_us(lambda: [qm.qgemm(x, m, tile) for m in mats]) / copies
            totals["qgemm"] = totals.get("qgemm", 0.0) + b
        line += f", {b:.1f} us"
        ys = [torch.zeros(M, n, device=dev, dtype=torch.float32) for _ in range(copies)]
        z = graph_us(lambda: [y.zero_() for y in ys]) / copies
        for v in variants:
            g, key = make(qw, v)
            gs = [g]
            for _ in range(copies - 1):
                c = type(g).__new__(type(g))
                c.__dict__.update(g.__dict__)
                c.words, c.meta = g.words.clone(), g.meta.clone()
                gs.append(c)
            y = g(x, torch.zeros(M, n, device=dev, dtype=torch.float32))
            err = (y - exact).abs().max().item() / scale

            def run(gs=gs):
                for gg, yy in zip(gs, ys, strict=True):
                    yy.zero_()
                    gg(x, yy)

            a = graph_us(run) / copies - z
            totals[key] = totals.get(key, 0.0) + a
            line += f"; {key} err {err:.1e}, {a:.1f} us"
        print(line + f" (memset {z:.1f} us subtracted)", flush=True)
    print("layer: " + ", ".join(f"{k} {v:.1f} us" for k, v in totals.items()), flush=True)
    return 0


def one() -> int:
    """--one SPEC SHAPE ROWS: three calls of one variant on one matrix (for ncu)."""
    from worker.layers import quant as Q

    spec, shape, m_rows = sys.argv[2], sys.argv[3], int(sys.argv[4])
    n, k = {"qkv": (16384, 5376), "o": (5376, 8192), "gate_up": (43008, 5376),
            "down": (5376, 21504)}[shape]  # fmt: skip
    dev = torch.device("cuda")
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    qw = Q.quantize(w, Q.QuantFormat("int4", 32), search=False)
    qw = Q.QuantizedWeight(qw.kind, qw.shape, qw.group_size, qw.qdata,
                           qw.scales.to(torch.bfloat16), qw.offsets.to(torch.bfloat16))  # fmt: skip
    g, _ = make(qw, spec)
    x = torch.randn(m_rows, k, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(m_rows, n, device=dev, dtype=torch.float32)
    for _ in range(3):
        g(x, y)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__" and "--one" in sys.argv:
    sys.exit(one())
if __name__ == "__main__" and "--check" not in sys.argv:
    sys.exit(main())
