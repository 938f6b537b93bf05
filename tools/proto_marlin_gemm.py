# ruff: noqa  (a prototype kept in history only: removed in the next commit)
"""Session 24 prototype: a fragment-ordered int4 g32 layout for mma.sync (m16n8k16, weights as
the B operand) and the 32-row GEMM that reads it. Each thread's 16-byte load is exactly its B
fragments: a 32-bit word holds 4 bf16 pairs (k, k+1) at bits (4i, 16 + 4i), dequantized by
LOP3 (0x43004300 magic) + HSUB2 + HFMA2 a pair, no nibble selection. Each warp owns
[32 rows, 8 T outputs] of accumulators.

python3 tools/proto_marlin_gemm.py --check   (CPU: the packing against the index math of the kernel)
python3 tools/proto_marlin_gemm.py         (GPU: needs tools/proto_tma_gemv.py of 7069b4a beside it as
tma_gemv.py; correctness against qgemm, then us per matrix)
"""

from __future__ import annotations

import sys

import torch

W = 4  # warps a program
M = 32


def _index(T: int):
    """(k, n) in a [32, 32 T] tile of each nibble: dims (warp, s, lane, tp, i, h), where the
    thread's word w_idx = s * (T // 2) + tp holds pairs i at bits (4 i, 16 + 4 i)."""
    warp = torch.arange(W).view(W, 1, 1, 1, 1, 1)
    s = torch.arange(2).view(1, 2, 1, 1, 1, 1)
    lane = torch.arange(32).view(1, 1, 32, 1, 1, 1)
    tp = torch.arange(T // 2).view(1, 1, 1, T // 2, 1, 1)
    i = torch.arange(4).view(1, 1, 1, 1, 4, 1)
    h = torch.arange(2).view(1, 1, 1, 1, 1, 2)
    b, tb = i % 2, i // 2
    t = 2 * tp + tb
    k = 16 * s + 8 * b + 2 * (lane % 4) + h
    n = lane // 4 + 8 * warp + 32 * t
    shape = (W, 2, 32, T // 2, 4, 2)
    return k.expand(shape), n.expand(shape), (4 * i + 16 * h).expand(shape)


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, T: int = 8):
    """codes uint8 [N, K] (0..15), scales/offsets [N, K / 32] -> words int32 [N / 32T, K / 32,
    W, 2, 32, T / 2] (tile, then a warp's 2 halves of 32 lanes x T / 2 words: T / 2 = 4 is one
    16-byte load a lane a half) and the bf16 pairs (s, s), (o, o) as int32 [N / 32T, K / 32,
    W, 8, T] (a warp, lane / 4, then the thread's T output tiles)."""
    n_out, k_in = codes.shape
    nt = 32 * T
    assert n_out % nt == 0 and k_in % 32 == 0
    nb, g = n_out // nt, k_in // 32
    k, n, bit = (v.to(codes.device) for v in _index(T))
    tiles = codes.view(nb, nt, g, 32).permute(0, 2, 1, 3)  # [nb, g, n, k]
    q = tiles[:, :, n, k].to(torch.int64)  # [nb, g, W, 2, 32, T/2, 4, 2]
    word = (q << bit).sum(dim=(-1, -2))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)

    def pairs(v: torch.Tensor) -> torch.Tensor:
        b16 = v.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        p = b16 | (b16 << 16)
        p = torch.where(p >= 2**31, p - 2**32, p).to(torch.int32)  # [N, g]
        # thread (warp, lr) tile t: n = lr + 8 warp + 32 t
        p = p.view(nb, T, W, 8, g).permute(0, 4, 2, 3, 1)  # [nb, g, W, lr, t]
        return p.contiguous()

    return word.contiguous(), pairs(scales), pairs(offsets)


def unpack(words: torch.Tensor, T: int = 8) -> torch.Tensor:
    """The inverse by the same index math (the check)."""
    nb, g = words.shape[:2]
    k, n, bit = _index(T)
    w = words.to(torch.int64)[..., None, None]  # [nb, g, W, 2, 32, T/2, 1, 1]
    q = (w >> bit) & 15
    out = torch.zeros(nb, g, 32 * T, 32, dtype=torch.int64)
    out[:, :, n.reshape(-1), k.reshape(-1)] = q.reshape(nb, g, -1)
    return out.permute(0, 2, 1, 3).reshape(nb * 32 * T, g * 32)


def logical_chain_check(T: int = 8) -> None:
    """The kernel's join / reshape / permute chain on ids: element (warp, lane, w_idx, i, h)
    must land at B[k, n] of the index math."""
    k, n, _ = _index(T)  # dims (warp, s, lane, tp, i, h)
    ident = k * 10000 + n
    # the kernel's tensors: v[i][h] of [W, 32, T] (warp, lane, w_idx = s * T/2 + tp)
    x = ident.permute(0, 2, 1, 3, 4, 5).reshape(W, 32, T, 4, 2)  # (warp, lane, w_idx, i, h)
    v = [[x[..., i, h] for h in range(2)] for i in range(4)]
    p = [torch.stack([v[i][0], v[i][1]], -1) for i in range(4)]  # (.., h)
    q = [torch.stack([p[2 * tb], p[2 * tb + 1]], -1) for tb in range(2)]  # (.., h, b)
    r = torch.stack([q[0], q[1]], -1)  # (.., h, b, tb)
    r = r.reshape(W, 8, 4, 2, T // 2, 2, 2, 2)  # (warp, lr, lq, s, tp, h, b, tb)
    r = r.permute(3, 6, 2, 5, 4, 7, 0, 1).reshape(
        32, 32 * T
    )  # k = (s, b, lq, h), n = (tp, tb, warp, lr)
    kk = torch.arange(32)[:, None]
    nn = torch.arange(32 * T)[None, :]
    assert torch.equal(r, kk * 10000 + nn), "chain mismatch"
    # the s-split chain (v2): per s an asm over [W, 32, T/2] words
    x5 = ident.permute(0, 2, 1, 3, 4, 5)  # (warp, lane, s, tp, i, h)
    qs = []
    for sh in range(2):
        v = [[x5[:, :, sh, :, i, h] for h in range(2)] for i in range(4)]
        p = [torch.stack([v[i][0], v[i][1]], -1) for i in range(4)]
        q = [torch.stack([p[2 * tb], p[2 * tb + 1]], -1) for tb in range(2)]
        qs.append(torch.stack([q[0], q[1]], -1))  # (warp, lane, tp, h, b, tb)
    r = torch.stack(qs, -1)  # (.., s)
    r = r.reshape(W, 8, 4, T // 2, 2, 2, 2, 2)  # (warp, lr, lq, tp, h, b, tb, s)
    r = r.permute(7, 5, 2, 4, 3, 6, 0, 1).reshape(32, 32 * T)
    assert torch.equal(r, kk * 10000 + nn), "chain v2 mismatch"


def check() -> int:
    torch.manual_seed(0)
    for T in (4, 8):
        logical_chain_check(T)
        n, k = 32 * T * 3, 32 * 5
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        s = torch.rand(n, k // 32) * 0.01
        o = torch.randn(n, k // 32) * 0.01
        words, s2, o2 = pack(codes, s, o, T)
        assert torch.equal(unpack(words, T), codes.to(torch.int64)), "pack/unpack"
        # the thread (warp, lr) tile t scale: n = lr + 8 warp + 32 t
        nb, g, warp, lr, t = 1, 2, 3, 5, T - 1
        nn = nb * 32 * T + lr + 8 * warp + 32 * t
        want = s[nn, g].to(torch.bfloat16).view(torch.int16).item() & 0xFFFF
        got = s2[nb, g, warp, lr, t].item() & 0xFFFF
        assert want == got, (want, got)
        print(f"T {T}: chain, pack/unpack and meta order ok")
    return 0


if __name__ == "__main__" and "--check" in sys.argv:
    sys.exit(check())


# ---- the GPU kernel (Gluon) ---------------------------------------------------------------------
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402


def layouts(T: int):
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8])
    a_l = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    tb = [[0, 0, 1 << j] for j in range(T.bit_length() - 1)]
    lwd = gl.DistributedLinearLayout(  # (warp, lane, w_idx): a thread's T words
        reg_bases=tb,
        lane_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [0, 16, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[W, 32, T],
    )
    lmd = gl.DistributedLinearLayout(  # (warp, lane / 4, t): a thread's T output tiles' pairs
        reg_bases=tb,
        lane_bases=[[0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[W, 8, T],
    )
    tb2 = [[0, 0, 1 << j] for j in range(T.bit_length() - 2)]
    lw2 = gl.DistributedLinearLayout(  # (warp, lane, tp): one k16 half's words
        reg_bases=tb2,
        lane_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [0, 16, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[W, 32, T // 2],
    )
    return mma, a_l, b_l, lwd, lmd, lw2


@gluon.jit
def _spread(v, T: gl.constexpr, LWD: gl.constexpr):
    """[W, 8, T/2] (warp, lane / 4, tp) -> [W, 32, T] (warp, lane, s * T/2 + tp)."""
    v = gl.expand_dims(gl.expand_dims(v, 2), 3)  # [W, 8, 1, 1, T/2]
    v = gl.broadcast(v, gl.full([4, 8, 4, 2, T // 2], 0, gl.int32, v.type.layout))[0]
    return gl.convert_layout(gl.reshape(v, [4, 32, T]), LWD)


@gluon.jit
def _marlin_gemm_kernel(x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, rows, N, K, span,
                        T: gl.constexpr, MMA: gl.constexpr, A_L: gl.constexpr,
                        B_L: gl.constexpr, LWD: gl.constexpr, LMD: gl.constexpr):  # fmt: skip
    nb = gl.program_id(0)
    split = gl.program_id(1)
    groups = K // 32
    first = split * span
    last = gl.minimum(first + span, groups)
    # words: [W, 32, T] offsets inside a tile
    wa = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LWD)))
    la = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LWD)))
    ia = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(1, LWD)))
    w_off = (wa[:, None, None] * (32 * T) + la[None, :, None] * (T // 2)
             + (ia // (T // 2))[None, None, :] * (16 * T) + (ia % (T // 2))[None, None, :])  # fmt: skip
    # scales / offsets: the int64 holding the pairs of tiles t = 2 tp and 2 tp + 1 (adjacent
    # int32 in memory) for word w_idx = s * T/2 + tp: (warp, lane / 4, tp)
    m_off = (wa[:, None, None] * (4 * T) + (la // 4)[None, :, None] * (T // 2)
             + (ia % (T // 2))[None, None, :])  # fmt: skip
    rm = gl.arange(0, 32, layout=gl.SliceLayout(1, A_L))
    ka = gl.arange(0, 32, layout=gl.SliceLayout(0, A_L))
    x_ptrs = x_ptr + rm[:, None] * K + ka[None, :]
    acc = gl.zeros([32, 32 * T], gl.float32, MMA)
    tile = nb * groups
    for g in range(first, last):
        words = gl.load(w_ptr + (tile + g).to(gl.int64) * (4 * 32 * T) + w_off)
        sab = gl.load(s_ptr + (tile + g) * (4 * 4 * T) + m_off)
        oab = gl.load(o_ptr + (tile + g) * (4 * 4 * T) + m_off)
        xa = gl.load(x_ptrs + g * 32)
        v00, v01, v10, v11, v20, v21, v30, v31 = gl.inline_asm_elementwise(
            "{ .reg .b32 t, c, w1, sa, sb, oa, ob;\n"
            "mov.b64 {sa, sb}, $9;\n"
            "mov.b64 {oa, ob}, $10;\n"
            "mov.b32 c, 0x43004300;\n"
            "lop3.b32 t, $8, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "fma.rn.bf16x2 t, t, sa, oa;\n"
            "mov.b32 {$0, $1}, t;\n"
            "shr.b32 w1, $8, 4;\n"
            "lop3.b32 t, w1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "fma.rn.bf16x2 t, t, sa, oa;\n"
            "mov.b32 {$2, $3}, t;\n"
            "shr.b32 w1, $8, 8;\n"
            "lop3.b32 t, w1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "fma.rn.bf16x2 t, t, sb, ob;\n"
            "mov.b32 {$4, $5}, t;\n"
            "shr.b32 w1, $8, 12;\n"
            "lop3.b32 t, w1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "fma.rn.bf16x2 t, t, sb, ob;\n"
            "mov.b32 {$6, $7}, t; }",
            "=h,=h,=h,=h,=h,=h,=h,=h,r,l,l",
            [words, sab, oab],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
        p0 = gl.join(v00, v01)
        p1 = gl.join(v10, v11)
        p2 = gl.join(v20, v21)
        p3 = gl.join(v30, v31)
        r = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [W, 32, T, 2 h, 2 b, 2 tb]
        r = gl.reshape(r, [4, 8, 4, 2, T // 2, 2, 2, 2])  # (warp, lr, lq, s, tp, h, b, tb)
        r = gl.permute(r, [3, 6, 2, 5, 4, 7, 0, 1])
        wb = gl.convert_layout(gl.reshape(r, [32, 32 * T]), B_L)
        acc = mma_v2(xa, wb, acc)
    rn = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    nn = gl.arange(0, 32 * T, layout=gl.SliceLayout(0, MMA))
    out = nb * (32 * T) + nn
    y_ptrs = y_ptr + rn[:, None] * N + out[None, :]
    gl.atomic_add(y_ptrs, acc, mask=(rn[:, None] < rows) & (out[None, :] < N), sem="relaxed")


@gluon.jit
def _deq(words, sab, oab):
    """[W, 32, T/2] words -> [W, 32, T/2, 2 h, 2 b, 2 tb] bf16 (pairs by LOP3 magic)."""
    v00, v01, v10, v11, v20, v21, v30, v31 = gl.inline_asm_elementwise(
            "{ .reg .b32 t, c, w1, sa, sb, oa, ob;\n"
            "mov.b64 {sa, sb}, $9;\n"
            "mov.b64 {oa, ob}, $10;\n"
            "mov.b32 c, 0x43004300;\n"
            "lop3.b32 t, $8, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "fma.rn.bf16x2 t, t, sa, oa;\n"
            "mov.b32 {$0, $1}, t;\n"
            "shr.b32 w1, $8, 4;\n"
            "lop3.b32 t, w1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "fma.rn.bf16x2 t, t, sa, oa;\n"
            "mov.b32 {$2, $3}, t;\n"
            "shr.b32 w1, $8, 8;\n"
            "lop3.b32 t, w1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "fma.rn.bf16x2 t, t, sb, ob;\n"
            "mov.b32 {$4, $5}, t;\n"
            "shr.b32 w1, $8, 12;\n"
            "lop3.b32 t, w1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "fma.rn.bf16x2 t, t, sb, ob;\n"
            "mov.b32 {$6, $7}, t; }",
            "=h,=h,=h,=h,=h,=h,=h,=h,r,l,l",
        [words, sab, oab],
        dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1,
    )  # fmt: skip
    p0 = gl.join(v00, v01)
    p1 = gl.join(v10, v11)
    p2 = gl.join(v20, v21)
    p3 = gl.join(v30, v31)
    return gl.join(gl.join(p0, p1), gl.join(p2, p3))


@gluon.jit
def _marlin_gemm2_kernel(x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, rows, N, K, span,
                        T: gl.constexpr, MMA: gl.constexpr, A_L: gl.constexpr,
                        B_L: gl.constexpr, LWD: gl.constexpr, LMD: gl.constexpr, LW2: gl.constexpr, PREFETCH: gl.constexpr):  # fmt: skip
    nb = gl.program_id(0)
    split = gl.program_id(1)
    groups = K // 32
    first = split * span
    last = gl.minimum(first + span, groups)
    # words: [W, 32, T] offsets inside a tile
    wa = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LWD)))
    la = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LWD)))
    ia = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(1, LWD)))
    w_off = (wa[:, None, None] * (32 * T) + la[None, :, None] * (T // 2)
             + (ia // (T // 2))[None, None, :] * (16 * T) + (ia % (T // 2))[None, None, :])  # fmt: skip
    wb2 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW2)))
    lb2 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW2)))
    tb2 = gl.arange(0, T // 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW2)))
    m_off = wb2[:, None, None] * (4 * T) + (lb2 // 4)[None, :, None] * (T // 2) + tb2[None, None, :]
    rm = gl.arange(0, 32, layout=gl.SliceLayout(1, A_L))
    ka = gl.arange(0, 32, layout=gl.SliceLayout(0, A_L))
    x_ptrs = x_ptr + rm[:, None] * K + ka[None, :]
    acc = gl.zeros([32, 32 * T], gl.float32, MMA)
    tile = nb * groups
    wn = gl.load(w_ptr + (tile + first).to(gl.int64) * (4 * 32 * T) + w_off)
    sn = gl.load(s_ptr + (tile + first) * (4 * 4 * T) + m_off)
    on = gl.load(o_ptr + (tile + first) * (4 * 4 * T) + m_off)
    xn = gl.load(x_ptrs + first * 32)
    for g in range(first, last):
        words, sab, oab, xa = wn, sn, on, xn
        gn = gl.minimum(g + 1, last - 1)  # the next group (the last again at the end)
        if PREFETCH:
            wn = gl.load(w_ptr + (tile + gn).to(gl.int64) * (4 * 32 * T) + w_off)
            sn = gl.load(s_ptr + (tile + gn) * (4 * 4 * T) + m_off)
            on = gl.load(o_ptr + (tile + gn) * (4 * 4 * T) + m_off)
            xn = gl.load(x_ptrs + gn * 32)
        ws = gl.permute(gl.reshape(words, [4, 32, 2, T // 2]), [0, 1, 3, 2])
        w0, w1 = gl.split(ws)
        qs0 = _deq(gl.convert_layout(w0, LW2), sab, oab)
        qs1 = _deq(gl.convert_layout(w1, LW2), sab, oab)
        r = gl.join(qs0, qs1)  # [W, 32, T/2, h, b, tb, s]
        r = gl.reshape(r, [4, 8, 4, T // 2, 2, 2, 2, 2])  # (warp, lr, lq, tp, h, b, tb, s)
        r = gl.permute(r, [7, 5, 2, 4, 3, 6, 0, 1])
        wb = gl.convert_layout(gl.reshape(r, [32, 32 * T]), B_L)
        acc = mma_v2(xa, wb, acc)
        if not PREFETCH:
            wn = gl.load(w_ptr + (tile + gn).to(gl.int64) * (4 * 32 * T) + w_off)
            sn = gl.load(s_ptr + (tile + gn) * (4 * 4 * T) + m_off)
            on = gl.load(o_ptr + (tile + gn) * (4 * 4 * T) + m_off)
            xn = gl.load(x_ptrs + gn * 32)
    rn = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    nn = gl.arange(0, 32 * T, layout=gl.SliceLayout(0, MMA))
    out = nb * (32 * T) + nn
    y_ptrs = y_ptr + rn[:, None] * N + out[None, :]
    gl.atomic_add(y_ptrs, acc, mask=(rn[:, None] < rows) & (out[None, :] < N), sem="relaxed")


class MarlinGemm:
    def __init__(self, qw, T: int = 8, programs: int = 264, prefetch: bool = True):
        from worker.layers.quant import unpack_nibbles

        n, k = qw.shape
        codes = unpack_nibbles(qw.qdata)
        words, s2, o2 = pack(codes, qw.scales.float(), qw.offsets.float(), T)
        dev = qw.qdata.device
        self.words = words.to(dev)
        self.s2, self.o2 = s2.to(dev).view(torch.int64), o2.to(dev).view(torch.int64)
        self.n, self.k, self.T, self.prefetch = n, k, T, prefetch
        self.blocks = n // (32 * T)
        groups = k // 32
        split = max(1, min(groups, programs // self.blocks))
        self.span = triton.cdiv(groups, split)
        self.split = triton.cdiv(groups, self.span)
        self.lay = layouts(T)

    def __call__(self, x, y32):
        mma, a_l, b_l, lwd, lmd, lw2 = self.lay
        _marlin_gemm2_kernel[(self.blocks, self.split)](
            x, self.words, self.s2, self.o2, y32, x.shape[0], self.n, self.k, self.span,
            T=self.T, MMA=mma, A_L=a_l, B_L=b_l, LWD=lwd, LMD=lmd, LW2=lw2,
            PREFETCH=self.prefetch, num_warps=W,
        )  # fmt: skip
        return y32


def main() -> int:
    import os

    from worker.device.kernels import quant_matmul as qm
    from worker.layers import quant as Q

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tma_gemv import graph_us

    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [("qkv", 16384, 5376), ("o", 5376, 8192), ("gate_up", 43008, 5376),
              ("down", 5376, 21504)]  # fmt: skip
    tile = (64, 32, 4, 4, 1, 264)
    variants = [(8, 264, True), (8, 396, True), (8, 396, False), (4, 528, True), (4, 660, True)]
    copies = 8
    totals = {}
    for name, n, k in shapes:
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        qw = Q.quantize(w, Q.QuantFormat("int4", 32), search=False)
        del w
        base = qm.KMajorWeight.pack(qw, torch.bfloat16)
        mats = [base] + [qm.KMajorWeight(base.kind, base.shape, base.group_size, base.words.clone(),
                                         base.scales.clone(), base.offsets.clone(), block=base.block,
                                         width=base.width) for _ in range(copies - 1)]  # fmt: skip
        for m in mats[1:]:
            m.counters(1)
        x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
        exact = x.float() @ qw.dequantize().to(dev).t()
        ref = qm.qgemm(x, base, tile).float()
        scale = exact.abs().max().item()
        line = f"{name}: qgemm err {(ref - exact).abs().max().item() / scale:.1e}"
        b = graph_us(lambda: [qm.qgemm(x, m, tile) for m in mats]) / copies
        totals["qgemm"] = totals.get("qgemm", 0.0) + b
        line += f", {b:.1f} us"
        ys = [torch.zeros(M, n, device=dev, dtype=torch.float32) for _ in range(copies)]
        z = graph_us(lambda: [y.zero_() for y in ys]) / copies
        for T, programs, pf in variants:
            g = MarlinGemm(qw, T, programs, pf)
            gs = [g]
            for _ in range(copies - 1):
                c = MarlinGemm.__new__(MarlinGemm)
                c.__dict__.update(g.__dict__)
                c.words, c.s2, c.o2 = g.words.clone(), g.s2.clone(), g.o2.clone()
                gs.append(c)
            y = g(x, torch.zeros(M, n, device=dev, dtype=torch.float32))
            err = (y - exact).abs().max().item() / scale

            def run(gs=gs):
                for gg, yy in zip(gs, ys, strict=True):
                    yy.zero_()
                    gg(x, yy)

            a = graph_us(run) / copies - z
            key = f"T{T}/{programs}{'' if pf else '/nopf'}"
            totals[key] = totals.get(key, 0.0) + a
            line += f"; {key} err {err:.1e}, {a:.1f} us"
        print(line + f" (memset {z:.1f} us subtracted)", flush=True)
    print("layer: " + ", ".join(f"{k} {v:.1f} us" for k, v in totals.items()), flush=True)
    return 0


if __name__ == "__main__" and "--check" not in sys.argv:
    sys.exit(main())
