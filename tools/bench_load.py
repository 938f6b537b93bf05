"""Load-time benchmark of the default model (or --model): cold and cached.

    python tools/bench_load.py [--model PATH] [--dtype float32] [--repeat 3] [--check]

cold:   a fresh, empty cache directory (TOKENPIPE_CACHE=<tmp>): GGUF read, dequantization,
        tokenizer rebuild, safetensors write, then the load.
cached: the same cache directory again (best of --repeat runs).

Each run is a fresh subprocess; `load_s` is the wall time of `load_model(...)` itself (after
`import torch`), `cpu_s` the CPU time the process spent in it, `process_s` the subprocess's whole
wall time including interpreter start and imports. Results are printed as JSON on stdout.
With --check the exit status is 1 when the cached load takes 5 s or more.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

RUN = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from worker.loading.loader import load_model
wall, cpu = time.perf_counter(), time.process_time()
loaded = load_model(sys.argv[1] or None, "cpu", getattr(torch, sys.argv[2]), progress=False)
result = {"load_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
          "parameters": loaded.meta["parameters"]}
print(json.dumps(result))
"""

CACHED_LIMIT_S = 5.0


def run_once(model: str, dtype: str, threads: int, cache: str) -> dict[str, float]:
    env = {**os.environ, "TOKENPIPE_CACHE": cache, "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", RUN, model, dtype, str(threads)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="HF dir or .gguf (default: the default model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="cached runs (best is reported)")
    parser.add_argument("--check", action="store_true", help="exit 1 if cached load >= 5 s")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tokenpipe-bench-") as cache:
        cold = run_once(args.model, args.dtype, args.threads, cache)
        print(f"cold: {cold}", file=sys.stderr)
        cached_runs = []
        for _ in range(max(1, args.repeat)):
            cached_runs.append(run_once(args.model, args.dtype, args.threads, cache))
            print(f"cached: {cached_runs[-1]}", file=sys.stderr)
    best = min(cached_runs, key=lambda r: r["load_s"])
    report = {
        "model": args.model or "default (Gemma 3 270M Q4_K_M GGUF)",
        "dtype": args.dtype,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "cold": cold,
        "cached_best": best,
        "cached_runs": cached_runs,
        "cached_under_limit": best["load_s"] < CACHED_LIMIT_S,
    }
    print(json.dumps(report, indent=2))
    return 1 if args.check and not report["cached_under_limit"] else 0


if __name__ == "__main__":
    sys.exit(main())
