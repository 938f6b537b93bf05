"""Does a model fit a smaller card? The real worker, started as `tokenpipe run` starts one, held
to `--gpu-memory-gb` (what a 24 GB card would let it hold), fills each of `--sessions` named
sessions to `--context` tokens and decodes in each, then reports the `stats` event's device
memory figures and the rates (after an untimed `--warmup` request, so kernels compile there).
Then, with `--too-small GB`, a second worker under a limit the weights cannot fit shows the
start-up error users get.

    python tools/bench_card_fit.py --model examples/gemma4_31b --quantize int4 \
        --gpu-memory-gb 23.5 --sessions 2 --context 8192 --too-small 16
    python tools/bench_card_fit.py --tiny --device cpu --context 256   # a dry run, no limit

Random weights (the config's shape) and random prompt ids, as tools/bench_gpu.py uses; with
`--checkpoint DIR`, the same random weights written first as a bf16 safetensors checkpoint in
DIR (kept for the next run), which the worker then loads as a user's downloaded checkpoint:
with `--quantize int4` that is the quantize-at-load path, each weight streamed from the files
and quantized on the device; or, with `--model FILE.gguf`, that file's own tensors (a
`tools/gguf_stub.py` file: a real layout with zero weights, so the memory is a real file's; MoE
routing over zero weights always picks the same experts, so its decode rate is not one). Prints
a table and writes OUT/bench_card_fit_<sessions>x<context>_<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import REPO, WorkerProcess, log, make_model_dir, random_ids  # noqa: E402

GIB = 1 << 30


def fill_and_decode(worker: WorkerProcess, sid: str, prompt: list[int], new: int) -> dict:
    """Open `sid`, prefill `prompt`, decode `new` tokens: the prefill and decode rates."""
    worker.ask({"op": "open", "session_id": sid})
    request = {"session_id": sid, "prompt_segments": [{"ids": prompt}], "max_new_tokens": new}
    t0, lines = worker.generate([request], timeout=900)
    (got,) = lines.values()
    done = got[-1].msg
    tokens = [line for line in got if line.msg.get("event") == "token"]
    if len(tokens) > 1:
        first = tokens[0].t
        new_tokens = len(tokens)
        prefill = len(prompt) / (first - t0)
        decode = (len(tokens) - 1) / (got[-1].t - first)
    else:  # tokens without text (a stub's zero weights): the worker's own timing
        new_tokens = done.get("completion_tokens")
        prefill, decode = done.get("prefill_tok_s"), done.get("decode_tok_s")
    return {
        "session": sid,
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "prefill_tok_s": prefill,
        "decode_tok_s": decode,
    }


def warm_up(worker: WorkerProcess, tokens: int, vocab: int) -> float:
    """One request without a session (the spare slot) of `tokens` prompt ids and two new ones,
    before anything is timed: the prefill's kernels compile and autotune (Triton, fla) on it,
    not on the first measured prompt (session 32: the Qwen3.5 file's 16k prompt, the same flags,
    3,007 tok/s on a fresh machine, 5,112 on one that had run it). Its seconds."""
    request = {"prompt_segments": [{"ids": random_ids(tokens, vocab, 99)}], "max_new_tokens": 2}
    t0 = time.perf_counter()
    worker.generate([request], timeout=900)
    return time.perf_counter() - t0


SHARD_BYTES = 4 << 30


def write_checkpoint(model_dir: Path, where: Path, seed: int = 0) -> Path:
    """A bf16 safetensors checkpoint of `model_dir`'s config (its config.json and tokenizer.json
    copied), sharded as downloaded ones are, with `--random-weights`' recipe
    (`random_init.fill_entry`). Drawn on the GPU where there is one (seconds for 31B), one shard
    in host memory at a time. Kept: a DIR that already holds an
    index is used as it is."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from worker.loading.random_init import INIT_STD, fill_entry, norm_identities
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    index_path = where / "model.safetensors.index.json"
    if index_path.exists():
        log(f"checkpoint: {where} already written")
        return where
    where.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(model_dir / name, where / name)
    config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    model = build_model(config, "meta", torch.bfloat16)
    norm_weights = norm_identities(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(tensor: torch.Tensor) -> None:
        tensor.normal_(0.0, INIT_STD, generator=generator)

    entries = list(model.state_dict(keep_vars=True).items())
    total = sum(t.nbytes for _, t in entries)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    filled = 0  # bytes in the last shard
    for name, tensor in entries:  # meta tensors: their values are drawn as their shard is written
        if shards[-1] and filled + tensor.nbytes > SHARD_BYTES:
            shards.append([])
            filled = 0
        shards[-1].append((name, tensor))
        filled += tensor.nbytes
    weight_map: dict[str, str] = {}
    done = 0
    t0 = time.perf_counter()
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        values: dict[str, torch.Tensor] = {}
        for name, tensor in shard:
            value = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            fill_entry(name, tensor, value, norm_weights, draw)
            values[name] = value.cpu()
            weight_map[name] = file
        save_file(values, str(where / file), metadata={"format": "pt"})
        done += sum(v.nbytes for v in values.values())
        log(f"checkpoint: {file} written, {done / GIB:.1f} of {total / GIB:.1f} GiB "
            f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    index_path.write_text(json.dumps(index, indent=1))
    return where


def worker_args(model_dir: Path, args: argparse.Namespace, limit: float | None) -> list[str]:
    """The worker's flags: random weights of a config's shape, a written checkpoint's files, or a
    GGUF file's own tensors (e.g. one of `tools/gguf_stub.py`'s: a real file's layout, zero
    weights)."""
    files = (
        str(model_dir).endswith(".gguf") or (model_dir / "model.safetensors.index.json").exists()
    )
    weights = [] if files else ["--random-weights"]
    flags = [
        "--model", str(model_dir), *weights, "--device", args.device,
        "--max-sessions", str(args.sessions + 1), "--max-context", str(args.context),
    ]  # fmt: skip
    if args.quantize:
        flags += ["--quantize", args.quantize]
    if limit is not None:
        flags += ["--gpu-memory-gb", str(limit)]
    return flags + args.worker_arg


def too_small(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A worker under a limit the weights cannot fit: its one error line and exit code."""
    worker = WorkerProcess(worker_args(model_dir, args, args.too_small))
    try:
        line = worker.next_line(timeout=1800).msg
    finally:
        worker.close()
    log(f"under {args.too_small} GiB: {line}")
    return {"limit_gib": args.too_small, "line": line, "exit_code": worker.proc.returncode}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "gemma4_31b"))
    p.add_argument("--tiny", action="store_true", help="shrink the config (CPU dry run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quantize", default=None)
    p.add_argument("--gpu-memory-gb", type=float, default=None)
    p.add_argument("--sessions", type=int, default=1, help="named sessions filled to --context")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--new", type=int, default=64, help="tokens decoded in each session")
    p.add_argument("--tag", default="run", help="names the JSON file")
    p.add_argument("--too-small", type=float, default=None, help="GiB the weights cannot fit")
    p.add_argument("--checkpoint", default=None,
                   help="write the random weights as a bf16 safetensors checkpoint here (once) "
                   "and load the worker from it")  # fmt: skip
    p.add_argument("--worker-arg", action="append", default=[], help="another worker flag")
    p.add_argument("--warmup", type=int, default=4096,
                   help="prompt tokens of an untimed request first (0: none)")  # fmt: skip
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)

    config_path = Path(args.model)
    if config_path.suffix == ".gguf":  # its own tensors: the vocabulary from its header
        from worker.loading.gguf_quant import read_index

        model_dir = config_path
        vocab = len(read_index(config_path)[0]["tokenizer.ggml.tokens"])
    else:
        if config_path.is_dir():
            config_path = config_path / "config.json"
        model_dir = make_model_dir(config_path, args.tiny, Path(tempfile.mkdtemp()) / "model")
        if args.checkpoint:  # in a child process: its CUDA context is gone before the worker's
            import multiprocessing

            child = multiprocessing.get_context("spawn").Process(
                target=write_checkpoint, args=(model_dir, Path(args.checkpoint))
            )
            child.start()
            child.join()
            if child.exitcode != 0:
                raise SystemExit(f"writing the checkpoint failed (exit code {child.exitcode})")
            model_dir = Path(args.checkpoint)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    result: dict[str, Any] = {
        "model": args.model, "quantize": args.quantize, "gpu_memory_gb": args.gpu_memory_gb,
        "sessions": args.sessions, "context": args.context,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "worker_args": args.worker_arg,
        "tag": args.tag, "checkpoint": args.checkpoint,
    }  # fmt: skip
    worker = WorkerProcess(worker_args(model_dir, args, args.gpu_memory_gb))
    try:
        try:
            worker.wait_ready(timeout=1800)
        except RuntimeError as exc:  # it did not fit: the error line users get
            print(f"the worker did not start: {exc}")
            result["start_error"] = str(exc)
            write(result, args.out)
            return 1
        result["ready_s"] = worker.ready_s
        result["after_start"] = worker.ask({"op": "stats"})["stats"]
        if args.warmup:
            result["warmup_s"] = warm_up(worker, min(args.warmup, args.context - 3), vocab)
        prompt_len = args.context - args.new - 1  # the last decoded token ends at the context
        result["runs"] = []
        for i in range(args.sessions):
            try:
                prompt = random_ids(prompt_len, vocab, i)
                result["runs"].append(fill_and_decode(worker, f"s{i}", prompt, args.new))
            except RuntimeError as exc:  # a request that failed (out of memory, say)
                print(f"session s{i} failed: {exc}")
                result["run_error"] = str(exc)
                break
        result["after_runs"] = worker.ask({"op": "stats"})["stats"]
    finally:
        worker.close()
    if args.too_small is not None:
        result["too_small"] = too_small(model_dir, args)

    stats = result["after_runs"]
    print(f"\n{args.model}, --quantize {args.quantize}, --gpu-memory-gb {args.gpu_memory_gb}:")
    print("| session | prompt | prefill tok/s | decode tok/s |\n| --- | --- | --- | --- |")
    for run in result["runs"]:
        decode = f"{run['decode_tok_s']:.1f}" if run["decode_tok_s"] else "-"
        print(f"| {run['session']} | {run['prompt_tokens']} | {run['prefill_tok_s']:.0f} | "
              f"{decode} |")  # fmt: skip
    for key in ("allocated", "reserved", "peak_allocated", "peak_reserved", "used", "limit"):
        value = stats.get(f"device_memory_{key}")
        if value is not None:
            print(f"device_memory_{key}: {value / GIB:.2f} GiB")
    if "too_small" in result:
        print(f"under {args.too_small} GiB: {result['too_small']['line'].get('error')}")
    write(result, args.out)
    return 1 if "run_error" in result else 0


def write(result: dict[str, Any], out: str) -> None:
    name = f"bench_card_fit_{result['sessions']}x{result['context']}_{result['tag']}.json"
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
