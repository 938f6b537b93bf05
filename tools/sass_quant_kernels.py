"""Offline SASS counts of the dense quantized matmul kernels (worker/device/kernels/quant_matmul.py)
for an sm_90 GPU, on a machine without one.

    python tools/sass_quant_kernels.py [--triton /tmp/t36] [--dump DIR]

Each kernel is compiled by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with the
launcher's 16-byte divisibility hints given by hand (pointers, and N / C / K: the Gemma 4 31B
sizes are multiples of 16), then the cubin is read with the ``cuobjdump`` Triton bundles. Printed
per kernel and tile: registers, the SASS instructions of the main loop (the longest backward
branch), the weights one thread handles in that loop pass, and the ratio (instructions per
weight; the AND + FMA floor of the K-major layout is 2). ``--triton`` puts another Triton
install first on the path (the H200 runs Triton 3.6: ``pip install --no-deps --target
/tmp/t36 triton==3.6.0``, then ``--triton /tmp/t36``; the dev box's Triton 3.9 cannot compile
these kernels offline). Arguments a kernel takes with a default (PREFETCH, BW) are given here
explicitly: ``ASTSource`` does not fill them in.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def compile_sm90(fn, signature, constexprs, num_warps, div16=(), num_stages=3):  # type: ignore[no-untyped-def]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {}
    for i, (arg, ty) in enumerate(signature.items()):
        if ty.startswith("*") or arg in div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def loop_count(sass: str) -> int:
    """Instructions of the longest loop (backward branch) in the SASS listing."""
    best = 0
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?BRA\s+\D*(0x[0-9a-f]+)", line)
        if m and int(m.group(3), 16) < int(m.group(1), 16):
            best = max(best, (int(m.group(1), 16) - int(m.group(3), 16)) // 16)
    return best


def registers(cubin: bytes) -> int:
    out = _cuobjdump(cubin, "--dump-resource-usage")
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else -1


def report(name: str, kernel, weights_per_thread: float, dump: str | None) -> None:  # type: ignore[no-untyped-def]
    cubin = kernel.asm["cubin"]
    sass = _cuobjdump(cubin, "-sass")
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{name}.sass"), "w") as f:
            f.write(sass)
        with open(os.path.join(dump, f"{name}.ttgir"), "w") as f:
            f.write(kernel.asm["ttgir"])
        with open(os.path.join(dump, f"{name}.ptx"), "w") as f:
            f.write(kernel.asm["ptx"])
    loop = loop_count(sass)
    layout = [ln for ln in kernel.asm["ttgir"].splitlines() if ln.startswith("#blocked")][:2]
    mmas = sass.count("HGMMA.")
    serial = f", {sass.count('DEPBAR.LE gsb0, 0x0')} full waits for {mmas} wgmma" if mmas else ""
    print(f"{name}: regs {registers(cubin)}, loop {loop} instrs, {weights_per_thread:g} weights"
          f"/thread/pass, {loop / weights_per_thread:.2f} per weight{serial}")  # fmt: skip
    for ln in layout:
        print("   ", ln.split("= ", 1)[-1])


GEMV_SIG = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16",
            "part_ptr": "*fp32", "y_ptr": "*bf16", "count_ptr": "*i32", "N": "i32", "C": "i32",
            "K": "i32"}  # fmt: skip


def gemv(qm, int4: bool, block_c: int, warps: int, split: bool, dump, slots: int = 0) -> None:  # type: ignore[no-untyped-def]
    p = 8 if int4 else 4
    sig = dict(GEMV_SIG, part_ptr="*fp32" if split else "*bf16")
    slots = slots or warps  # the tile's group rows (groups in flight); the kernel's WARPS
    const = dict(GROUP=32, INT4_KIND=int4, BLOCK_C=block_c, ROWS=8, WARPS=slots, SPLIT=split,
                 PDL=True, PREFETCH=0, BW=qm.BLOCK_WORDS)  # fmt: skip
    sig.update({k: "constexpr" for k in const})
    k = compile_sm90(qm._qgemv_kernel, sig, const, warps, div16=("N", "C", "K"))
    per_pass = slots * 32 * block_c * p  # a group (32 rows) per tile row
    name = (f"gemv_{'int4' if int4 else 'int8'}_c{block_c}_w{warps}_g{slots}"
            f"{'_split' if split else ''}")  # fmt: skip
    report(name, k, per_pass / (warps * 32), dump)


def gemm(qm, int4: bool, config, dump) -> None:  # type: ignore[no-untyped-def]
    block_c, block_k, warps, stages, *more = config
    joined = bool(more and more[0])  # the joined store (quant_matmul._gemm_store_joined)
    p = 8 if int4 else 4
    meta = "*bf16" if int4 else "*fp16"  # int4 of a bf16 model keeps bf16 scales
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": meta, "o_ptr": meta,
           "y_ptr": "*fp32", "M": "i32", "N": "i32", "C": "i32", "K": "i32",
           "stride_xm": "i32", "stride_ym": "i32"}  # fmt: skip
    const = dict(GROUP=32, INT4_KIND=int4, BLOCK_M=32, BLOCK_C=block_c, BLOCK_K=block_k,
                 PRECISION="tf32", EVEN_K=True, BF16_PAIRS=int4, ASM=True,
                 JOINED=joined, PREFETCH=0, BW=qm.BLOCK_WORDS,
                 DRAIN=warps % 4 == 0 and os.environ.get("TOKENPIPE_QUANT_GEMM_DRAIN") != "0",
                 )  # fmt: skip
    sig.update({k: "constexpr" for k in const})
    k = compile_sm90(qm._qgemm_kernel, sig, const, warps, num_stages=stages,
                     div16=("N", "C", "K", "stride_xm", "stride_ym"))  # fmt: skip
    per_pass = block_c * block_k * p  # weights of a K tile (for 32 rows of x)
    name = (f"gemm32_{'int4' if int4 else 'int8'}_c{block_c}_k{block_k}_w{warps}_s{stages}"
            f"{'_joined' if joined else ''}")  # fmt: skip
    report(name, k, per_pass / (warps * 32), dump)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--triton", default="", help="a Triton install to put first on sys.path")
    parser.add_argument("--dump", default="", help="write each kernel's SASS and TTGIR here")
    parser.add_argument("--only", default="", help="comma list: gemv, slots, gemm")
    parser.add_argument(
        "--gemm-list",
        default="",
        help='GEMM tiles instead of the start-up candidates: "c,k,w,s[,...];..."',
    )
    args = parser.parse_args()
    if args.triton:
        sys.path.insert(0, args.triton)
    sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import triton

    import worker.device.kernels.quant_matmul as qm

    print("triton", triton.__version__)
    only = set(args.only.split(",")) if args.only else {"gemv", "slots", "gemm"}
    dump = args.dump or None
    for int4 in (True, False):
        if "gemv" in only:
            for block_c, warps in ((32, 8), (128, 4), (64, 8)):
                for split in (False, True):
                    gemv(qm, int4, block_c, warps, split, dump)
        if "slots" in only:  # more group rows than warps: lanes of a warp on 4 groups
            for block_c, warps, slots in ((32, 8, 32), (32, 4, 16), (64, 4, 8), (64, 8, 16)):
                gemv(qm, int4, block_c, warps, True, dump, slots)
        if "gemm" in only:
            configs = qm.PER_POSITION_CANDIDATES + qm.JOINED_CANDIDATES
            if args.gemm_list:
                configs = [tuple(int(v) for v in c.split(",")) for c in args.gemm_list.split(";")]
            for config in configs:
                gemm(qm, int4, config, dump)


if __name__ == "__main__":
    main()
