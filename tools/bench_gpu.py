"""GPU benchmark: the real worker process over its pipes, against the hardware's limits and
HF transformers on the same config, in one run.

    python tools/bench_gpu.py --model examples/gemma4_31b --device cuda --out OUTDIR
    python tools/bench_gpu.py --tiny --device cpu --out /tmp/bench     # the CPU dry run

Measures: device copy bandwidth and bf16 matmul rate (the ceilings); batch-1 decode tok/s;
aggregate decode tok/s at 8, 32 and 64 sessions; prefill tok/s at 2,048 and 8,192 tokens;
time to first token for 64 new tokens on a resident 4,096-token session, warm vs cold; the
bytes a session costs and whether 32 sessions x 8,192 tokens fit next to the weights; then
transformers (random weights, same config) at the same batch sizes. Prints a table and
writes OUTDIR/bench_gpu.md and OUTDIR/bench_gpu.json.

Limits: decode (batch b) = min(b * copy_bw / weight_bytes, matmul_rate / (2 * params));
prefill = matmul_rate / (2 * params) (attention FLOPs not counted).

The worker is started exactly as `tokenpipe run` starts one (`supervisor.pool`'s
`default_worker_command()`, i.e. `tokenpipe worker`), nothing patched: the figures are the
ones users get, start-up time included (the `ready` wait is logged).
Prompts are random token ids (`prompt_segments`, `add_prefix: false`); the tokenizer is a
synthetic word-level one as large as the config's vocabulary.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TINY_OVERRIDES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "sliding_window": 64,
    "vocab_size": 512,
    "vocab_size_per_layer_input": 512,
}


def log(message: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ model dir + tokenizer


def make_model_dir(config_path: Path, tiny: bool, where: Path) -> Path:
    """A directory with config.json (shrunk with --tiny) and a synthetic tokenizer.json."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    config = json.loads(config_path.read_text())
    if tiny:
        config.update(TINY_OVERRIDES)
    # no EOS: random weights must not end a timed generation early
    config["eos_token_id"] = []
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"<t{i}>": i for i in range(int(config["vocab_size"]))}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<t3>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(where / "tokenizer.json"))
    return where


# ------------------------------------------------------------------ the pipe client


@dataclass
class Line:
    t: float
    msg: dict[str, Any]


class WorkerProcess:
    """The worker over its pipes; a reader thread timestamps every line it prints."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        from supervisor.pool import default_worker_command

        cmd = [*default_worker_command(), *args]
        log("starting: " + " ".join(cmd))
        self.spawned = time.perf_counter()
        self.ready_s: float | None = None
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the worker's log goes to our stderr
            cwd=str(REPO),
            env={
                **os.environ,
                **(env or {}),
                "PYTHONPATH": os.pathsep.join(
                    [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
                ),
            },
        )
        self.lines: queue.Queue[Line | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next_id = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            now = time.perf_counter()
            try:
                self.lines.put(Line(now, json.loads(raw)))
            except json.JSONDecodeError:
                log(f"non-JSON line from the worker: {raw[:200]!r}")
        self.lines.put(None)

    def send(self, msg: dict[str, Any]) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()
        return time.perf_counter()

    def next_line(self, timeout: float) -> Line:
        line = self.lines.get(timeout=timeout)
        if line is None:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return line

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        line = self.next_line(timeout)
        if line.msg.get("event") != "ready" and not line.msg.get("ready"):
            raise RuntimeError(f"expected ready, got {line.msg}")
        self.ready_s = line.t - self.spawned
        log(f"worker ready {self.ready_s:.1f}s after spawn")
        return line.msg

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def ask(self, msg: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        rid = self.new_id()
        self.send({**msg, "id": rid})
        while True:
            line = self.next_line(timeout)
            if line.msg.get("id") == rid:
                return line.msg

    def generate(
        self, requests: list[dict[str, Any]], timeout: float
    ) -> tuple[float, dict[int, list[Line]]]:
        """Send all requests at once; collect each one's lines until its done/error."""
        ids = []
        t0 = time.perf_counter()
        for req in requests:
            rid = self.new_id()
            ids.append(rid)
            self.send({"add_prefix": False, "temperature": 0.0, **req, "id": rid})
        lines: dict[int, list[Line]] = {rid: [] for rid in ids}
        open_ids = set(ids)
        deadline = time.perf_counter() + timeout
        while open_ids:
            line = self.next_line(max(1.0, deadline - time.perf_counter()))
            rid = line.msg.get("id")
            if rid in lines:
                lines[rid].append(line)
                if line.msg.get("event") in ("done", "error"):
                    open_ids.discard(rid)
                    if line.msg.get("event") == "error":
                        raise RuntimeError(f"request {rid} failed: {line.msg}")
        return t0, lines

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------ measurements


@dataclass
class Results:
    meta: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, what: str, ours: float | None, limit: float | None, hf: float | None,
            unit: str, note: str = "") -> None:  # fmt: skip
        self.rows.append(
            {"what": what, "ours": ours, "limit": limit, "hf": hf, "unit": unit, "note": note}
        )


def measure_ceilings(device: str) -> dict[str, float]:
    import torch

    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    n_bytes = (4 << 30) if on_gpu else (64 << 20)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    size = 8192 if on_gpu else 512
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)

    def timed(fn: Any, reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            if on_gpu:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    copy_s = timed(lambda: dst.copy_(src), 10)
    mm_s = timed(lambda: torch.mm(a, b), 10)
    out = {"copy_bytes_per_s": 2 * n_bytes / copy_s, "bf16_flop_per_s": 2 * size**3 / mm_s}
    if on_gpu:
        torch.cuda.empty_cache()
    return out


def kernel_bench(device: str) -> list[str]:
    """Decode attention alone on the 31B layer shapes: achieved KV read bandwidth."""
    import torch

    from worker.device.kernels.attention import decode_attention

    if not device.startswith("cuda"):
        return []
    notes = []
    shapes = [  # name, Hq, Hkv, D, capacity, window
        ("full layer", 32, 4, 512, 8192, 0),
        ("sliding layer", 32, 16, 256, 1040, 1024),
    ]
    for name, hq, hkv, dim, cap, window in shapes:
        for batch in (1, 32):
            k = torch.randn(batch, hkv, cap, dim, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(batch, hq, dim, device=device, dtype=torch.bfloat16)
            slots = torch.arange(batch, device=device)
            lens = torch.full((batch,), 8192, device=device)
            args = (q, k, v, slots, lens)
            decode_attention(*args, sm_scale=1.0, window=window)  # compile
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode_attention(*args, sm_scale=1.0, window=window)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1000 / 20
            read = 2 * batch * hkv * min(cap, 8192) * dim * 2
            notes.append(
                f"decode attention, {name}, batch {batch}, 8192 tokens: {seconds * 1e6:.0f} us, "
                f"KV read {read / seconds / 1e12:.2f} TB/s"
            )
            log(notes[-1])
            del k, v, graph, args
    torch.cuda.empty_cache()
    return notes


def prefix_ttft(worker: WorkerProcess, prompt: int, shared: int, vocab: int, timeout: float,
                repeat: int = 3) -> dict[str, float]:  # fmt: skip
    """Time to first token of a new session whose `prompt`-token prompt starts with `shared`
    tokens another session prefilled (the shared-prefix cache), against the same length
    cold; the median of `repeat` runs each, every run on fresh ids."""
    out: dict[str, float] = {}
    for name in ("shared", "cold"):
        runs: list[tuple[float, float]] = []
        for i in range(repeat):
            head = random_ids(shared, vocab, 2000 + i)
            if name == "shared":  # another request (the scratch session) prefills it first
                worker.generate([{"max_new_tokens": 0, "prompt_segments":
                                  [{"ids": head + random_ids(prompt - shared, vocab, 3000 + i)}]}],
                                timeout)  # fmt: skip
            else:
                head = random_ids(shared, vocab, 4000 + i)
            sid = f"prefix-{name}-{i}"
            worker.ask({"op": "open", "session_id": sid})
            ids = head + random_ids(prompt - shared, vocab, 5000 + i)
            req = {"session_id": sid, "prompt_segments": [{"ids": ids}], "max_new_tokens": 1}
            t0, lines = worker.generate([req], timeout)
            req_lines = next(iter(lines.values()))
            first = next((ln.t for ln in req_lines if ln.msg.get("event") == "token"), None)
            reused = float(req_lines[-1].msg.get("reused_prompt_tokens", -1))
            runs.append(((first or req_lines[-1].t) - t0, reused))
            worker.ask({"op": "close", "session_id": sid})
        runs.sort()
        out[f"{name}_s"], out[f"{name}_reused"] = runs[len(runs) // 2]
        out[f"{name}_runs_s"] = [round(r[0], 4) for r in runs]  # type: ignore[assignment]
    return out


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]  # clear of the low special ids


# --sampling cases: the request fields of each (greedy is the default request)
SAMPLING_CASES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "t0.8p0.95": {"temperature": 0.8, "top_p": 0.95},
    "t0.8k40": {"temperature": 0.8, "top_k": 40},
    "t0.8m0.05": {"temperature": 0.8, "min_p": 0.05},
    "t1": {"temperature": 1.0},
}


def decode_rate(worker: WorkerProcess, sessions: int, prompt: int, new: int, vocab: int,
                timeout: float, sampling: dict[str, Any] | None = None,
                ) -> dict[str, float]:  # fmt: skip
    """Aggregate decode tok/s while all `sessions` requests decode at once: tokens streamed
    between the moment the last one got its first token and the moment the first one ended,
    over that window."""
    # the engine starts one prompt per step, so the last starts ~`sessions` steps after the
    # first: generate long enough that all overlap for a while
    new = max(new, 2 * sessions + 32)
    reqs = [
        {
            "prompt_segments": [{"ids": random_ids(prompt, vocab, 100 + i)}],
            "max_new_tokens": new,
            **(sampling or {}),
        }
        for i in range(sessions)
    ]
    _, lines = worker.generate(reqs, timeout)
    firsts, ends, stamps = [], [], []
    per_req, counts = [], []
    for req_lines in lines.values():
        toks = [ln.t for ln in req_lines if ln.msg.get("event") == "token"]
        done = req_lines[-1]
        ends.append(done.t)
        firsts.append(toks[0] if toks else done.t)
        stamps.extend(toks)
        per_req.append(float(done.msg.get("decode_tok_s") or 0.0))
        counts.append(int(done.msg.get("completion_tokens", 0)))
    start, end = max(firsts), min(ends)
    in_window = sum(1 for t in stamps if start < t <= end)
    aggregate = in_window / (end - start) if end > start and in_window else 0.0
    return {
        "aggregate_tok_s": aggregate,
        "mean_request_decode_tok_s": sum(per_req) / len(per_req),
        "window_s": end - start,
        "min_completion_tokens": min(counts),
    }


def prefill_rate(worker: WorkerProcess, n: int, vocab: int, timeout: float) -> dict[str, float]:
    """One request of n new tokens, after an untimed one of the same length (one-time costs
    such as a kernel autotuner's first run at that shape stay out of the figure)."""
    warm = {"prompt_segments": [{"ids": random_ids(n, vocab, n + 1)}], "max_new_tokens": 0}
    worker.generate([warm], timeout)
    req = {"prompt_segments": [{"ids": random_ids(n, vocab, n)}], "max_new_tokens": 0}
    t0, lines = worker.generate([req], timeout)
    done = next(iter(lines.values()))[-1]
    wall = done.t - t0
    return {"wall_tok_s": n / wall, "engine_prefill_tok_s": float(done.msg["prefill_tok_s"])}


def ttft(worker: WorkerProcess, resident: int, extra: int, vocab: int, timeout: float,
         repeat: int = 3) -> dict[str, float]:  # fmt: skip
    """Time to the first new token for `extra` new prompt tokens on a resident session
    (warm), for the last `extra` tokens of a resident session replaced by `extra` new ones
    (rollback: an agent regenerating its last turn; a hybrid model restores a state snapshot),
    and for a prompt of the same length on a fresh session (cold: ids no session or prefix
    block has seen, so the shared-prefix cache cannot serve any of it), the median of `repeat`
    runs each; max_new_tokens 1, so the `done` line ends the first token."""
    out: dict[str, float] = {}
    for name in ("warm", "rollback", "cold"):
        runs: list[dict[str, float]] = []
        for i in range(repeat):
            seed = 1000 + i if name == "cold" else 7
            base = random_ids(resident, vocab, seed)
            more = random_ids(extra, vocab, seed + 1)
            sid = f"ttft-{name}-{i}"
            worker.ask({"op": "open", "session_id": sid})
            if name == "warm":
                worker.generate([{"session_id": sid, "prompt_segments": [{"ids": base}],
                                  "max_new_tokens": 0}], timeout)  # fmt: skip
                # a first warm turn of the same shape, so one-time costs stay out of it
                worker.generate([{"session_id": sid, "max_new_tokens": 0, "prompt_segments":
                                  [{"ids": base + random_ids(extra, vocab, 9)}]}],
                                timeout)  # fmt: skip
                worker.generate([{"session_id": sid, "prompt_segments": [{"ids": base}],
                                  "max_new_tokens": 0}], timeout)  # fmt: skip
            if name == "rollback":  # turns base, base + 64, then an untimed rollback like it
                worker.generate([{"session_id": sid, "prompt_segments": [{"ids": base}],
                                  "max_new_tokens": 0}], timeout)  # fmt: skip
                for other in (9, 10):
                    worker.generate([{"session_id": sid, "max_new_tokens": 0, "prompt_segments":
                                      [{"ids": base + random_ids(extra, vocab, other)}]}],
                                    timeout)  # fmt: skip
            req = {"session_id": sid, "prompt_segments": [{"ids": base + more}],
                   "max_new_tokens": 1}  # fmt: skip
            t0, lines = worker.generate([req], timeout)
            req_lines = next(iter(lines.values()))
            first = next((ln.t for ln in req_lines if ln.msg.get("event") == "token"), None)
            run = {
                "s": (first or req_lines[-1].t) - t0,
                "prefilled": float(req_lines[-1].msg.get("prefilled_prompt_tokens", -1)),
            }
            for key in ("prefill_ms", "total_ms"):  # the worker's own accounting
                run[key] = float(req_lines[-1].msg.get(key, -1))
            runs.append(run)
            worker.ask({"op": "close", "session_id": sid})
        runs.sort(key=lambda r: r["s"])
        for key, value in runs[len(runs) // 2].items():
            out[f"{name}_{key}"] = value
        out[f"{name}_runs_s"] = [round(r["s"], 4) for r in runs]  # type: ignore[assignment]
    return out


# ------------------------------------------------------------------ transformers


def hf_bench(config: dict[str, Any], device: str, batches: list[int], prefills: list[int],
             new: int) -> dict[str, float]:  # fmt: skip
    """transformers' Gemma4ForCausalLM with random bf16 weights: decode tok/s per batch
    (generate with `new` tokens minus generate with 1, greedy, EOS off) and prefill tok/s."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    vocab = int(config["vocab_size"])
    results: dict[str, float] = {}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def gen(batch: int, n: int) -> float:
        ids = torch.randint(10, vocab, (batch, 32), device=dev)
        sync()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
        sync()
        return time.perf_counter() - t

    with torch.inference_mode():
        gen(1, 2)  # warm-up
        for batch in batches:
            try:
                one, full = gen(batch, 1), gen(batch, new)
                rate = batch * (new - 1) / (full - one) if full > one else float("nan")
                results[f"decode_b{batch}"] = rate
            except torch.OutOfMemoryError:
                results[f"decode_b{batch}"] = float("nan")
            log(f"transformers decode batch {batch}: {results[f'decode_b{batch}']:.1f} tok/s")
        for n in prefills:
            ids = torch.randint(10, vocab, (1, n), device=dev)
            try:
                model(ids, logits_to_keep=1)  # warm-up at the full size (kernel choice)
                sync()
                t = time.perf_counter()
                model(ids, logits_to_keep=1)
                sync()
                results[f"prefill_{n}"] = n / (time.perf_counter() - t)
            except torch.OutOfMemoryError:
                results[f"prefill_{n}"] = float("nan")
            log(f"transformers prefill {n}: {results[f'prefill_{n}']:.0f} tok/s")
    return results


# ------------------------------------------------------------------ the run


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:,.{digits}f}"


def render(res: Results) -> str:
    m = res.meta
    lines = [
        f"## GPU benchmark, {m['date']}, {m['gpu']}",
        "",
        f"Model: `{m['model']}` ({m['parameters'] / 1e9:.3f}B parameters, "
        f"{m['weight_bytes'] / 1e9:.1f} GB of weights, {m['dtype']}, random weights). "
        f"Measured ceilings: copy {m['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), "
        f"bf16 matmul {m['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s. torch {m['torch']}, "
        f"transformers {m.get('transformers', '-')}.",
        "",
        f"Command: `{m['command']}`",
        "",
        "| measure | tokenpipe | limit | % of limit | transformers | x transformers | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res.rows:
        ours, limit, hf = r["ours"], r["limit"], r["hf"]
        pct = f"{100 * ours / limit:.0f}%" if ours and limit else "-"
        speedup = f"{ours / hf:.1f}x" if ours and hf and hf == hf else "-"
        lines.append(
            f"| {r['what']} ({r['unit']}) | {fmt(ours)} | {fmt(limit)} | {pct} | {fmt(hf)} | "
            f"{speedup} | {r['note']} |"
        )
    for note in m.get("notes", []):
        lines.append(f"\n- {note}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "gemma4_31b"))
    p.add_argument("--tiny", action="store_true", help="shrink the config (CPU dry run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--sessions", default="1,8,32,64")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-prompt", type=int, default=32,
                   help="prompt tokens of each decoding session (the context decode starts at)",
                   )  # fmt: skip
    p.add_argument("--sampling", default="greedy",
                   help=f"decode cases, of {','.join(SAMPLING_CASES)}")  # fmt: skip
    p.add_argument("--no-ttft", action="store_true", help="skip the TTFT measurement")
    p.add_argument("--prefill", default="2048,8192")
    p.add_argument("--resident", type=int, default=4096)
    p.add_argument("--extra", type=int, default=64)
    p.add_argument("--ttft-repeat", type=int, default=3, help="runs per TTFT figure (median)")
    p.add_argument("--context", type=int, default=8192, help="--max-context of the main worker")
    p.add_argument("--big-batch-context", type=int, default=1024,
                   help="--max-context of the worker for batches above 32")  # fmt: skip
    p.add_argument("--hf-new-tokens", type=int, default=8)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--compile-phase-budget",
        type=float,
        default=0.0,
        help="seconds the whole run may take; the torch.compile phase uses what is left",
    )
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--prefix-prompt", type=int, default=8192,
                   help="shared-prefix TTFT: prompt length (0 = skip)")  # fmt: skip
    p.add_argument("--prefix-shared", type=int, default=7936,
                   help="shared-prefix TTFT: tokens shared with another session")  # fmt: skip
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4", "int4-experts"],
                   help="our workers' weights (transformers stays bf16)")  # fmt: skip
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag for the main worker, as `tokenpipe run` takes it (repeat)",
    )
    args = p.parse_args(argv)
    started = time.perf_counter()

    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = Path(args.model)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    model_dir = make_model_dir(config_path, args.tiny, tmp / "model")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    on_gpu = args.device.startswith("cuda")
    dtype = "bfloat16" if on_gpu else "float32"
    res = Results()
    gpu = torch.cuda.get_device_name(args.device) if on_gpu else "CPU"
    res.meta.update(
        date=datetime.date.today().isoformat(), gpu=gpu, model=args.model, dtype=dtype,
        torch=torch.__version__, command="python tools/bench_gpu.py " + " ".join(argv),
        notes=[],
    )  # fmt: skip
    try:
        import transformers

        res.meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    log("measuring the ceilings")
    res.meta.update(measure_ceilings(args.device))
    try:
        res.meta["notes"].extend(kernel_bench(args.device))
    except Exception as exc:  # noqa: BLE001 - keep going: the worker figures matter more
        res.meta["notes"].append(f"kernel bench failed: {exc!r}")
    sessions = [int(s) for s in args.sessions.split(",") if s]
    cases = [c for c in args.sampling.split(",") if c]
    unknown = [c for c in cases if c not in SAMPLING_CASES]
    if unknown:
        p.error(f"unknown --sampling case(s) {unknown}; known: {list(SAMPLING_CASES)}")
    prefills = [int(s) for s in args.prefill.split(",") if s]
    common = ["--model", str(model_dir), "--tokenizer_path", str(model_dir / "tokenizer.json"),
              "--random-weights", "--device", args.device, "--dtype", dtype,
              "--quantize", args.quantize]  # fmt: skip
    if args.group_size:
        common += ["--group-size", str(args.group_size)]
    res.meta["quantize"] = args.quantize
    results: dict[str, Any] = {}
    small = [s for s in sessions if s <= 32]
    big = [s for s in sessions if s > 32]

    # worker 1: 33 slots x the full context (the 32 x 8192 case), everything but big batches
    w = WorkerProcess(common + ["--max-sessions", str(max(small + [1]) + 1),
                                "--max-context", str(args.context), *args.worker_arg])  # fmt: skip
    try:
        ready = w.wait_ready(args.timeout * 3)
        info = w.ask({"op": "info"})["info"]
        results["info"] = info
        res.meta["ready_s_after_spawn"] = round(w.ready_s or 0.0, 1)
        res.meta["bytes_per_session"] = info.get("bytes_per_session")
        if on_gpu:
            free, total = torch.cuda.mem_get_info(args.device)
            res.meta["gpu_free_after_worker"] = free
            res.meta["gpu_total"] = total
        log(f"worker ready: {ready}")
        for n in prefills:
            results[f"prefill_{n}"] = prefill_rate(w, n, vocab, args.timeout)
            log(f"prefill {n}: {results[f'prefill_{n}']}")
        for s in small:
            for case in cases:
                key = f"decode_{s}" + ("" if case == "greedy" else f"_{case}")
                results[key] = decode_rate(w, s, args.decode_prompt, args.decode_tokens, vocab,
                                           args.timeout, SAMPLING_CASES[case])  # fmt: skip
                ahead = w.ask({"op": "stats"}).get("stats", {}).get("decode_ahead")
                log(f"decode x{s} {case}: {results[key]}; decode ahead so far: {ahead}")
        if not args.no_ttft:
            results["ttft"] = ttft(
                w, args.resident, args.extra, vocab, args.timeout, args.ttft_repeat
            )
            log(f"ttft: {results['ttft']}")
            if args.prefix_prompt:
                prompt = min(args.prefix_prompt, args.context - 1)
                results["prefix_ttft"] = prefix_ttft(
                    w, prompt, args.prefix_shared, vocab, args.timeout, args.ttft_repeat
                )
                log(f"prefix ttft: {results['prefix_ttft']}")
    finally:
        w.close()
    if big:
        w = WorkerProcess(common + ["--max-sessions", str(max(big) + 1),
                                    "--max-context", str(args.big_batch_context)])  # fmt: skip
        try:
            w.wait_ready(args.timeout * 3)
            for s in big:
                results[f"decode_{s}"] = decode_rate(w, s, args.decode_prompt, args.decode_tokens,
                                                     vocab, args.timeout)  # fmt: skip
                log(f"decode x{s}: {results[f'decode_{s}']}")
        finally:
            w.close()

    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    meta_model = build_model(ModelConfig.from_hf(config), "meta", torch.bfloat16)
    params = sum(p.numel() for p in meta_model.parameters())
    weight_bytes = params * (2 if dtype == "bfloat16" else 4)
    if args.quantize != "none":  # the bytes a decode step reads, as `tokenpipe info` counts
        from worker.loading.quantize import QuantizeOptions, describe_weights, plan_for_model

        options = QuantizeOptions(args.quantize, args.group_size)
        plan = plan_for_model(meta_model, options)
        weight_bytes = describe_weights(meta_model, plan, torch.bfloat16)["decode_bytes_per_step"]
    res.meta.update(parameters=params, weight_bytes=weight_bytes)
    hf: dict[str, float] = {}
    if not args.skip_hf:
        log("transformers")
        try:
            hf = hf_bench(config, args.device, sessions, prefills, args.hf_new_tokens)
        except Exception as exc:  # noqa: BLE001 - a failed comparison must not lose our figures
            res.meta["notes"].append(f"transformers run failed: {exc!r}")
    results["hf"] = hf

    bw, flops = res.meta["copy_bytes_per_s"], res.meta["bf16_flop_per_s"]
    compute_limit = flops / (2 * params)
    for s in sessions:
        greedy = results.get(f"decode_{s}", {}).get("aggregate_tok_s")
        for case in cases if s <= 32 else ["greedy"]:
            r = results.get(f"decode_{s}" + ("" if case == "greedy" else f"_{case}"), {})
            ours = r.get("aggregate_tok_s")
            vs = ""
            if ours and greedy and case != "greedy":
                vs = f"; {100 * ours / greedy:.1f}% of greedy"
            label = "" if case == "greedy" else f", {case} {SAMPLING_CASES[case]}"
            if args.decode_prompt != 32:
                label += f", {args.decode_prompt}-token prompts"
            res.add(f"decode, {s} session{'s' if s > 1 else ''}{label}", ours,
                    min(s * bw / weight_bytes, compute_limit), hf.get(f"decode_b{s}"), "tok/s",
                    f"per request {fmt(r.get('mean_request_decode_tok_s'))}{vs}")  # fmt: skip
    for n in prefills:
        r = results.get(f"prefill_{n}", {})
        res.add(f"prefill {n} tokens", r.get("wall_tok_s"), compute_limit,
                hf.get(f"prefill_{n}"), "tok/s",
                f"engine's own figure {fmt(r.get('engine_prefill_tok_s'))}")  # fmt: skip
    t = results.get("ttft", {})
    if t:
        ratio = t["warm_s"] / t["cold_s"] if t.get("cold_s") else None
        res.add(
            f"TTFT warm, {args.resident}+{args.extra}",
            t["warm_s"] * 1000,
            None,
            None,
            "ms",
            f"prefilled {t['warm_prefilled']:.0f} tokens; warm/cold = {fmt(ratio, 3)}; "
            f"median of {len(t['warm_runs_s'])}: {t['warm_runs_s']} s",
        )
        if t.get("rollback_s"):
            res.add(f"TTFT rollback of {args.extra} + {args.extra} new, {args.resident}",
                    t["rollback_s"] * 1000, None, None, "ms",
                    f"prefilled {t['rollback_prefilled']:.0f} tokens; rollback/cold = "
                    f"{fmt(t['rollback_s'] / t['cold_s'] if t.get('cold_s') else None, 3)}; "
                    f"median of {len(t['rollback_runs_s'])}: {t['rollback_runs_s']} s")  # fmt: skip
        res.add(f"TTFT cold, {args.resident}+{args.extra}", t["cold_s"] * 1000, None, None, "ms",
                f"prefilled {t['cold_prefilled']:.0f} tokens")  # fmt: skip
    pt = results.get("prefix_ttft", {})
    if pt:
        ratio = pt["shared_s"] / pt["cold_s"] if pt.get("cold_s") else None
        res.add(f"TTFT new session, {args.prefix_prompt} tokens sharing {args.prefix_shared}",
                pt["shared_s"] * 1000, None, None, "ms",
                f"reused {pt['shared_reused']:.0f}; shared/cold = {fmt(ratio, 3)}; cold "
                f"{pt['cold_s'] * 1000:.1f} ms (reused {pt['cold_reused']:.0f})")  # fmt: skip
    per_session = res.meta.get("bytes_per_session")
    if per_session:
        need = weight_bytes + 32 * per_session * 8192 / args.context
        total = res.meta.get("gpu_total")
        res.meta["notes"].append(
            f"one session of {args.context} tokens costs {per_session / 1e9:.2f} GB of KV "
            f"(info.bytes_per_session); weights + 32 sessions x 8192 = {need / 1e9:.1f} GB"
            + (f" of {total / 1e9:.1f} GB on the GPU" if total else "")
        )
    (out / "bench_gpu.md").write_text(render(res))  # in case the optional phase dies
    left = args.compile_phase_budget - (time.perf_counter() - started)
    if on_gpu and left > 60:
        # optional: the batch-1 decode step compiled by torch.compile (TOKENPIPE_COMPILE_DECODE)
        w = WorkerProcess(
            common + ["--max-sessions", "1", "--max-context", "1024"],
            env={"TOKENPIPE_COMPILE_DECODE": "1"},
        )
        try:
            w.wait_ready(left)
            r = decode_rate(w, 1, 32, args.decode_tokens, vocab, args.timeout)
            results["decode_1_compiled"] = r
            log(f"decode x1, compiled step: {r}")
            res.add("decode, 1 session, torch.compile'd step", r["aggregate_tok_s"],
                    min(bw / weight_bytes, compute_limit), hf.get("decode_b1"), "tok/s",
                    "TOKENPIPE_COMPILE_DECODE=1")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - optional
            res.meta["notes"].append(f"compiled decode phase skipped: {exc!r}")
        finally:
            w.close()
    text = render(res)
    print(text)
    (out / "bench_gpu.md").write_text(text)
    (out / "bench_gpu.json").write_text(
        json.dumps({"meta": res.meta, "results": results, "rows": res.rows}, indent=1, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
