"""`--quantize`'s fits on the GPU: the one-launch Triton kernels of
worker/device/kernels/quant_fit.py (the default on a GPU) against the torch passes they replace
(`TOKENPIPE_QUANT_FIT=torch`), side by side on Gemma 4 31B's
matrix shapes (random bf16 weights, N(0, 0.02)). Prints each fit's milliseconds, the bf16
bytes it quantizes a second, and the share of groups whose scale (and offset) came out equal.

    python tools/bench_quant_fit.py                 # int4 g32 and int8 g32
    python tools/bench_quant_fit.py --kinds int4 --repeat 5

Writes OUT/bench_quant_fit.json. The worker's own figure is its load time from a bf16 checkpoint:
`tools/bench_card_fit.py --checkpoint DIR --quantize int4`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# [N, K] of one 31B layer (sliding: q, k, v apart as a checkpoint holds them; full: q) and the
# tied embedding / LM head (int8 in an int4 model)
SHAPES = {
    "q_proj": (8192, 5376),
    "k_proj": (4096, 5376),
    "o_proj": (5376, 8192),
    "gate_proj": (21504, 5376),
    "down_proj": (5376, 21504),
    "full q_proj": (16384, 5376),
    "embed_tokens": (262144, 5376),
}


def timed(fn, repeat: int) -> tuple[float, object]:
    import torch

    result = fn()  # compiles the kernel (first use) or warms the allocator
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="int4,int8")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)

    import torch

    from worker.layers import quant as Q

    if not torch.cuda.is_available():
        print("bench_quant_fit: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}, group {args.group_size}, best of {args.repeat}")
    print("| kind | matrix | torch passes (ms) | one launch (ms) | speed-up | GB/s (one launch) "
          "| groups equal |\n| --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for kind in args.kinds.split(","):
        fmt = Q.QuantFormat(kind, args.group_size)
        for name, (n, k) in SHAPES.items():
            if kind == Q.INT4 and name == "embed_tokens":
                continue  # the table stays int8 in an int4 model
            w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16).normal_(
                0, 0.02, generator=gen
            )
            os.environ["TOKENPIPE_QUANT_FIT"] = "torch"
            fit = functools.partial(Q.quantize, w, fmt)
            slow, want = timed(fit, args.repeat)
            del os.environ["TOKENPIPE_QUANT_FIT"]  # the default: one launch
            fast, got = timed(fit, args.repeat)
            assert isinstance(want, Q.QuantizedWeight) and isinstance(got, Q.QuantizedWeight)
            equal = want.scales == got.scales
            if want.offsets is not None and got.offsets is not None:
                equal &= want.offsets == got.offsets
            row = {
                "kind": kind, "matrix": name, "shape": [n, k], "torch_ms": slow * 1e3,
                "kernel_ms": fast * 1e3, "gb_s": w.nbytes / fast / 1e9,
                "groups_equal": float(equal.float().mean()),
            }  # fmt: skip
            rows.append(row)
            share = row["groups_equal"]
            print(f"| {kind} | {name} [{n}, {k}] | {slow * 1e3:.1f} | {fast * 1e3:.2f} | "
                  f"{slow / fast:.0f}x | {row['gb_s']:.0f} | {share:.5%} |")  # fmt: skip
            del w, want, got, fit
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_quant_fit.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
