"""Load-time benchmark: the CPU load of the default model (or --model), cold and cached; with
--cuda, safetensors -> CUDA, our loader against safetensors' own, side by side.

    python tools/bench_load.py [--model PATH] [--dtype float32] [--repeat 3] [--check]
    python tools/bench_load.py --cuda [--model CKPT_DIR | --layers 20] [--repeat 2]

--cuda: each run is a fresh subprocess, the loaders alternating (ours, peer, ours, peer, ...):
`ours` is `load_model(dir, "cuda", bfloat16)` (the worker's load: pinned staging buffers,
reads overlapped with copies), `peer` is `safetensors.torch.load_file(shard, device="cuda")`
for every shard, all tensors kept. Without --model it first writes a synthetic checkpoint
(the Gemma 4 31B config of examples/gemma4_31b cut to --layers layers, random bf16 weights,
5 GB shards; 20 layers = 22.4 GB) under --workdir. Reported per run: seconds, GB/s, the
process's resident memory after torch and CUDA are up (base) and its peak during the load
(sampled every 2 ms, and ru_maxrss), as a table and as JSON (--out).

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
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    if "--cuda" in sys.argv[1:]:
        return cuda_main([a for a in sys.argv[1:] if a != "--cuda"])
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


# ------------------------------------------------------------------ safetensors -> CUDA

REPO = Path(__file__).resolve().parents[1]
SHARD_BYTES = 5 * 10**9

# One load in a fresh process: argv = loader, checkpoint dir. Prints one JSON line.
CUDA_RUN = """
import json, os, resource, sys, threading, time
import torch
loader, directory = sys.argv[1], sys.argv[2]
torch.empty(1, device="cuda")  # CUDA context up before the base figure
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
if loader == "ours":
    from worker.loading.loader import load_model
else:
    from safetensors.torch import load_file
base, peak, stop = rss(), [0], threading.Event()
base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
started = time.perf_counter()
extra = {}
if loader == "ours":
    loaded = load_model(directory, "cuda", torch.bfloat16, progress=False)
    extra["weights_s"] = loaded.meta["weights_seconds"]
    extra["phases"] = loaded.meta["load_phases"]
    extra["staged"] = loaded.meta.get("staging")  # where the load waited
else:
    from pathlib import Path
    kept = [load_file(str(f), device="cuda") for f in sorted(Path(directory).glob("*.safetensors"))]
torch.cuda.synchronize()
seconds = time.perf_counter() - started
stop.set()
peak[0] = max(peak[0], rss())
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"loader": loader, "seconds": seconds, "base_rss": base, "peak_rss": peak[0],
                  "ru_maxrss": maxrss, "base_ru_maxrss": base_maxrss, **extra}))
"""


def synthetic_checkpoint(where: Path, layers: int, overrides: dict[str, Any] | None = None) -> Path:
    """The Gemma 4 31B config cut to `layers` layers, random bf16 weights (drawn on the GPU
    when there is one), in ~5 GB safetensors shards with their index, and a small tokenizer."""
    import tokenizers
    import torch
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    sys.path.insert(0, str(REPO))
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    config = json.loads((REPO / "examples" / "gemma4_31b" / "config.json").read_text())
    config["num_hidden_layers"] = layers
    config["layer_types"] = config["layer_types"][:layers]
    config.update(overrides or {})
    where.mkdir(parents=True, exist_ok=True)
    if (where / "model.safetensors.index.json").exists():
        return where
    (where / "config.json").write_text(json.dumps(config))
    tokenizer = tokenizers.Tokenizer(
        WordLevel({f"<t{i}>": i for i in range(512)}, unk_token="<t3>")
    )
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(where / "tokenizer.json"))
    meta_model = build_model(ModelConfig.from_hf(config), "meta", torch.bfloat16)
    shapes = [(n, tuple(t.shape)) for n, t in meta_model.state_dict(keep_vars=True).items()]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)
    weight_map = {}
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in shard:
            nbytes = 2 * math.prod(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}  # fmt: skip
            offset += nbytes
            weight_map[name] = file_name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with (where / file_name).open("wb") as handle:
            handle.write(struct.pack("<Q", len(raw)) + raw)
            for _name, shape in shard:
                values = torch.empty(shape, dtype=torch.bfloat16, device=device)
                values.normal_(0.0, 0.02, generator=generator)
                handle.write(values.cpu().view(-1).view(torch.uint8).numpy().data)
        print(f"wrote {file_name}", file=sys.stderr, flush=True)
    index_json = {"metadata": {}, "weight_map": weight_map}
    (where / "model.safetensors.index.json").write_text(json.dumps(index_json))
    return where


def checkpoint_bytes(directory: Path) -> int:
    total = 0
    for path in directory.glob("*.safetensors"):
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
        total += path.stat().st_size - 8 - header_len
    return total


def cuda_run(loader: str, directory: Path, staging: str = "") -> dict[str, Any]:
    env = {**os.environ, "TOKENPIPE_LOAD_STAGING": staging, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", CUDA_RUN, loader, str(directory)], env=env,
                          check=True, capture_output=True, text=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def cuda_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="safetensors -> CUDA: ours vs safetensors")
    parser.add_argument("--model", default="", help="a checkpoint dir (default: synthetic)")
    parser.add_argument("--layers", type=int, default=20, help="layers of the synthetic one")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--repeat", type=int, default=2, help="runs of each loader")
    parser.add_argument("--out", default="", help="also write the JSON report here")
    parser.add_argument(
        "--staging",
        default="",
        help='extra runs of ours, e.g. "64,8,4;128,4,2" (MiB,buffers,readers)',
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.model:
        directory = Path(args.model)
    else:
        directory = synthetic_checkpoint(Path(args.workdir) / f"gemma4_31b_{args.layers}l",
                                         args.layers)  # fmt: skip
        print(f"synthetic checkpoint in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    nbytes = checkpoint_bytes(directory)
    runs = []
    plan = [(loader, "") for _ in range(max(1, args.repeat)) for loader in ("ours", "peer")]
    plan += [("ours", staging) for staging in args.staging.split(";") if staging]
    for loader, staging in plan:
        run = cuda_run(loader, directory, staging)
        run["gb_per_s"] = nbytes / run["seconds"] / 1e9
        run["staging"] = staging or "default"
        runs.append(run)
        print(json.dumps(run), file=sys.stderr, flush=True)
    lines = [
        f"checkpoint {directory} ({nbytes / 1e9:.1f} GB of tensors, page cache warm after the "
        "first read)",
        "seconds: the loader's call (imports and CUDA start before it); RSS sampled every 2 ms;",
        "ru_maxrss: the process's lifetime peak (CUDA start included; base = before the load)",
        "| loader | seconds | GB/s | weights only GB/s | base RSS GB | peak RSS GB | "
        "peak - base GB | ru_maxrss base -> end GB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        name = (f"ours (load_model), staging {run['staging']}" if run["loader"] == "ours"
                else 'safetensors load_file(device="cuda")')  # fmt: skip
        peak = run["peak_rss"]
        weights = f"{nbytes / run['weights_s'] / 1e9:.2f}" if run.get("weights_s") else "-"
        lines.append(
            f"| {name} | {run['seconds']:.2f} | {run['gb_per_s']:.2f} | {weights} | "
            f"{run['base_rss'] / 1e9:.2f} | {peak / 1e9:.2f} | "
            f"{(peak - run['base_rss']) / 1e9:.2f} | "
            f"{run['base_ru_maxrss'] / 1e9:.2f} -> {run['ru_maxrss'] / 1e9:.2f} |"
        )
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"bytes": nbytes, "runs": runs,
                                              "table": lines}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
