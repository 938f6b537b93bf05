"""The Gluon candidate for the 32-row int4 decode GEMM (``worker/device/kernels/quant_gluon.py``,
off in the worker unless TOKENPIPE_QUANT_GLUON_GEMM=1) beside today's `_qgemm_kernel` on the
Gemma 4 31B matrices.

Why and how: the kernel module's docstring.

    python tools/proto_gluon_gemm.py --offline [--triton /tmp/t36] [--dump DIR]   # no GPU
    python tools/proto_gluon_gemm.py [--only gate_up_proj] [--rows 32]           # on an H200

Offline it prints registers and the loop's SASS instructions for sm_90a. On a GPU it checks
the output against ``qgemm`` (the same bf16 weights; only the order of the sums differs) and
times both, weights rotated past L2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parent))
sys.path.insert(0, str(TOOLS))


def _early_triton() -> None:
    """--triton DIR: that Triton install first on the path (before anything imports one)."""
    if "--triton" in sys.argv:
        sys.path.insert(0, sys.argv[sys.argv.index("--triton") + 1])


_early_triton()

from worker.device.kernels.quant_gluon import (  # noqa: E402
    MAXNREG,
    PROGRAMS,
    _stacked_gemm_kernel,
    stacked_gemm,
)


def offline(dump: str | None) -> None:
    """Compile for sm_90a without a GPU and print registers and the loop's instructions."""
    import sass_quant_kernels as sq
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for block_w, bw, maxnreg in ((32, 32, None), (32, 32, MAXNREG), (32, 0, MAXNREG),
                                 (16, 32, None), (16, 32, 104), (16, 32, MAXNREG)):  # fmt: skip
        sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "o_ptr": "*bf16",
               "y_ptr": "*bf16", "M": "i32", "N": "i32", "C": "i32", "K": "i32",
               "stride_xm": "i32"}  # fmt: skip
        const = {"BLOCK_W": block_w, "BLOCK_K": 32, "BLOCK_M": 32, "BW": bw}
        sig.update({key: "constexpr" for key in const})
        attrs = {(i,): [["tt.divisibility", 16]] for i, (arg, ty) in enumerate(sig.items())
                 if ty.startswith("*") or arg in ("N", "C", "K", "stride_xm")}  # fmt: skip
        source = GluonASTSource(fn=_stacked_gemm_kernel, signature=sig, constexprs=const,
                                attrs=attrs)  # fmt: skip
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "maxnreg": maxnreg})  # fmt: skip
        name = f"gluon_stacked_w{block_w}_bw{bw}_maxnreg{maxnreg}"
        sq.report(name, kernel, 64 * 32 * (8 * block_w // 64) / 128, dump)  # a pass's weights
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
        with open(f"/tmp/{name}.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"/tmp/{name}.ptx", "-o", "/dev/null"],
                              capture_output=True, text=True).stderr  # fmt: skip
        print("   ", " ".join(ln.split("info    :")[-1].strip() for ln in info.splitlines()
                              if "spill" in ln or "Used" in ln))  # fmt: skip


def on_gpu(
    only: set[str] | None, rows: int, model: Path, variants: list[tuple[int, int, int]]
) -> None:
    import torch
    import torch.nn.functional as F
    from bench_quant_kernels import model_shapes, rotated

    from worker.device.kernels import quant_matmul as qm
    from worker.layers import quant as Q

    dev = torch.device("cuda")
    today = (64, 32, 4, 4, 1, 264)  # the start-up's pick for the 31B matrices (session 20)
    print(f"# {torch.cuda.get_device_name()}, {rows} rows; us a call, weights past L2; "
          "Gluon variants (programs, maxnreg, block_w)")  # fmt: skip
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
        for programs, maxnreg, block_w in variants:
            got = stacked_gemm(x, packed, programs=programs, maxnreg=maxnreg,
                               block_w=block_w).float()  # fmt: skip
            err = (got - want).abs().max().item() / scale
            err_ref = (got - ref).abs().max().item() / scale

            def ours(w: object, x: object = x, p: int = programs, r: int = maxnreg,
                     b: int = block_w) -> object:  # fmt: skip
                return stacked_gemm(x, w, programs=p, maxnreg=r, block_w=b)

            t_ours = rotated(ours, copies) * 1e6
            print(f"| {name} [{n}, {k}] | {t_today:.1f} | {programs}, {maxnreg}, {block_w} | "
                  f"{t_ours:.1f} | "
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
        default=f"{PROGRAMS},{MAXNREG},32;396,{MAXNREG},32;{PROGRAMS},0,32;660,104,16;528,128,16",
        help="Gluon variants to time: programs,maxnreg,block_w;... (maxnreg 0: no cap; block_w "
        "32: two positions a tile, 16: four)",
    )
    p.add_argument("--model", default=str(TOOLS.parent / "examples" / "gemma4_31b" / "config.json"))
    args = p.parse_args()
    if args.offline:
        offline(args.dump)
        return
    only = set(args.only.split(",")) if args.only else None
    variants = [tuple(int(v) for v in t.split(",")) for t in args.variants.split(";")]
    on_gpu(only, args.rows, Path(args.model), variants)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
