"""Prototype: a decode layer's four int4 GEMVs (qkv, o, gate_up, down) in ONE persistent kernel
with grid barriers between them; each program loads its next matrix's first words before it
waits. Compared with the four separate (PDL) qgemv launches, in CUDA graphs, weights past L2
(8 layers' copies). Variants: spin0 (acquire-atomic poll), spin1 (every thread polls a volatile
load), spin2 (one thread polls, then one fence), nowait (no barriers: wrong results, the
launch-free bound), nowait_ro (also one FFMA a word instead of the codes' math).

python3 tools/proto_chain_gemv.py [--layers 8] [--variants spin2,nowait,nowait_ro]

Session 23 (BENCHMARKS "session 23"): the chain is bit-exact and slower (106.5 against 98.8 us
a layer at best); removed from the tree after this commit.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
import triton.language as tl

from worker.device.kernels import quant_matmul as qm
from worker.device.kernels.quant_matmul import (
    _gemv_dot_row,
    _gemv_finish,
    _gemv_group_end,
    _gemv_meta,
    _gemv_words,
    _layout,
)
from worker.layers import quant as Q


@triton.jit
def _xload(x_ptr, g, row, mask_g, GROUP: tl.constexpr):
    # L1-cached like the GEMV's: every wait ends in a fence that invalidates L1 (CCTL.IVALL)
    return tl.load(x_ptr + g * GROUP + row, mask=mask_g, other=0.0).to(tl.float32)


@triton.jit
def _spin(bar_ptr, target):
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _spin_relaxed(bar_ptr, target):
    """Poll with plain volatile loads (no L1 invalidation a poll), back off, then one fence."""
    seen = tl.load(bar_ptr, volatile=True)
    while seen < target:
        seen = tl.inline_asm_elementwise("nanosleep.u32 32; mov.u32 $0, $1;", "=r,r", [seen],
                                         dtype=tl.int32, is_pure=False, pack=1)
        seen = tl.load(bar_ptr, volatile=True)
    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [seen],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_one(bar_ptr, target):
    """One thread polls (a relaxed scalar atomic: Triton gives it to one thread and broadcasts
    the value), backing off; then one acquire fence for every thread."""
    seen = tl.atomic_add(bar_ptr, 0, sem="relaxed", scope="gpu")
    while seen < target:
        seen = tl.inline_asm_elementwise("nanosleep.u32 32; mov.u32 $0, $1;", "=r,r", [seen],
                                         dtype=tl.int32, is_pure=False, pack=1)
        seen = tl.atomic_add(bar_ptr, 0, sem="relaxed", scope="gpu")
    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [seen],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _arrive(bar_ptr):
    tl.debug_barrier()
    return tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _phase(x_ptr, w_ptr, s_ptr, o_ptr, part_ptr, y_ptr, count_ptr, wait_ptr, bar_ptr, wait_for, pid,
           N, C, K, blocks, splits,
           GROUP: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, WARPS: tl.constexpr,
           BW: tl.constexpr, WAIT: tl.constexpr, SPIN: tl.constexpr, RO: tl.constexpr):  # fmt: skip
    INT4_KIND: tl.constexpr = True
    P: tl.constexpr = 8
    SUB: tl.constexpr = GROUP // ROWS
    tasks = blocks * splits
    active = pid < tasks
    blk = pid % blocks
    split = pid // blocks
    offs_c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    words_at, meta_at, RS = _layout(offs_c, C, K, GROUP, P, BW)
    lanes = tl.arange(0, WARPS)
    groups = K // GROUP
    span = tl.cdiv(groups, splits)
    first = split * span
    last = tl.minimum(first + span, groups)
    last = tl.where(active, last, first)
    g = first + lanes
    mask_g = g < last
    w0 = _gemv_words(w_ptr, g, 0, mask_g, mask_c, words_at, RS, GROUP)
    w1 = _gemv_words(w_ptr, g, 1, mask_g, mask_c, words_at, RS, GROUP)
    w2 = _gemv_words(w_ptr, g, 2, mask_g, mask_c, words_at, RS, GROUP)
    w3 = _gemv_words(w_ptr, g, 3, mask_g, mask_c, words_at, RS, GROUP)
    w4 = _gemv_words(w_ptr, g, 4, mask_g, mask_c, words_at, RS, GROUP)
    w5 = _gemv_words(w_ptr, g, 5, mask_g, mask_c, words_at, RS, GROUP)
    w6 = _gemv_words(w_ptr, g, 6, mask_g, mask_c, words_at, RS, GROUP)
    w7 = _gemv_words(w_ptr, g, 7, mask_g, mask_c, words_at, RS, GROUP)
    if WAIT:
        if SPIN == 0:
            _spin(wait_ptr, wait_for)
        elif SPIN == 1:
            _spin_relaxed(wait_ptr, wait_for)
        else:
            _spin_one(wait_ptr, wait_for)
    x0 = _xload(x_ptr, g, 0, mask_g, GROUP)
    x1 = _xload(x_ptr, g, 1, mask_g, GROUP)
    x2 = _xload(x_ptr, g, 2, mask_g, GROUP)
    x3 = _xload(x_ptr, g, 3, mask_g, GROUP)
    x4 = _xload(x_ptr, g, 4, mask_g, GROUP)
    x5 = _xload(x_ptr, g, 5, mask_g, GROUP)
    x6 = _xload(x_ptr, g, 6, mask_g, GROUP)
    x7 = _xload(x_ptr, g, 7, mask_g, GROUP)
    a0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    a7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
    for g0 in range(first, last, WARPS):
        g = g0 + lanes
        mask_g = g < last
        mask = mask_g[:, None] & mask_c[None, :]
        meta = g[:, None] * (P * RS) + meta_at[None, :]
        s0 = _gemv_meta(s_ptr, meta, mask, 0, RS)
        s1 = _gemv_meta(s_ptr, meta, mask, 1, RS)
        s2 = _gemv_meta(s_ptr, meta, mask, 2, RS)
        s3 = _gemv_meta(s_ptr, meta, mask, 3, RS)
        s4 = _gemv_meta(s_ptr, meta, mask, 4, RS)
        s5 = _gemv_meta(s_ptr, meta, mask, 5, RS)
        s6 = _gemv_meta(s_ptr, meta, mask, 6, RS)
        s7 = _gemv_meta(s_ptr, meta, mask, 7, RS)
        o0 = _gemv_meta(o_ptr, meta, mask, 0, RS)
        o1 = _gemv_meta(o_ptr, meta, mask, 1, RS)
        o2 = _gemv_meta(o_ptr, meta, mask, 2, RS)
        o3 = _gemv_meta(o_ptr, meta, mask, 3, RS)
        o4 = _gemv_meta(o_ptr, meta, mask, 4, RS)
        o5 = _gemv_meta(o_ptr, meta, mask, 5, RS)
        o6 = _gemv_meta(o_ptr, meta, mask, 6, RS)
        o7 = _gemv_meta(o_ptr, meta, mask, 7, RS)
        d0 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d1 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d2 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d3 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d4 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d5 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d6 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        d7 = tl.zeros([WARPS, BLOCK_C], dtype=tl.float32)
        xs = tl.zeros([WARPS], dtype=tl.float32)
        for sub in tl.static_range(SUB):
            if sub + 1 < SUB:
                ng = g
            else:
                ng = g + WARPS
            nm = ng < last
            r0 = ((sub + 1) % SUB) * ROWS
            n0 = _gemv_words(w_ptr, ng, r0, nm, mask_c, words_at, RS, GROUP)
            n1 = _gemv_words(w_ptr, ng, r0 + 1, nm, mask_c, words_at, RS, GROUP)
            n2 = _gemv_words(w_ptr, ng, r0 + 2, nm, mask_c, words_at, RS, GROUP)
            n3 = _gemv_words(w_ptr, ng, r0 + 3, nm, mask_c, words_at, RS, GROUP)
            n4 = _gemv_words(w_ptr, ng, r0 + 4, nm, mask_c, words_at, RS, GROUP)
            n5 = _gemv_words(w_ptr, ng, r0 + 5, nm, mask_c, words_at, RS, GROUP)
            n6 = _gemv_words(w_ptr, ng, r0 + 6, nm, mask_c, words_at, RS, GROUP)
            n7 = _gemv_words(w_ptr, ng, r0 + 7, nm, mask_c, words_at, RS, GROUP)
            y0 = _xload(x_ptr, ng, r0, nm, GROUP)
            y1 = _xload(x_ptr, ng, r0 + 1, nm, GROUP)
            y2 = _xload(x_ptr, ng, r0 + 2, nm, GROUP)
            y3 = _xload(x_ptr, ng, r0 + 3, nm, GROUP)
            y4 = _xload(x_ptr, ng, r0 + 4, nm, GROUP)
            y5 = _xload(x_ptr, ng, r0 + 5, nm, GROUP)
            y6 = _xload(x_ptr, ng, r0 + 6, nm, GROUP)
            y7 = _xload(x_ptr, ng, r0 + 7, nm, GROUP)
            if RO:  # read-only bound: one FFMA a word instead of the eight codes' math
                d0 += w0.to(tl.float32, bitcast=True) * x0[:, None]
                d1 += w1.to(tl.float32, bitcast=True) * x1[:, None]
                d2 += w2.to(tl.float32, bitcast=True) * x2[:, None]
                d3 += w3.to(tl.float32, bitcast=True) * x3[:, None]
                d4 += w4.to(tl.float32, bitcast=True) * x4[:, None]
                d5 += w5.to(tl.float32, bitcast=True) * x5[:, None]
                d6 += w6.to(tl.float32, bitcast=True) * x6[:, None]
                d7 += w7.to(tl.float32, bitcast=True) * x7[:, None]
            else:
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w0, x0, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w1, x1, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w2, x2, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w3, x3, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w4, x4, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w5, x5, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w6, x6, INT4_KIND)  # fmt: skip
                d0, d1, d2, d3, d4, d5, d6, d7, xs = _gemv_dot_row(
                    d0, d1, d2, d3, d4, d5, d6, d7, xs, w7, x7, INT4_KIND)  # fmt: skip
            w0, x0, w1, x1, w2, x2, w3, x3 = n0, y0, n1, y1, n2, y2, n3, y3
            w4, x4, w5, x5, w6, x6, w7, x7 = n4, y4, n5, y5, n6, y6, n7, y7
        xsum = xs[:, None]
        a0 = _gemv_group_end(a0, d0, s0, o0, xsum, 0, INT4_KIND)
        a1 = _gemv_group_end(a1, d1, s1, o1, xsum, 1, INT4_KIND)
        a2 = _gemv_group_end(a2, d2, s2, o2, xsum, 2, INT4_KIND)
        a3 = _gemv_group_end(a3, d3, s3, o3, xsum, 3, INT4_KIND)
        a4 = _gemv_group_end(a4, d4, s4, o4, xsum, 4, INT4_KIND)
        a5 = _gemv_group_end(a5, d5, s5, o5, xsum, 5, INT4_KIND)
        a6 = _gemv_group_end(a6, d6, s6, o6, xsum, 6, INT4_KIND)
        a7 = _gemv_group_end(a7, d7, s7, o7, xsum, 7, INT4_KIND)
    if active:
        _gemv_finish(a0, a1, a2, a3, a4, a5, a6, a7, part_ptr, y_ptr, count_ptr, blk, split,
                     splits, offs_c, mask_c, N, C, BLOCK_C, INT4_KIND, True)  # fmt: skip
    return _arrive(bar_ptr)


@triton.jit
def _chain_kernel(
    x_ptr, bar_ptr, nprog,
    w1, s1, o1, p1, y1, c1, N1, C1, K1, B1, S1,
    w2, s2, o2, p2, y2, c2, N2, C2, K2, B2, S2,
    w3, s3, o3, p3, y3, c3, N3, C3, K3, B3, S3,
    w4, s4, o4, p4, y4, c4, N4, C4, K4, B4, S4,
    GROUP: tl.constexpr, BC1: tl.constexpr, BC2: tl.constexpr, BC3: tl.constexpr,
    BC4: tl.constexpr, ROWS: tl.constexpr, WARPS: tl.constexpr, BW: tl.constexpr,
    WAITS: tl.constexpr, SPIN: tl.constexpr, RO: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    _phase(x_ptr, w1, s1, o1, p1, y1, c1, bar_ptr, bar_ptr, 0, pid, N1, C1, K1, B1, S1,
           GROUP, BC1, ROWS, WARPS, BW, False, SPIN, RO)  # fmt: skip
    _phase(y1, w2, s2, o2, p2, y2, c2, bar_ptr, bar_ptr + 1, nprog, pid, N2, C2, K2, B2, S2,
           GROUP, BC2, ROWS, WARPS, BW, WAITS, SPIN, RO)  # fmt: skip
    _phase(y2, w3, s3, o3, p3, y3, c3, bar_ptr + 1, bar_ptr + 2, nprog, pid, N3, C3, K3, B3, S3,
           GROUP, BC3, ROWS, WARPS, BW, WAITS, SPIN, RO)  # fmt: skip
    done = _phase(y3, w4, s4, o4, p4, y4, c4, bar_ptr + 2, bar_ptr + 3, nprog, pid, N4, C4, K4,
                  B4, S4, GROUP, BC4, ROWS, WARPS, BW, WAITS, SPIN, RO)  # fmt: skip
    if done == nprog - 1:  # every program has passed every wait: reset for the next call
        for i in tl.static_range(4):
            tl.atomic_xchg(bar_ptr + i, 0, sem="relaxed", scope="gpu")


class Chain:
    """One layer's four matrices and the buffers of a chain call."""

    def __init__(self, mats, blocks_c, nprog, dev, waits=True, spin=1, ro=False):
        self.waits, self.spin, self.ro = waits, spin, ro
        self.mats = mats
        self.bc = blocks_c
        self.nprog = nprog
        self.bar = torch.zeros(8, dtype=torch.int32, device=dev)
        self.parts, self.ys, self.args = [], [], []
        for m, bc in zip(mats, blocks_c):
            n, k = m.shape
            blocks = triton.cdiv(m.columns, bc)
            split = qm.split_for(m.columns, k // m.group_size, bc, nprog, 8)
            y = torch.empty((1, n), device=dev, dtype=torch.bfloat16)
            part = torch.empty((split, m.columns * 8), device=dev, dtype=torch.float32)
            self.args += [m.words, m.scales, m.offsets, part, y, m.counters(blocks), n,
                          m.columns, k, blocks, split]  # fmt: skip
            self.ys.append(y)
            assert blocks * split <= nprog, (blocks, split, nprog)

    def __call__(self, x):
        _chain_kernel[(self.nprog,)](
            x, self.bar, self.nprog, *self.args, GROUP=32, BC1=self.bc[0], BC2=self.bc[1],
            BC3=self.bc[2], BC4=self.bc[3], ROWS=8, WARPS=8, BW=self.mats[0].block, WAITS=self.waits,
            SPIN=self.spin, RO=self.ro, num_warps=8, **({"maxnreg": 128} if self.ro else {}),
        )  # fmt: skip
        return self.ys[-1]


def sequential(x, mats, configs):
    y = x
    for m, c in zip(mats, configs):
        y = qm.qgemv(y[:, : m.shape[1]], m, c)
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
    return min(best) * 1e6, sorted(best)[len(best) // 2] * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--nprog", type=int, default=264)
    ap.add_argument("--variants", default="spin1,nowait")
    ap.add_argument("--bcs", default="32,32,64,32")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [("qkv", 16384, 5376), ("o", 5376, 8192), ("gate_up", 43008, 5376),
              ("down", 5376, 21504)]  # fmt: skip
    base = []
    for name, n, k in shapes:
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        qw = Q.quantize(w, Q.QuantFormat("int4", 32), search=False)
        base.append(qm.KMajorWeight.pack(qw, torch.bfloat16))
        del w, qw
    layers = [base]
    for _ in range(args.layers - 1):
        copy = []
        for m in base:
            c = qm.KMajorWeight(m.kind, m.shape, m.group_size, m.words.clone(), m.scales.clone(),
                                m.offsets.clone(), block=m.block, width=m.width)  # fmt: skip
            c.counters(1)
            copy.append(c)
        layers.append(copy)
    nbytes = sum(m.nbytes for m in base)
    print(f"layer bytes {nbytes / 1e6:.1f} MB, {args.layers} layers", flush=True)
    seq_cfg = [(32, 264, 8, 8), (32, 264, 8, 8), (64, 264, 8, 8), (32, 264, 8, 8)]
    x = torch.randn(1, 5376, device=dev, dtype=torch.bfloat16)
    # correctness: chain vs sequential on layer 0
    bcs = [int(v) for v in args.bcs.split(",")]
    cfgs = [(bc, args.nprog, 8, 8) for bc in bcs]

    def run_seq(cfgs=cfgs):
        y = x
        for ms in layers:
            y = sequential(y, ms, cfgs)
        return y

    best, med = graph_us(run_seq)
    per = best / args.layers
    print(f"sequential {bcs}: {per:.1f} us a layer (median {med / args.layers:.1f}), "
          f"{nbytes / (per * 1e-6) / 1e12:.2f} TB/s", flush=True)  # fmt: skip
    for variant in args.variants.split(","):
        spin = {"spin0": 0, "spin1": 1}.get(variant, 2)
        chains = [Chain(ms, bcs, args.nprog, dev, not variant.startswith("nowait"), spin,
                        variant == "nowait_ro") for ms in layers]  # fmt: skip
        got = chains[0](x)
        torch.cuda.synchronize()
        want = sequential(x, layers[0], cfgs)
        same = torch.equal(got, want)
        err = (got.float() - want.float()).abs().max().item()
        print(f"chain {variant} {bcs}: equal to sequential {same}, max diff {err:.3e}; bars "
              f"{chains[0].bar.tolist()}", flush=True)  # fmt: skip
        got2 = chains[0](x)
        print(f"  second call equal {torch.equal(got2, got)}", flush=True)

        def run_chain(chains=chains):
            y = x
            for c in chains:
                y = c(y[:, :5376])
            return y

        for label, fn in ((f"chain {variant}", run_chain),):
            best, med = graph_us(fn)
            per = best / args.layers
            print(f"{label:10s} {bcs}: {per:.1f} us a layer (median {med / args.layers:.1f}), "
                  f"{nbytes / (per * 1e-6) / 1e12:.2f} TB/s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
