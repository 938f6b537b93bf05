# ruff: noqa  (a prototype kept in history only: removed in the next commit)
"""Prototype: the int4 g32 GEMV with its words brought in by TMA, STAGES deep in shared memory
(32 KB a stage: 8 groups x 32 rows x 32 words of one column block), math in registers as
today's (codes as denormals x x * 2^90, FMA chains, the scale at the group's end).

python3 tools/proto_tma_gemv.py [--layers 8] [--stages 2:528:4,3:396:4ro]
(session 24: scales and offsets come by TMA with the words; spec S:P:G[ro] = stages, programs, groups a stage)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from worker.device.kernels import quant_matmul as qm
from worker.layers import quant as Q

TWO90 = 1.2379400392853803e27


@gluon.jit
def _unscale(p: gl.constexpr):
    if p == 0:
        u = 5.764607523034235e17
    elif p == 1:
        u = 3.602879701896397e16
    elif p == 2:
        u = 2251799813685248.0
    elif p == 3:
        u = 140737488355328.0
    elif p == 4:
        u = 8796093022208.0
    elif p == 5:
        u = 549755813888.0
    elif p == 6:
        u = 8796093022208.0
    else:
        u = 549755813888.0
    return u


@gluon.jit
def _pos(words, xb, acc, sflat, oflat, base, xs, S2: gl.constexpr, p: gl.constexpr):
    """acc += this stage's groups' sums for code position p (scaled, plus offset * sum x)."""
    if p < 6:
        bits = words & (15 << (4 * p))
    else:
        bits = (words >> 8) & (15 << (4 * p - 8))
    d = gl.sum(bits.to(gl.float32, bitcast=True) * xb, axis=1)
    s = sflat.index(base + p).load(S2).to(gl.float32)
    o = oflat.index(base + p).load(S2).to(gl.float32)
    return acc + d * (s * _unscale(p)) + o * xs


@gluon.jit
def _store(out, acc, cols, N, p: gl.constexpr):
    idx = cols * 8 + p
    gl.store(out + idx, gl.sum(acc, axis=0).to(out.dtype.element_ty), mask=idx < N)


@gluon.jit
def _tma_gemv_kernel(desc, sdesc, odesc, x_ptr, part_ptr, y_ptr, count_ptr, N, C, K,
                     STAGES: gl.constexpr, SPLIT: gl.constexpr, G: gl.constexpr,
                     RO: gl.constexpr = False):  # fmt: skip
    L3: gl.constexpr = gl.BlockedLayout([1, 32, 1], [1, 1, 32], [G, 1, 1], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(1, L3)  # [8 groups, 32 word columns]
    SX: gl.constexpr = gl.SliceLayout(2, L3)  # [8 groups, 32 rows]
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [G], [0])
    cb = gl.program_id(0)
    split = gl.program_id(1)
    splits = gl.num_programs(1)
    groups = K // 32
    span = (groups + splits - 1) // splits
    first = split * span
    last = gl.minimum(first + span, groups)
    n = (last - first + G - 1) // G

    wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, G, 32, 32], desc.layout)
    sbuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8, G, 32], sdesc.layout)
    obuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8, G, 32], odesc.layout)
    PL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    sflat = sbuf._reinterpret(gl.bfloat16, [STAGES * 8, G, 32], PL)
    oflat = obuf._reinterpret(gl.bfloat16, [STAGES * 8, G, 32], PL)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        pred = i < n
        mbarrier.expect(bars.index(i), G * 5120, pred=pred)
        tma.async_copy_global_to_shared(desc, [cb * groups + first + G * i, 0, 0], bars.index(i),
                                        wbuf.index(i), pred=pred)  # fmt: skip
        tma.async_copy_global_to_shared(sdesc, [0, cb * groups + first + G * i, 0], bars.index(i),
                                        sbuf.index(i), pred=pred)  # fmt: skip
        tma.async_copy_global_to_shared(odesc, [0, cb * groups + first + G * i, 0], bars.index(i),
                                        obuf.index(i), pred=pred)  # fmt: skip

    gx = gl.arange(0, G, layout=gl.SliceLayout(1, SX))
    rx = gl.arange(0, 32, layout=gl.SliceLayout(0, SX))
    gm = gl.arange(0, G, layout=gl.SliceLayout(1, S2))
    cm = gl.arange(0, 32, layout=gl.SliceLayout(0, S2))
    a0 = gl.zeros([G, 32], gl.float32, S2)
    a1 = gl.zeros([G, 32], gl.float32, S2)
    a2 = gl.zeros([G, 32], gl.float32, S2)
    a3 = gl.zeros([G, 32], gl.float32, S2)
    a4 = gl.zeros([G, 32], gl.float32, S2)
    a5 = gl.zeros([G, 32], gl.float32, S2)
    a6 = gl.zeros([G, 32], gl.float32, S2)
    a7 = gl.zeros([G, 32], gl.float32, S2)
    for t in range(n):
        nt = t + STAGES - 1
        slot_n = nt % STAGES
        pred = nt < n
        gl.thread_barrier()  # every warp is done with slot_n (read at t - 1)
        mbarrier.expect(bars.index(slot_n), G * 5120, pred=pred)
        tma.async_copy_global_to_shared(desc, [cb * groups + first + G * nt, 0, 0],
                                        bars.index(slot_n), wbuf.index(slot_n), pred=pred)  # fmt: skip
        tma.async_copy_global_to_shared(sdesc, [0, cb * groups + first + G * nt, 0],
                                        bars.index(slot_n), sbuf.index(slot_n), pred=pred)  # fmt: skip
        tma.async_copy_global_to_shared(odesc, [0, cb * groups + first + G * nt, 0],
                                        bars.index(slot_n), obuf.index(slot_n), pred=pred)  # fmt: skip
        g0 = first + G * t
        g = g0 + gx
        xmask = (g < last)[:, None] & (rx[None, :] < 32)
        xv = gl.load(x_ptr + g[:, None] * 32 + rx[None, :], mask=xmask, other=0.0).to(gl.float32)
        xb = gl.expand_dims(xv * 1.2379400392853803e27, 2)
        xs = gl.sum(gl.expand_dims(xv, 2), axis=1)
        slot = t % STAGES
        mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
        words = wbuf.index(slot).load(L3)
        sst = slot * 8
        ost = slot * 8
        if RO:  # the words read, one FFMA each: the stream's own ceiling
            a0 += gl.sum(words.to(gl.float32, bitcast=True) * xb, axis=1)
        else:
            a0 = _pos(words, xb, a0, sflat, oflat, sst, xs, S2, 0)
            a1 = _pos(words, xb, a1, sflat, oflat, sst, xs, S2, 1)
            a2 = _pos(words, xb, a2, sflat, oflat, sst, xs, S2, 2)
            a3 = _pos(words, xb, a3, sflat, oflat, sst, xs, S2, 3)
            a4 = _pos(words, xb, a4, sflat, oflat, sst, xs, S2, 4)
            a5 = _pos(words, xb, a5, sflat, oflat, sst, xs, S2, 5)
            a6 = _pos(words, xb, a6, sflat, oflat, sst, xs, S2, 6)
            a7 = _pos(words, xb, a7, sflat, oflat, sst, xs, S2, 7)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    out = y_ptr
    if SPLIT:
        out = part_ptr + split * (C * 8)
    cols = cb * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, S2))
    _store(out, a0, cols, N, 0)
    _store(out, a1, cols, N, 1)
    _store(out, a2, cols, N, 2)
    _store(out, a3, cols, N, 3)
    _store(out, a4, cols, N, 4)
    _store(out, a5, cols, N, 5)
    _store(out, a6, cols, N, 6)
    _store(out, a7, cols, N, 7)
    if SPLIT:
        gl.thread_barrier()
        arrived = gl.atomic_add(count_ptr + cb, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            outs = cb * 256 + gl.arange(0, 256, layout=L1)
            omask = outs < N
            total = gl.zeros([256], gl.float32, L1)
            for s in range(splits):
                total += gl.load(part_ptr + s * (C * 8) + outs, mask=omask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            gl.store(y_ptr + outs, total.to(y_ptr.dtype.element_ty), mask=omask)
            gl.atomic_xchg(count_ptr + cb, 0, sem="relaxed", scope="gpu")


import triton.language as tl  # noqa: E402


@triton.jit
def _read_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Read n int32 (16-byte loads, grid-stride over BLOCK-element tiles), XOR them together:
    the memory system's figure for a plain contiguous stream of the same bytes."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    for i in range(ITERS):
        o = offs + i * step
        acc ^= tl.load(ptr + o, mask=o < n, other=0)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def read_all(t: torch.Tensor, out: torch.Tensor, programs: int = 528, block: int = 2048):
    n = t.numel()
    iters = triton.cdiv(n, programs * block)
    _read_kernel[(programs,)](t, out, n, BLOCK=block, ITERS=iters, num_warps=8)


WORDS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
META_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)


class TmaGemv:
    def __init__(
        self,
        packed: qm.KMajorWeight,
        programs: int = 264,
        stages: int = 3,
        g: int = 8,
        ro: bool = False,
    ):
        self.g, self.ro = g, ro
        assert packed.block == 32 and packed.group_size == 32 and packed.kind == "int4"
        n, k = packed.shape
        self.p, self.n, self.k, self.stages = packed, n, k, stages
        blocks = packed.words.shape[0]
        words3 = packed.words.view(blocks * (k // 32), 32, 32)
        self.desc = TensorDescriptor(words3, list(words3.shape), list(words3.stride()),
                                     [g, 32, 32], WORDS_LAYOUT)  # fmt: skip
        s3 = packed.scales.view(-1, 8, 32).permute(1, 0, 2)
        o3 = packed.offsets.view(-1, 8, 32).permute(1, 0, 2)
        self.sdesc = TensorDescriptor(
            s3, list(s3.shape), list(s3.stride()), [8, g, 32], META_LAYOUT
        )
        self.odesc = TensorDescriptor(
            o3, list(o3.shape), list(o3.stride()), [8, g, 32], META_LAYOUT
        )
        self.blocks = triton.cdiv(packed.columns, 32)
        self.split = qm.split_for(packed.columns, k // 32, 32, programs, g)
        dev = packed.words.device
        self.part = torch.empty((self.split, packed.columns * 8), device=dev, dtype=torch.float32)
        self.count = torch.zeros(self.blocks, device=dev, dtype=torch.int32)

    def __call__(self, x):
        y = torch.empty((1, self.n), device=x.device, dtype=x.dtype)
        p = self.p
        _tma_gemv_kernel[(self.blocks, self.split)](
            self.desc, self.sdesc, self.odesc, x, self.part, y, self.count, self.n, p.columns,
            self.k, STAGES=self.stages, SPLIT=self.split > 1, G=self.g, RO=self.ro, num_warps=self.g,
        )  # fmt: skip
        return y


def graph_us(fn, reps=20):
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--stages", default="3:264,4:132,6:132")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [("qkv", 16384, 5376), ("o", 5376, 8192), ("gate_up", 43008, 5376),
              ("down", 5376, 21504)]  # fmt: skip
    base = []
    for _name, n, k in shapes:
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        qw = Q.quantize(w, Q.QuantFormat("int4", 32), search=False)
        base.append(qm.KMajorWeight.pack(qw, torch.bfloat16))
        del w, qw
    layers = [base]
    for _ in range(args.layers - 1):
        layers.append([qm.KMajorWeight(m.kind, m.shape, m.group_size, m.words.clone(),
                                       m.scales.clone(), m.offsets.clone(), block=m.block,
                                       width=m.width) for m in base])  # fmt: skip
        for m in layers[-1]:
            m.counters(1)
    nbytes = sum(m.nbytes for m in base)
    print(f"layer bytes {nbytes / 1e6:.1f} MB, {args.layers} layers", flush=True)
    x = torch.randn(1, 5376, device=dev, dtype=torch.bfloat16)
    cfgs = [(32, 264, 8, 8), (32, 264, 8, 8), (64, 264, 8, 8), (32, 264, 8, 8)]

    def run_seq():
        y = x
        for ms in layers:
            for m, c in zip(ms, cfgs):
                y = qm.qgemv(y[:, : m.shape[1]], m, c)
        return y

    for pdl in ("1", "0"):
        os.environ["TOKENPIPE_QUANT_PDL"] = pdl
        per = graph_us(run_seq) / args.layers
        print(f"qgemv chain (PDL {pdl}): {per:.1f} us a layer, "
              f"{nbytes / (per * 1e-6) / 1e12:.2f} TB/s", flush=True)  # fmt: skip
    os.environ["TOKENPIPE_QUANT_PDL"] = "1"
    for spec in args.stages.split(","):
        ro = spec.endswith("ro")
        stages, programs, g = (int(v) for v in spec.removesuffix("ro").split(":"))
        try:
            gemvs = [[TmaGemv(m, programs, stages, g, ro) for m in ms] for ms in layers]
            for (name, n, k), m, gv in zip(shapes, base, gemvs[0]):
                xi = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
                got = gv(xi).float()
                want = qm.qgemv(xi, m, (32, 264, 8, 8)).float()
                err = (got - want).abs().max().item() / want.abs().max().item()
                print(f"  {name} stages {stages} programs {programs} split {gv.split}: rel err "
                      f"vs qgemv {err:.2e}", flush=True)  # fmt: skip
            for (name, n, k), m, gv in zip(shapes, base, gemvs[0]):
                many = [g[shapes.index((name, n, k))] for g in gemvs]
                xi = torch.randn(1, k, device=dev, dtype=torch.bfloat16)

                def one(many=many, xi=xi):
                    for gvm in many:
                        gvm(xi)

                def ref(xi=xi, i=shapes.index((name, n, k))):
                    for ms in layers:
                        qm.qgemv(xi, ms[i], cfgs[i])

                a, b = graph_us(one) / len(many), graph_us(ref) / len(many)
                print(f"  {name}: tma {a:.1f} us ({m.nbytes / a / 1e6:.2f} TB/s), qgemv {b:.1f} "
                      f"us ({m.nbytes / b / 1e6:.2f} TB/s)", flush=True)  # fmt: skip

            def run_tma(gemvs=gemvs):
                y = x
                for gs, ms in zip(gemvs, layers):
                    for gv, m in zip(gs, ms):
                        y = gv(y[:, : m.shape[1]])
                return y

            per = graph_us(run_tma) / args.layers
            print(f"tma chain stages {stages} programs {programs} G {g} {'read-only' if ro else ''}: {per:.1f} us a layer, "
                  f"{nbytes / (per * 1e-6) / 1e12:.2f} TB/s", flush=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            print(f"stages {stages}: failed {exc!r:.600}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
