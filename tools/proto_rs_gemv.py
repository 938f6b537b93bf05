# ruff: noqa
"""Session 25 prep (not run on a GPU): a CUDA-core GEMV over the fragment-ordered int4 words of
tools/proto_rs_wgmma.py (the layout of its R, KG, WG), for batch 1 beside that GEMM.

Per word: one SHF (w >> 12: the codes at bits 20, 24, 28 come down to 8, 12, 16) and per code
one LOP3 (the code at bits a'.. read as an fp32 denormal code * 2^(a' - 149)) and one FFMA
with x prescaled by 2^(90 - a') (one FMUL a (x, a') a chunk, shared by the R words and NB
blocks that meet it). A group's scale and offset once per (group, output) a thread; the sum
kept in units of 2^-59 and scaled once at the end; the 4 lanes t of an output summed at the
end; K splits added by fp32 atomics (a prototype).

python3 tools/proto_rs_gemv.py --check              (CPU: the kernel's arithmetic in torch)
python3 tools/proto_rs_gemv.py [R:KG:WG:NB:programs,..]   (GPU: error and us per matrix beside qgemv)
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@gluon.jit
def _code(w, A: gl.constexpr):
    """The code at bits A..A+3 of w (A <= 16) as the fp32 denormal code * 2^(A - 149)."""
    return (w & (15 << A)).to(gl.float32, bitcast=True)


@gluon.jit
def _pair(x_ptr, base, XL: gl.constexpr, T: gl.constexpr, KG: gl.constexpr):
    """[T, KG] int32 pairs (x[k], x[k + 1]) at k = kg 32 + 2 t + base (t = tid % 4), split
    into (low, high) fp32."""
    t = gl.arange(0, T, layout=gl.SliceLayout(1, XL))
    kg = gl.arange(0, KG, layout=gl.SliceLayout(0, XL))
    p = gl.load(x_ptr + base + kg[None, :] * 16 + (t % 4)[:, None])
    return (p << 16).to(gl.float32, bitcast=True), (p & -65536).to(gl.float32, bitcast=True)


@gluon.jit
def _x4(v, scale):
    """[T, KG] -> [1, T, KG, 1] prescaled (broadcast over blocks and R)."""
    return gl.expand_dims(gl.expand_dims(v * scale, 0), 3)


@gluon.jit
def _rs_gemv_kernel(x_ptr, w_ptr, m_ptr, y_ptr, N, K, span, nblk, R: gl.constexpr, KG: gl.constexpr,
                    WG: gl.constexpr, NB: gl.constexpr, L3: gl.constexpr):  # fmt: skip
    BK: gl.constexpr = 32 * KG
    J: gl.constexpr = 2 * R * KG
    T: gl.constexpr = 128 * WG
    chunks = K // BK
    first = gl.program_id(1) * span
    last = gl.minimum(first + span, chunks)
    nb = gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    tid = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    jj = gl.arange(0, J, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    blk = gl.program_id(0) * NB + nb
    live = (blk < nblk)[:, None, None] & (tid >= 0)[None, :, None] & (jj >= 0)[None, None, :]
    w_off = (blk[:, None, None].to(gl.int64) * (chunks * T * J) + tid[None, :, None] * J
             + jj[None, None, :])  # fmt: skip
    m_off = (blk[:, None, None].to(gl.int64) * (chunks * T // 4 * J)
             + (tid // 4)[None, :, None] * J + jj[None, None, :])  # fmt: skip
    # the output of meta j = (kg, r, dr) of thread (w, g, t): r 64 WG + w 16 + dr 8 + g
    o3 = (blk[:, None, None] * (64 * R * WG) + ((jj // 2) % R * (64 * WG) + (jj % 2) * 8)[None, None, :]
          + ((tid // 32) * 16 + (tid // 4) % 8)[None, :, None])  # fmt: skip
    o0, o1 = gl.split(gl.reshape(o3, [NB, T, KG, R, 2]))
    L4: gl.constexpr = o0.type.layout  # [NB, T, KG, R]
    XL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))
    out0 = gl.max(o0, axis=2)
    out1 = gl.max(o1, axis=2)
    zero = gl.zeros([NB, T, KG, R], gl.float32, L4)
    tot0 = gl.sum(zero, axis=2)
    tot1 = gl.sum(zero, axis=2)
    wn = gl.load(w_ptr + first * (T * J) + w_off, mask=live, other=0)
    mn = gl.load(m_ptr + first * (T // 4 * J) + m_off, mask=live, other=0)
    for c in range(first, last):
        words, meta = wn, mn
        cn = gl.minimum(c + 1, last - 1)
        wn = gl.load(w_ptr + cn * (T * J) + w_off, mask=live, other=0)
        mn = gl.load(m_ptr + cn * (T // 4 * J) + m_off, mask=live, other=0)
        base = c * (BK // 2)
        # x of word ks at (dk, h): pairs kg 16 + ks 8 + dk 4 + t
        a00, a01 = _pair(x_ptr, base, XL, T, KG)  # ks 0 dk 0: h 0, 1
        a10, a11 = _pair(x_ptr, base + 4, XL, T, KG)  # ks 0 dk 1
        b00, b01 = _pair(x_ptr, base + 8, XL, T, KG)  # ks 1 dk 0
        b10, b11 = _pair(x_ptr, base + 12, XL, T, KG)  # ks 1 dk 1
        xsum = _x4(a00 + a01 + a10 + a11 + b00 + b01 + b10 + b11, 1.734723475976807e-18)  # 2^-59
        wa, wb = gl.split(gl.reshape(words, [NB, T, KG, R, 2]))  # ks 0, 1
        ua = wa >> 12
        ub = wb >> 12
        # dr 0: positions (dk, h) at bits 0, 8 (w) and 16 (w), 24 -> 12 (u); 2^(90 - a')
        acc0 = _code(wa, 0) * _x4(a00, 1.2379400392853803e27)
        acc0 += _code(wa, 8) * _x4(a10, 4.835703278458517e24)
        acc0 += _code(wa, 16) * _x4(a01, 1.8889465931478581e22)
        acc0 += _code(ua, 12) * _x4(a11, 3.022314549036573e23)
        acc0 += _code(wb, 0) * _x4(b00, 1.2379400392853803e27)
        acc0 += _code(wb, 8) * _x4(b10, 4.835703278458517e24)
        acc0 += _code(wb, 16) * _x4(b01, 1.8889465931478581e22)
        acc0 += _code(ub, 12) * _x4(b11, 3.022314549036573e23)
        # dr 1: bits 4, 12 (w) and 20 -> 8, 28 -> 16 (u)
        acc1 = _code(wa, 4) * _x4(a00, 7.737125245533627e25)
        acc1 += _code(wa, 12) * _x4(a10, 3.022314549036573e23)
        acc1 += _code(ua, 8) * _x4(a01, 4.835703278458517e24)
        acc1 += _code(ua, 16) * _x4(a11, 1.8889465931478581e22)
        acc1 += _code(wb, 4) * _x4(b00, 7.737125245533627e25)
        acc1 += _code(wb, 12) * _x4(b10, 3.022314549036573e23)
        acc1 += _code(ub, 8) * _x4(b01, 4.835703278458517e24)
        acc1 += _code(ub, 16) * _x4(b11, 1.8889465931478581e22)
        m0, m1 = gl.split(gl.reshape(meta, [NB, T, KG, R, 2]))  # dr 0, 1
        s0 = (m0 << 16).to(gl.float32, bitcast=True)
        s1 = (m1 << 16).to(gl.float32, bitcast=True)
        f0 = (m0 & -65536).to(gl.float32, bitcast=True)
        f1 = (m1 & -65536).to(gl.float32, bitcast=True)
        tot0 += gl.sum(acc0 * s0 + f0 * xsum, axis=2)
        tot1 += gl.sum(acc1 * s1 + f1 * xsum, axis=2)
    r0 = gl.sum(gl.reshape(tot0, [NB, 4 * WG, 8, 4, R]), axis=3) * 5.764607523034235e17  # 2^59
    r1 = gl.sum(gl.reshape(tot1, [NB, 4 * WG, 8, 4, R]), axis=3) * 5.764607523034235e17
    i0 = gl.max(gl.reshape(out0, [NB, 4 * WG, 8, 4, R]), axis=3)
    i1 = gl.max(gl.reshape(out1, [NB, 4 * WG, 8, 4, R]), axis=3)
    gl.atomic_add(y_ptr + i0, r0, mask=i0 < N, sem="relaxed")
    gl.atomic_add(y_ptr + i1, r1, mask=i1 < N, sem="relaxed")


def gemv_layout(R: int, KG: int, WG: int, NB: int):
    return gl.BlockedLayout([NB, 1, 2 * R * KG], [1, 32, 1], [1, 4 * WG, 1], [2, 1, 0])


class RsGemv:
    """The GEMV over an RsGemm's words: NB blocks a program, K split to about ``programs``."""

    def __init__(self, g, NB: int = 2, programs: int = 264):
        assert g.KG == 2 or g.KG == 1 or g.KG == 4
        self.g, self.NB = g, NB
        self.words, self.meta = g.words, g.meta
        chunks = g.k // (32 * g.KG)
        split = max(1, min(chunks, programs // triton.cdiv(g.blocks, NB)))
        self.span = triton.cdiv(chunks, split)
        self.split = triton.cdiv(chunks, self.span)
        self.layout = gemv_layout(g.R, g.KG, g.WG, NB)

    def __call__(self, x, y32):
        g = self.g
        _rs_gemv_kernel[(triton.cdiv(g.blocks, self.NB), self.split)](
            x.view(torch.int32), self.words, self.meta, y32, g.n, g.k, self.span, g.blocks, R=g.R, KG=g.KG,
            WG=g.WG, NB=self.NB, L3=self.layout, num_warps=4 * g.WG,
        )  # fmt: skip
        return y32


def emulate(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor, R: int, KG: int, WG: int,
            n: int, k: int) -> torch.Tensor:  # fmt: skip
    """The kernel's arithmetic on the CPU in torch (one block at a time, every thread at once):
    the same offsets, code positions, prescales and output indices."""
    T, J, BK = 128 * WG, 2 * R * KG, 32 * KG
    chunks = k // BK
    xp = x.to(torch.bfloat16).view(torch.int16).to(torch.int32).view(-1)
    pairs = (xp[0::2] & 0xFFFF) | (xp[1::2] << 16)  # int32 pairs
    tid = torch.arange(T)
    y = torch.zeros(n, dtype=torch.float64)

    def f32(bits):
        return bits.to(torch.int32).view(torch.float32).double()

    def code(w, a):
        return f32(w & (15 << a))

    for b in range(n // (64 * R * WG)):
        for c in range(chunks):
            wv = words[b, c].reshape(T, KG, R, 2)
            mv = meta[b, c].reshape(T // 4, KG, R, 2).repeat_interleave(4, 0)
            base = c * (BK // 2)
            kg = torch.arange(KG)

            def pair(off):
                p = pairs[base + off + kg[None, :] * 16 + (tid % 4)[:, None]]
                return f32(p << 16)[:, :, None], f32(p & -65536)[:, :, None]  # [T, KG, 1]

            a00, a01 = pair(0)
            a10, a11 = pair(4)
            b00, b01 = pair(8)
            b10, b11 = pair(12)
            wa, wb = wv[..., 0], wv[..., 1]
            ua, ub = wa >> 12, wb >> 12
            e = 2.0**90
            acc0 = (code(wa, 0) * a00 * e + code(wa, 8) * a10 * e / 2**8 + code(wa, 16) * a01 * e / 2**16
                    + code(ua, 12) * a11 * e / 2**12 + code(wb, 0) * b00 * e + code(wb, 8) * b10 * e / 2**8
                    + code(wb, 16) * b01 * e / 2**16 + code(ub, 12) * b11 * e / 2**12)  # fmt: skip
            acc1 = (code(wa, 4) * a00 * e / 2**4 + code(wa, 12) * a10 * e / 2**12
                    + code(ua, 8) * a01 * e / 2**8 + code(ua, 16) * a11 * e / 2**16
                    + code(wb, 4) * b00 * e / 2**4 + code(wb, 12) * b10 * e / 2**12
                    + code(ub, 8) * b01 * e / 2**8 + code(ub, 16) * b11 * e / 2**16)  # fmt: skip
            xsum = (a00 + a01 + a10 + a11 + b00 + b01 + b10 + b11) * 2.0**-59
            for dr, acc in ((0, acc0), (1, acc1)):
                m = mv[..., dr]
                s, f = f32(m << 16), f32(m & -65536)
                part = (acc * s + f * xsum).sum(1) * 2.0**59  # [T, R]
                r = torch.arange(R)
                out = (b * 64 * R * WG + r[None, :] * 64 * WG + ((tid // 32) * 16 + dr * 8
                       + (tid // 4) % 8)[:, None])  # fmt: skip
                y.index_add_(0, out.reshape(-1), part.reshape(-1))
    return y.float()


def check() -> int:
    from proto_rs_wgmma import pack

    torch.manual_seed(0)
    for R, KG, WG in ((2, 2, 1), (1, 2, 2)):
        n, k = 64 * R * WG * 2, 32 * KG * 3
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        s = (torch.rand(n, k // 32) * 0.01).to(torch.bfloat16).float()
        o = (torch.randn(n, k // 32) * 0.01).to(torch.bfloat16).float()
        words, meta = pack(codes, s, o, R, KG, WG)
        x = torch.randn(1, k).to(torch.bfloat16).float()
        w = codes.float().view(n, k // 32, 32) * s[..., None] + o[..., None]
        exact = (x.double() @ w.view(n, k).double().t()).view(-1)
        got = emulate(x, words, meta, R, KG, WG, n, k)
        err = (got.double() - exact).abs().max().item() / exact.abs().max().item()
        assert err < 1e-5, (R, KG, WG, err)
        print(f"R {R} KG {KG} WG {WG}: the GEMV's arithmetic matches x @ W^T, rel err {err:.1e}")
    return 0


def main() -> int:
    from proto_rs_wgmma import RsGemm, graph_us

    from worker.device.kernels import quant_matmul as qm
    from worker.layers import quant as Q

    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [("qkv", 16384, 5376), ("o", 5376, 8192), ("gate_up", 43008, 5376),
              ("down", 5376, 21504)]  # fmt: skip
    tiles = {"gate_up": (64, 264, 8, 8)}
    # R:KG:WG:NB:programs
    specs = sys.argv[1] if len(sys.argv) > 1 else "2:2:1:4:264,2:2:1:4:396,2:2:1:2:528,2:2:1:1:792"
    copies, totals = 8, {}
    for name, n, k in shapes:
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        qw = Q.quantize(w, Q.QuantFormat("int4", 32), search=False)
        qw = Q.QuantizedWeight(qw.kind, qw.shape, qw.group_size, qw.qdata,
                               qw.scales.to(torch.bfloat16), qw.offsets.to(torch.bfloat16))  # fmt: skip
        base = qm.KMajorWeight.pack(qw, torch.bfloat16)
        mats = [base] + [qm.KMajorWeight(base.kind, base.shape, base.group_size, base.words.clone(),
                                         base.scales.clone(), base.offsets.clone(), block=base.block,
                                         width=base.width) for _ in range(copies - 1)]  # fmt: skip
        for m in mats[1:]:
            m.counters(1)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        exact = x.float() @ qw.dequantize().to(dev).t()
        scale = exact.abs().max().item()
        gt = tiles.get(name, qm.GEMV_CONFIG)
        ref = qm.qgemv(x, base, gt).float()
        line = f"{name}: qgemv err {(ref - exact).abs().max().item() / scale:.1e}"
        b = graph_us(lambda: [qm.qgemv(x, m, gt) for m in mats]) / copies
        totals["qgemv"] = totals.get("qgemv", 0.0) + b
        line += f", {b:.1f} us"
        ys = [torch.zeros(1, n, device=dev, dtype=torch.float32) for _ in range(copies)]
        z = graph_us(lambda: [y.zero_() for y in ys]) / copies
        packed = {}
        for spec in specs.split(","):
            R, KG, WG, NB, programs = (int(v) for v in spec.split(":"))
            if (R, KG, WG) not in packed:
                packed[(R, KG, WG)] = RsGemm(qw, R, KG, 528, 0, WG)
            g = packed[(R, KG, WG)]
            gv = RsGemv(g, NB, programs)
            gs = [gv]
            for _ in range(copies - 1):
                c = RsGemv.__new__(RsGemv)
                c.__dict__.update(gv.__dict__)
                c.words, c.meta = gv.words.clone(), gv.meta.clone()
                gs.append(c)
            y = gv(x, torch.zeros(1, n, device=dev, dtype=torch.float32))
            err = (y - exact).abs().max().item() / scale

            def run(gs=gs):
                for gg, yy in zip(gs, ys, strict=True):
                    yy.zero_()
                    gg(x, yy)

            a = graph_us(run) / copies - z
            totals[spec] = totals.get(spec, 0.0) + a
            line += f"; {spec} err {err:.1e}, {a:.1f} us"
        print(line + f" (memset {z:.1f} us subtracted)", flush=True)
    print("layer: " + ", ".join(f"{k} {v:.1f} us" for k, v in totals.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(check() if "--check" in sys.argv else main())
