# ruff: noqa  (a prototype kept in history only: removed in the next commit)
"""Prototype (session 23, not yet run on a GPU): a layer's four int4 GEMVs in ONE persistent
Gluon kernel whose TMA weight pipeline never drains: each program's stages run through qkv, o,
gate_up and down in one sequence, so the next matrix's first STAGES - 1 stages are loading while
the program finishes the current one and waits at the grid barrier. Tests whether the per-matrix
pipeline restart (not the launch) is the fixed cost session 23 found.

python3 .dev/tma_chain.py [--layers 8] [--specs 3:528:4,3:528:4nowait]
(needs .dev/tma_gemv.py beside it for the math helpers and the harness pieces)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# session 23's helpers (plain loads of the scales): tools/proto_tma_gemv.py as of e29e5ab
from proto_tma_gemv_s23 import WORDS_LAYOUT, _pos, _store, graph_us  # noqa: E402

from worker.device.kernels import quant_matmul as qm  # noqa: E402
from worker.layers import quant as Q  # noqa: E402


@gluon.jit
def _task(pid, blocks, splits, K, G: gl.constexpr):
    groups = K // 32
    active = pid < blocks * splits
    blk = pid % blocks
    split = pid // blocks
    span = (groups + splits - 1) // splits
    first = split * span
    last = gl.minimum(first + span, groups)
    last = gl.where(active, last, first)
    n = (last - first + G - 1) // G
    return blk, split, first, last, n, blk * groups + first


@gluon.jit
def _issue(q, total, bars, wbuf, d0, d1, d2, d3, b0, b1, b2, b3, e0, e1, e2,
           STAGES: gl.constexpr, G: gl.constexpr):  # fmt: skip
    """Stage q of this program's whole sequence (phase ends e0 < e1 < e2 < total) into its
    slot, by the descriptor of the matrix it belongs to."""
    slot = q % STAGES
    pred = q < total
    bar = bars.index(slot)
    buf = wbuf.index(slot)
    mbarrier.expect(bar, G * 4096, pred=pred)
    # one predicated copy per descriptor (no descriptor chosen at run time: a selected
    # descriptor address is what the first run's illegal instruction points at)
    tma.async_copy_global_to_shared(d0, [b0 + G * q, 0, 0], bar, buf, pred=pred & (q < e0))
    tma.async_copy_global_to_shared(d1, [b1 + G * (q - e0), 0, 0], bar, buf,
                                    pred=pred & (q >= e0) & (q < e1))  # fmt: skip
    tma.async_copy_global_to_shared(d2, [b2 + G * (q - e1), 0, 0], bar, buf,
                                    pred=pred & (q >= e1) & (q < e2))  # fmt: skip
    tma.async_copy_global_to_shared(d3, [b3 + G * (q - e2), 0, 0], bar, buf,
                                    pred=pred & (q >= e2))  # fmt: skip


@gluon.jit
def _arrive(bar_ptr):
    gl.thread_barrier()
    return gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _spin(bar_ptr, target):
    """One thread polls (relaxed), backing off; then one acquire fence for every thread (an
    acquire poll compiles to an L1 invalidation each poll: session 23's chain, ~8 us a wait)."""
    seen = gl.atomic_add(bar_ptr, 0, sem="relaxed", scope="gpu")
    while seen < target:
        seen = gl.inline_asm_elementwise(
            "nanosleep.u32 32; mov.u32 $0, $1;",
            "=r,r",
            [seen],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )
        seen = gl.atomic_add(bar_ptr, 0, sem="relaxed", scope="gpu")
    gl.inline_asm_elementwise(
        "fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [seen], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _phase(q0, n, total, bars, wbuf, d0, d1, d2, d3, b0, b1, b2, b3, e0, e1, e2,
           x_ptr, s_ptr, o_ptr, part_ptr, y_ptr, count_ptr, N, C, K, blk, split, splits,
           first, last, wait_ptr, wait_for, arrive_ptr,
           STAGES: gl.constexpr, G: gl.constexpr, WAIT: gl.constexpr):  # fmt: skip
    """This program's stages q0 .. q0 + n - 1 (one matrix), then its outputs (or split
    partials, the last of a column block summing them), then its arrival at the barrier."""
    L3: gl.constexpr = gl.BlockedLayout([1, 32, 1], [1, 1, 32], [G, 1, 1], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(1, L3)
    SX: gl.constexpr = gl.SliceLayout(2, L3)
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [G], [0])
    groups = K // 32
    if WAIT:
        _spin(wait_ptr, wait_for)  # x is the matrix before's output
    gx = gl.arange(0, G, layout=gl.SliceLayout(1, SX))
    rx = gl.arange(0, 32, layout=gl.SliceLayout(0, SX))
    gm = gl.arange(0, G, layout=gl.SliceLayout(1, S2))
    cm = gl.arange(0, 32, layout=gl.SliceLayout(0, S2))
    meta_base = blk * (groups * 256) + cm[None, :]
    a0 = gl.zeros([G, 32], gl.float32, S2)
    a1 = gl.zeros([G, 32], gl.float32, S2)
    a2 = gl.zeros([G, 32], gl.float32, S2)
    a3 = gl.zeros([G, 32], gl.float32, S2)
    a4 = gl.zeros([G, 32], gl.float32, S2)
    a5 = gl.zeros([G, 32], gl.float32, S2)
    a6 = gl.zeros([G, 32], gl.float32, S2)
    a7 = gl.zeros([G, 32], gl.float32, S2)
    for t in range(n):
        q = q0 + t
        gl.thread_barrier()  # every warp is done with the slot the next issue refills
        _issue(q + STAGES - 1, total, bars, wbuf, d0, d1, d2, d3, b0, b1, b2, b3, e0, e1, e2,
               STAGES, G)  # fmt: skip
        g0 = first + G * t
        g = g0 + gx
        xmask = (g < last)[:, None] & (rx[None, :] < 32)
        xv = gl.load(x_ptr + g[:, None] * 32 + rx[None, :], mask=xmask, other=0.0).to(gl.float32)
        xb = gl.expand_dims(xv * 1.2379400392853803e27, 2)
        xs = gl.sum(gl.expand_dims(xv, 2), axis=1)
        gg = g0 + gm
        mmask = (gg < last)[:, None] & (cm[None, :] < 32)
        meta = meta_base + gg[:, None] * 256
        mbarrier.wait(bars.index(q % STAGES), (q // STAGES) & 1)
        words = wbuf.index(q % STAGES).load(L3)
        a0 = _pos(words, xb, a0, s_ptr, o_ptr, meta, mmask, xs, 0)
        a1 = _pos(words, xb, a1, s_ptr, o_ptr, meta, mmask, xs, 1)
        a2 = _pos(words, xb, a2, s_ptr, o_ptr, meta, mmask, xs, 2)
        a3 = _pos(words, xb, a3, s_ptr, o_ptr, meta, mmask, xs, 3)
        a4 = _pos(words, xb, a4, s_ptr, o_ptr, meta, mmask, xs, 4)
        a5 = _pos(words, xb, a5, s_ptr, o_ptr, meta, mmask, xs, 5)
        a6 = _pos(words, xb, a6, s_ptr, o_ptr, meta, mmask, xs, 6)
        a7 = _pos(words, xb, a7, s_ptr, o_ptr, meta, mmask, xs, 7)
    if n > 0:
        out = part_ptr + split * (C * 8)
        cols = blk * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, S2))
        _store(out, a0, cols, N, 0)
        _store(out, a1, cols, N, 1)
        _store(out, a2, cols, N, 2)
        _store(out, a3, cols, N, 3)
        _store(out, a4, cols, N, 4)
        _store(out, a5, cols, N, 5)
        _store(out, a6, cols, N, 6)
        _store(out, a7, cols, N, 7)
        gl.thread_barrier()
        arrived = gl.atomic_add(count_ptr + blk, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            outs = blk * 256 + gl.arange(0, 256, layout=L1)
            omask = outs < N
            total_o = gl.zeros([256], gl.float32, L1)
            for s in range(splits):
                total_o += gl.load(part_ptr + s * (C * 8) + outs, mask=omask, other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
            gl.store(y_ptr + outs, total_o.to(y_ptr.dtype.element_ty), mask=omask)
            gl.atomic_xchg(count_ptr + blk, 0, sem="relaxed", scope="gpu")
    return _arrive(arrive_ptr)


@gluon.jit
def _tma_chain_kernel(
    x_ptr, bar_ptr, nprog,
    d0, s0, o0, p0, y0, c0, N0, C0, K0, B0, S0,
    d1, s1, o1, p1, y1, c1, N1, C1, K1, B1, S1,
    d2, s2, o2, p2, y2, c2, N2, C2, K2, B2, S2,
    d3, s3, o3, p3, y3, c3, N3, C3, K3, B3, S3,
    STAGES: gl.constexpr, G: gl.constexpr, WAITS: gl.constexpr,
):  # fmt: skip
    pid = gl.program_id(0)
    k0, sp0, f0, l0, n0, b0 = _task(pid, B0, S0, K0, G)
    k1, sp1, f1, l1, n1, b1 = _task(pid, B1, S1, K1, G)
    k2, sp2, f2, l2, n2, b2 = _task(pid, B2, S2, K2, G)
    k3, sp3, f3, l3, n3, b3 = _task(pid, B3, S3, K3, G)
    e0 = n0
    e1 = e0 + n1
    e2 = e1 + n2
    total = e2 + n3
    wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, G, 32, 32], d0.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        _issue(i, total, bars, wbuf, d0, d1, d2, d3, b0, b1, b2, b3, e0, e1, e2, STAGES, G)
    _phase(0, n0, total, bars, wbuf, d0, d1, d2, d3, b0, b1, b2, b3, e0, e1, e2,
           x_ptr, s0, o0, p0, y0, c0, N0, C0, K0, k0, sp0, S0, f0, l0, bar_ptr, 0, bar_ptr,
           STAGES, G, False)  # fmt: skip
    _phase(e0, n1, total, bars, wbuf, d0, d1, d2, d3, b0, b1, b2, b3, e0, e1, e2,
           y0, s1, o1, p1, y1, c1, N1, C1, K1, k1, sp1, S1, f1, l1, bar_ptr, nprog, bar_ptr + 1,
           STAGES, G, WAITS)  # fmt: skip
    _phase(e1, n2, total, bars, wbuf, d0, d1, d2, d3, b0, b1, b2, b3, e0, e1, e2,
           y1, s2, o2, p2, y2, c2, N2, C2, K2, k2, sp2, S2, f2, l2, bar_ptr + 1, nprog,
           bar_ptr + 2, STAGES, G, WAITS)  # fmt: skip
    done = _phase(e2, n3, total, bars, wbuf, d0, d1, d2, d3, b0, b1, b2, b3, e0, e1, e2,
                  y2, s3, o3, p3, y3, c3, N3, C3, K3, k3, sp3, S3, f3, l3, bar_ptr + 2, nprog,
                  bar_ptr + 3, STAGES, G, WAITS)  # fmt: skip
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if done == nprog - 1:  # every program has passed every wait: reset for the next call
        for i in gl.static_range(4):
            gl.atomic_xchg(bar_ptr + i, 0, sem="relaxed", scope="gpu")


class TmaChain:
    def __init__(self, mats, programs=528, stages=3, g=4, waits=True):
        dev = mats[0].words.device
        self.programs, self.stages, self.g, self.waits = programs, stages, g, waits
        self.bar = torch.zeros(8, dtype=torch.int32, device=dev)
        self.args, self.ys = [], []
        for m in mats:
            n, k = m.shape
            assert m.block == 32 and m.group_size == 32 and m.kind == "int4"
            blocks = triton.cdiv(m.columns, 32)
            words3 = m.words.view(m.words.shape[0] * (k // 32), 32, 32)
            desc = TensorDescriptor(words3, list(words3.shape), list(words3.stride()),
                                    [g, 32, 32], WORDS_LAYOUT)  # fmt: skip
            split = qm.split_for(m.columns, k // 32, 32, programs, g)
            assert blocks * split <= programs
            part = torch.empty((split, m.columns * 8), device=dev, dtype=torch.float32)
            y = torch.empty((1, n), device=dev, dtype=torch.bfloat16)
            count = torch.zeros(blocks, device=dev, dtype=torch.int32)
            self.args += [desc, m.scales, m.offsets, part, y, count, n, m.columns, k, blocks,
                          split]  # fmt: skip
            self.ys.append(y)

    def __call__(self, x):
        _tma_chain_kernel[(self.programs,)](
            x, self.bar, self.programs, *self.args, STAGES=self.stages, G=self.g,
            WAITS=self.waits, num_warps=self.g,
        )  # fmt: skip
        return self.ys[-1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--specs", default="3:528:4,3:528:4nowait")
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
    x = torch.randn(1, 5376, device=dev, dtype=torch.bfloat16)
    cfgs = [(32, 264, 8, 8), (32, 264, 8, 8), (64, 264, 8, 8), (32, 264, 8, 8)]

    def seq(ms, y):
        for m, c in zip(ms, cfgs, strict=True):
            y = qm.qgemv(y[:, : m.shape[1]], m, c)
        return y

    def run_seq():
        y = x
        for ms in layers:
            y = seq(ms, y)
        return y

    per = graph_us(run_seq) / args.layers
    print(f"qgemv chain: {per:.1f} us a layer, {nbytes / (per * 1e-6) / 1e12:.2f} TB/s",
          flush=True)  # fmt: skip
    for spec in args.specs.split(","):
        waits = not spec.endswith("nowait")
        stages, programs, g = (int(v) for v in spec.removesuffix("nowait").split(":"))
        try:
            chains = [TmaChain(ms, programs, stages, g, waits) for ms in layers]
            got = chains[0](x).float()
            want = seq(layers[0], x).float()
            err = (got - want).abs().max().item() / want.abs().max().item()
            again = torch.equal(chains[0](x).float(), got)
            print(f"  tma chain {spec}: rel err vs qgemv {err:.2e}, second call same {again}, "
                  f"bars {chains[0].bar.tolist()[:4]}", flush=True)  # fmt: skip

            def run(chains=chains):
                y = x
                for c in chains:
                    y = c(y[:, :5376])
                return y

            per = graph_us(run) / args.layers
            print(f"tma chain {spec}: {per:.1f} us a layer, "
                  f"{nbytes / (per * 1e-6) / 1e12:.2f} TB/s", flush=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            print(f"tma chain {spec}: failed {exc!r:.600}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
