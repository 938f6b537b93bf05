"""A candidate for the 32-row int4 decode GEMM, written in Gluon (Triton's explicit-layout
dialect), beside today's `_qgemm_kernel` on the Gemma 4 31B matrices. Not used by the worker.

Why (BENCHMARKS, sessions 20-21): Nsight Compute shows today's GEMM at 8 warps an SM, held there
by registers (its 128 accumulators a thread: 512 outputs x 32 rows over 4 warps), with half
the issue slots busy and the warps waiting on the dequantization's dependent instructions.
This kernel stacks two code positions of the same 32 words in one wgmma tile: rows 0-31 of a
[64, K step] tile are position 2j, rows 32-63 position 2j+1 (warps 0-1 and 2-3). Each thread
loads its words straight into the wgmma A-operand register layout and makes only its warp's
position, once, as bf16 pairs (a byte permute, an AND/OR into 128 + code, a bf16x2 subtract
and FMA; odd positions from the words shifted right by one, 128 + 8 code, with the scale / 8).
A program: 4 warps, 256 outputs x 32 rows, 4 accumulators of [64, 32] fp32 = 64 registers a
thread, so at 128 registers four programs (16 warps) fit an SM.

    python tools/proto_gluon_gemm.py --offline [--triton /tmp/t36] [--dump DIR]   # no GPU
    python tools/proto_gluon_gemm.py [--only gate_up_proj] [--rows 32]           # on an H200

Offline (Triton 3.6, sm_90a) it compiles to 128 registers at ~4.3 SASS instructions a weight
(today's tile: 255 and 3.64). On a GPU it checks the output against ``qgemm`` (the same bf16
weights; only the order of the sums differs) and times both, weights rotated past L2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parent))
sys.path.insert(0, str(TOOLS))


def _early_triton() -> None:
    """--triton DIR: that Triton install first on the path (before anything imports one)."""
    if "--triton" in sys.argv:
        sys.path.insert(0, sys.argv[sys.argv.index("--triton") + 1])


_early_triton()

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
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

    rows = gl.arange(0, 2 * BLOCK_W, layout=gl.SliceLayout(1, A))  # the stacked tile's rows
    ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, A))
    col = pid_c * BLOCK_W + rows % BLOCK_W  # each row's word column
    half = rows // BLOCK_W  # 0: a pair's even position, 1: its odd one
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

    acc0 = gl.zeros([2 * BLOCK_W, BLOCK_M], gl.float32, MMA)
    acc1 = gl.zeros([2 * BLOCK_W, BLOCK_M], gl.float32, MMA)
    acc2 = gl.zeros([2 * BLOCK_W, BLOCK_M], gl.float32, MMA)
    acc3 = gl.zeros([2 * BLOCK_W, BLOCK_M], gl.float32, MMA)
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
        for j in gl.static_range(4):
            p = 2 * j + half
            scale = gl.load(s_ptr + meta + p * RS).to(gl.float32)
            scale = (scale * gl.where(half == 1, 0.125, 1.0)).to(gl.bfloat16)
            offset = gl.load(o_ptr + meta + p * RS)
            sb = scale.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
            ob = offset.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
            sc, _ = gl.broadcast((sb | (sb << 16))[:, None], words)
            of, _ = gl.broadcast((ob | (ob << 16))[:, None], words)
            mask, _ = gl.broadcast(gl.where(half == 1, 0x00780078, 0x000F000F)[:, None], words)
            w = gl.inline_asm_elementwise(pair_asm(j), "=r,r,r,r,r,r,r,r,r", [words, mask, sc, of],
                                          dtype=gl.bfloat16, is_pure=True, pack=2)  # fmt: skip
            if j == 0:
                acc0 = warpgroup_mma(w, b, acc0, is_async=True)
            elif j == 1:
                acc1 = warpgroup_mma(w, b, acc1, is_async=True)
            elif j == 2:
                acc2 = warpgroup_mma(w, b, acc2, is_async=True)
            else:
                acc3 = warpgroup_mma(w, b, acc3, is_async=True)
        # the step's MMAs done before x's tile is replaced
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(0, deps=(acc0, acc1, acc2, acc3))

    # row r of tile j is output (column * 8 + 2 j + r // BLOCK_W); column n is x's row n
    orow = gl.arange(0, 2 * BLOCK_W, layout=gl.SliceLayout(1, MMA))
    ocol = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    first = (pid_c * BLOCK_W + orow % BLOCK_W) * P + orow // BLOCK_W
    base = y_ptr + ocol[None, :].to(gl.int64) * N
    ty = y_ptr.dtype.element_ty
    for j in gl.static_range(4):
        out = first + 2 * j
        mask = (out < N)[:, None] & (ocol < M)[None, :]
        acc = acc0 if j == 0 else (acc1 if j == 1 else (acc2 if j == 2 else acc3))
        gl.store(base + out[:, None], acc.to(ty), mask=mask)


BLOCK_W = 32
PROGRAMS = 528  # four an SM of an H200
MAXNREG = 128


def stacked_gemm(
    x: Any, packed: Any, split: int | None = None, programs: int = PROGRAMS, maxnreg: int = MAXNREG
) -> Any:
    """x [M <= 32, K] bf16 @ W^T -> [M, N] bf16 for an int4 g32 ``KMajorWeight`` with bf16
    scales and offsets; K split for about PROGRAMS programs, partials summed by
    ``quant_matmul._reduce_kernel``; ``maxnreg`` 0: no register cap."""
    import torch
    import triton

    from worker.device.kernels import quant_matmul as qm

    m, k = x.shape
    n = packed.shape[0]
    assert m <= 32 and x.dtype == torch.bfloat16 and packed.kind == qm.INT4
    assert packed.group_size == 32 and packed.scales.dtype == torch.bfloat16
    tiles = triton.cdiv(packed.columns, BLOCK_W)
    if split is None:
        split = max(1, min(k // 32, programs // tiles))
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    out = y if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    _stacked_gemm_kernel[(tiles, split)](
        x, packed.words, packed.scales, packed.offsets, out, m, n, packed.columns, k,
        x.stride(0), BLOCK_W=BLOCK_W, BLOCK_K=32, BLOCK_M=32, BW=packed.block, num_warps=4,
        maxnreg=maxnreg or None,
    )  # fmt: skip
    if split > 1:
        count = m * n
        qm._reduce_kernel[(triton.cdiv(count, 256),)](out, y, count, SPLIT=split, BLOCK=256,
                                                      num_warps=2)  # fmt: skip
    return y


def offline(dump: str | None) -> None:
    """Compile for sm_90a without a GPU and print registers and the loop's instructions."""
    import sass_quant_kernels as sq
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for bw, maxnreg in ((32, None), (32, MAXNREG), (0, MAXNREG)):
        sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "o_ptr": "*bf16",
               "y_ptr": "*fp32", "M": "i32", "N": "i32", "C": "i32", "K": "i32",
               "stride_xm": "i32"}  # fmt: skip
        const = {"BLOCK_W": BLOCK_W, "BLOCK_K": 32, "BLOCK_M": 32, "BW": bw}
        sig.update({key: "constexpr" for key in const})
        attrs = {(i,): [["tt.divisibility", 16]] for i, (arg, ty) in enumerate(sig.items())
                 if ty.startswith("*") or arg in ("N", "C", "K", "stride_xm")}  # fmt: skip
        source = GluonASTSource(fn=_stacked_gemm_kernel, signature=sig, constexprs=const,
                                attrs=attrs)  # fmt: skip
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "maxnreg": maxnreg})  # fmt: skip
        name = f"gluon_stacked_w{BLOCK_W}_bw{bw}_maxnreg{maxnreg}"
        sq.report(name, kernel, 2 * BLOCK_W * 32 * 4 / 128, dump)
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
        with open(f"/tmp/{name}.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"/tmp/{name}.ptx", "-o", "/dev/null"],
                              capture_output=True, text=True).stderr  # fmt: skip
        print("   ", " ".join(ln.split("info    :")[-1].strip() for ln in info.splitlines()
                              if "spill" in ln or "Used" in ln))  # fmt: skip


def on_gpu(only: set[str] | None, rows: int, model: Path, variants: list[tuple[int, int]]) -> None:
    import torch
    import torch.nn.functional as F
    from bench_quant_kernels import model_shapes, rotated

    from worker.device.kernels import quant_matmul as qm
    from worker.layers import quant as Q

    dev = torch.device("cuda")
    today = (64, 32, 4, 4, 1, 264)  # the start-up's pick for the 31B matrices (session 20)
    print(f"# {torch.cuda.get_device_name()}, {rows} rows; us a call, weights past L2; "
          "Gluon variants (programs, maxnreg)")  # fmt: skip
    print("| matrix | today's GEMM | Gluon variant | Gluon | speed-up | max error vs qgemm "
          "| vs torch |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    seen = {"lm_head"}
    for name, n, k, _ in model_shapes(model):
        if name in seen or (only is not None and name not in only):
            continue
        seen.add(name)
        weight = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        qw = Q.quantize(weight, Q.QuantFormat("int4", 32), search=False)
        packed = qm.KMajorWeight.pack(qw, torch.bfloat16)
        more = max(0, -(-200_000_000 // packed.nbytes) - 1)
        copies = [packed] + [qm.KMajorWeight.pack(qw, torch.bfloat16) for _ in range(more)]
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        want = qm.qgemm(x, packed, today).float()
        ref = F.linear(x.float(), qw.dequantize(torch.float32)).float()
        scale = want.abs().max().item()
        t_today = rotated(lambda w, x=x: qm.qgemm(x, w, today), copies) * 1e6
        for programs, maxnreg in variants:
            got = stacked_gemm(x, packed, programs=programs, maxnreg=maxnreg).float()
            err = (got - want).abs().max().item() / scale
            err_ref = (got - ref).abs().max().item() / scale
            t_ours = (
                rotated(
                    lambda w, x=x, p=programs, r=maxnreg: stacked_gemm(x, w, programs=p, maxnreg=r),
                    copies,
                )
                * 1e6
            )
            print(f"| {name} [{n}, {k}] | {t_today:.1f} | {programs}, {maxnreg} | {t_ours:.1f} | "
                  f"{t_today / t_ours:.2f}x | {err:.2e} | {err_ref:.2e} |", flush=True)  # fmt: skip
        del copies, packed
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--offline", action="store_true", help="compile for sm_90a, no GPU")
    p.add_argument("--triton", default=None, help="a Triton install to put first (offline)")
    p.add_argument("--dump", default=None, help="offline: write SASS / PTX / TTGIR here")
    p.add_argument("--only", default="", help="matrix names (qkv_proj,o_proj,...)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument(
        "--variants",
        default=f"{PROGRAMS},{MAXNREG};396,{MAXNREG};{PROGRAMS},0",
        help="Gluon variants to time: programs,maxnreg;... (maxnreg 0: no cap)",
    )
    p.add_argument("--model", default=str(TOOLS.parent / "examples" / "gemma4_31b"))
    args = p.parse_args()
    if args.offline:
        offline(args.dump)
        return
    only = set(args.only.split(",")) if args.only else None
    variants = [tuple(int(v) for v in t.split(",")) for t in args.variants.split(";")]
    on_gpu(only, args.rows, Path(args.model), variants)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
