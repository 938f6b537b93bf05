"""Constrained decoding's cost at batch 1: the same request with and without a constraint,
in one in-process engine on the default model (issue 22: <= 5% of decode tok/s).

    python tools/bench_structured.py                    # 64 tokens, 5 rounds, 2 threads
    python tools/bench_structured.py --tokens 16 --rounds 1   # smoke
    python tools/bench_structured.py --device cuda      # the GPU path (one H200)

Each round runs, in alternating order, the request unconstrained and constrained by a JSON
Schema whose output is one long string (`{"text": "..."}` with minLength), so both decode
the full --tokens and the constrained one spends them in the grammar's commonest state, then
a regex (`[a-z ,.]+`). The figure is the `done` line's decode_tok_s (tokens after the first
over the time after the first); medians over rounds. The grammar is compiled once, outside
the timing (the cache keeps it).

With --worker: the real worker (`tokenpipe worker`, started as `tokenpipe run` starts it,
nothing patched; tools/bench_gpu.py's client) on a model config with random weights
(default: the Gemma 4 31B shape, bf16 on CUDA) and the default model's real tokenizer
(Gemma 3, 262,144 tokens, rebuilt from its GGUF), at 1 and 32 sessions:

    python tools/bench_structured.py --worker --device cuda          # one H200
    python tools/bench_structured.py --worker --device cuda --tokenizer tokenizer.json.xz
    python tools/bench_structured.py --worker --device cpu --tiny    # the CPU dry run

Each request feeds 32 random prompt ids and decodes --tokens; a constrained one carries a
suite schema (tests/data/json_schemas.json; row i of a batch takes the i-th of --schemas)
wrapped as `{"type": "array", "items": SCHEMA, "minItems": 100000}`, so the output is valid
JSON of the schema's shape that never ends within the limit. The tokenizer's EOS tokens are
renamed away (config `eos_token_id: []`, `<end_of_turn>` no longer spelt so), so neither
stream stops early: every request decodes exactly --tokens, and the rates compare the same
numbers of tokens. The figure is decode tok/s over the window where every request of the
batch decodes: the worker's `stats` (asked every 0.1 s during the run) counts the tokens
(`generated_tokens`), since random weights may stream only empty-text special ids for a
while; runs alternate free / constrained; the worker's decode-ahead hits and misses and the
grammar's mask figures are logged per case.
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocol import DoneEvent, GenerateRequest  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def run(engine: Any, request: GenerateRequest) -> DoneEvent:
    events = engine.submit(request)
    while not engine.idle:
        events.extend(engine.step())
    done = [e for e in events if isinstance(e, DoneEvent)]
    assert done, events
    return done[0]


# ------------------------------------------------------------------ --worker: the real worker

SUITE = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas.json"
DEFAULT_SCHEMAS = (
    "person,order,anyof_shape,ref_array,recursive_tree,event,product_catalog,log_entry"
)
NEVER_ENDS = 100_000  # minItems of the array around each schema
DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def default_tokenizer_dir(where: Path, source: str | None = None) -> Path:
    """The default model's tokenizer in `where` (its tokenizer.json `source` when given, else
    rebuilt from its GGUF; no network), with no token spelt as an EOS: `<end_of_turn>` is
    renamed, and no tokenizer_config or generation_config names one."""
    from worker.loading.default_model import default_model_path
    from worker.loading.gguf_convert import cached_dir_for, metadata, open_reader
    from worker.loading.tokenizer import build_gguf_tokenizer

    if source is not None:  # its tokenizer.json, brought over (xz-compressed: .xz)
        raw = Path(source).read_bytes()
        document = (lzma.decompress(raw) if source.endswith(".xz") else raw).decode()
        return _write_tokenizer(where, document)
    gguf = default_model_path()
    converted = [cached_dir_for(gguf, dtype) / "tokenizer.json" for dtype in DTYPES]
    done = [path for path in converted if path.is_file()]
    if done:  # the default model ran here before: its converted tokenizer
        document = done[0].read_text()
    else:  # from the GGUF's metadata (~5-15 s: the reader parses every tensor's header)
        meta = metadata(open_reader(gguf))
        files = build_gguf_tokenizer(meta, str(meta.get("general.architecture", "")))
        document = files.backend.to_str()
    return _write_tokenizer(where, document)


def _write_tokenizer(where: Path, document: str) -> Path:
    from worker.loading.tokenizer import write_token_bytes_sidecar

    document = document.replace('"<end_of_turn>"', '"<end_of_turn_unused>"')
    where.mkdir(parents=True, exist_ok=True)
    (where / "tokenizer.json").write_text(document)
    write_token_bytes_sidecar(where / "tokenizer.json")
    return where


def worker_model_dir(
    config_path: Path, tiny: bool, vocab: int, where: Path, tokenizer: str | None
) -> Path:
    """config.json (shrunk with --tiny, vocabulary kept: the real tokenizer's) beside the
    default tokenizer."""
    from bench_gpu import TINY_OVERRIDES

    config = json.loads(config_path.read_text())
    if tiny:
        config.update(TINY_OVERRIDES)
        config["vocab_size"] = config["vocab_size_per_layer_input"] = vocab
    config["eos_token_id"] = []
    default_tokenizer_dir(where, tokenizer)
    (where / "config.json").write_text(json.dumps(config, indent=1))
    return where


def never_ending(schema: dict[str, Any]) -> dict[str, Any]:
    """An array of `schema`'s instances that cannot end within any run (`$defs` and
    `definitions` lifted to the root, where the `$ref`s resolve)."""
    inner = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    lifted = {k: v for k, v in schema.items() if k in ("$defs", "definitions")}
    return {**lifted, "type": "array", "items": inner, "minItems": NEVER_ENDS}


def steady_rate(worker: Any, requests: list[dict[str, Any]], timeout: float,
                poll_s: float = 0.1) -> tuple[dict[str, float], dict[int, list[Any]]]:  # fmt: skip
    """Send the batch; while it runs, ask the worker's `stats` every `poll_s`. The rate is
    its `generated_tokens` counter over the steady window: from the first answer where every
    request of the batch is active with a token, to the last before one ends (random weights
    may stream only empty-text special ids for a while: token lines cannot time it)."""
    import queue

    ids = []
    for req in requests:
        ids.append(worker.new_id())
        worker.send({"add_prefix": False, "temperature": 0.0, **req, "id": ids[-1]})
    lines: dict[int, list[Any]] = {rid: [] for rid in ids}
    samples: list[tuple[float, dict[str, Any]]] = []
    open_ids, asked, next_poll = set(ids), None, 0.0
    deadline = time.perf_counter() + timeout
    while open_ids:
        now = time.perf_counter()
        if now > deadline:
            raise TimeoutError(f"{len(open_ids)} requests still open")
        if asked is None and now >= next_poll:
            asked, next_poll = worker.new_id(), now + poll_s
            worker.send({"op": "stats", "id": asked})
        try:
            line = worker.lines.get(timeout=0.01)
        except queue.Empty:
            continue
        if line is None:
            raise RuntimeError(f"worker exited with {worker.proc.wait()}")
        rid = line.msg.get("id")
        if rid == asked:
            samples.append((line.t, line.msg["stats"]))
            asked = None
        elif rid in lines:
            lines[rid].append(line)
            if line.msg.get("event") == "error":
                raise RuntimeError(f"request {rid} failed: {line.msg}")
            if line.msg.get("event") == "done":
                open_ids.discard(rid)
    steady = [
        (t, stats["generated_tokens"])
        for t, stats in samples
        if len(stats["requests"]) == len(ids)
        and all(r["completion_tokens"] > 0 for r in stats["requests"])
    ]
    counts = [int(req_lines[-1].msg.get("completion_tokens", 0)) for req_lines in lines.values()]
    rate = 0.0
    if len(steady) >= 2 and steady[-1][0] > steady[0][0]:
        rate = (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
    return {
        "tok_s": rate,
        "window_s": steady[-1][0] - steady[0][0] if steady else 0.0,
        "samples": len(steady),
        "min_tokens": min(counts),
        "max_tokens": max(counts),
    }, lines


def worker_main(args: argparse.Namespace) -> None:
    from bench_gpu import SAMPLING_CASES, WorkerProcess, log, random_ids

    suite = {entry["name"]: entry["schema"] for entry in json.loads(SUITE.read_text())}
    names = [n for n in args.schemas.split(",") if n]
    schemas = [never_ending(suite[name]) for name in names]
    sessions = [int(s) for s in args.sessions.split(",") if s]
    cases = [c for c in args.sampling.split(",") if c]
    on_gpu = args.device.startswith("cuda")
    started = time.perf_counter()
    model_dir = worker_model_dir(
        Path(args.model) / "config.json",
        args.tiny,
        262_144,
        Path(tempfile.mkdtemp()) / "model",
        args.tokenizer,
    )
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    log(f"model dir with the default tokenizer: {time.perf_counter() - started:.1f}s")
    worker = WorkerProcess(
        ["--model", str(model_dir), "--tokenizer_path", str(model_dir / "tokenizer.json"),
         "--random-weights", "--device", args.device,
         "--dtype", "bfloat16" if on_gpu else "float32",
         "--max-sessions", str(max(sessions) + 1), "--max-context", "1024"]
    )  # fmt: skip

    def requests(batch: int, constrained: bool, sampling: dict[str, Any], first: int,
                 tokens: int) -> list[dict[str, Any]]:  # fmt: skip
        out = []
        for i in range(batch):
            req = {"prompt_segments": [{"ids": random_ids(32, vocab, 100 + first + i)}],
                   "max_new_tokens": tokens, "return_token_ids": True, **sampling}  # fmt: skip
            if constrained:
                req["json_schema"] = schemas[(first + i) % len(schemas)]
            out.append(req)
        return out

    def ahead() -> dict[str, float]:
        stats = worker.ask({"op": "stats"}).get("stats", {})
        return {**(stats.get("decode_ahead") or {}), **(stats.get("grammar") or {})}

    results: dict[str, list[float]] = {}
    try:
        worker.wait_ready(args.timeout * 3)
        log("warm-up: the largest batch constrained (every schema compiles)")
        t = time.perf_counter()
        worker.generate(requests(max(sessions + [len(schemas)]), True, {}, 0, 16), args.timeout)
        log(f"warm-up done in {time.perf_counter() - t:.1f}s")
        for case in cases:
            sampling = SAMPLING_CASES[case]
            for batch in sessions:
                tokens = max(args.tokens, 2 * batch + 32)  # all rows overlap for a while
                for round_index in range(args.rounds):
                    order = (False, True) if round_index % 2 == 0 else (True, False)
                    for constrained in order:
                        before = ahead()
                        first = round_index if batch == 1 else 0
                        reqs = requests(batch, constrained, sampling, first, tokens)
                        rate, lines = steady_rate(worker, reqs, args.timeout)
                        after = ahead()
                        grew = {k: float(v) - float(before.get(k, 0)) for k, v in after.items()}
                        kind = "constrained" if constrained else "free"
                        results.setdefault(f"{case} x{batch} {kind}", []).append(rate["tok_s"])
                        schema = names[round_index % len(names)] if batch == 1 else "mixed"
                        log(
                            f"{case} x{batch} {kind}"
                            + (f" ({schema})" if constrained else "")
                            + f": {rate['tok_s']:.1f} tok/s, tokens {rate['min_tokens']}-"
                            f"{rate['max_tokens']}, window {rate['window_s']:.2f}s "
                            f"({rate['samples']} samples), decode "
                            f"ahead +{grew.get('hits', 0):.0f} hits "
                            f"+{grew.get('misses', 0):.0f} misses"
                            + (
                                f", masks: {grew.get('masked_steps', 0):.0f} steps, fill "
                                f"{grew.get('mask_fill_ms', 0):.0f} ms (started after "
                                f"{grew.get('mask_start_ms', 0):.0f} ms), waited "
                                f"{grew.get('mask_wait_ms', 0):.0f} ms, rows filled ahead "
                                f"{grew.get('mask_rows_ahead', 0):.0f}; slowest fill so far "
                                f"{after.get('mask_fill_max_ms', 0):.1f} ms"
                                if constrained
                                else ""
                            )
                        )
                        if constrained and batch == sessions[0] and round_index == 0:
                            text = "".join(
                                ln.msg.get("token", "") for ln in next(iter(lines.values()))
                            )
                            log(f"  constrained output starts: {text[:160]!r}")
    finally:
        worker.close()
    print(f"\ndevice {args.device}, model {args.model}{' (tiny)' if args.tiny else ''}, "
          f"{args.tokens}+ tokens, {args.rounds} rounds, schemas {args.schemas}")  # fmt: skip
    print("| case | sessions | free tok/s | constrained tok/s | vs free |")
    print("| --- | --- | --- | --- | --- |")
    for case in cases:
        for batch in sessions:
            free = results.get(f"{case} x{batch} free", [])
            held = results.get(f"{case} x{batch} constrained", [])
            if not free or not held:
                continue
            f_med, c_med = statistics.median(free), statistics.median(held)
            print(
                f"| {case} | {batch} | {f_med:.1f} [{min(free):.1f}-{max(free):.1f}] | "
                f"{c_med:.1f} [{min(held):.1f}-{max(held):.1f}] | "
                + (f"{100 * (c_med / f_med - 1):+.1f}% |" if f_med else "- |")
            )
    print(json.dumps({"results": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", action="store_true", help="the real worker (see the doc)")
    parser.add_argument("--model", default="examples/gemma4_31b", help="--worker: config dir")
    parser.add_argument("--tiny", action="store_true", help="--worker: shrink the config")
    parser.add_argument("--sessions", default="1,32", help="--worker: batch sizes")
    parser.add_argument("--sampling", default="greedy", help="--worker: bench_gpu's cases")
    parser.add_argument("--schemas", default=DEFAULT_SCHEMAS, help="--worker: suite names")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--tokenizer", default=None,
                        help="--worker: the default model's tokenizer.json (or .xz) brought "
                        "over, where its GGUF is absent (the GPU box)")  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return

    from worker.engine.engine import Engine, EngineConfig
    from worker.loading.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(None, args.device, torch.float32, progress=False)
    if args.device.startswith("cuda"):
        from worker.device.graphed_lm import GraphedCausalLM

        loaded.model = GraphedCausalLM(loaded.model)
    engine = Engine(loaded, EngineConfig(max_sessions=2, max_context=1024), args.device)
    story = {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 4 * args.tokens}},
        "required": ["text"],
    }
    variants: dict[str, dict[str, Any]] = {
        "free": {},
        "json_schema": {"json_schema": story},
        "regex": {"regex": "[a-z ,.]+"},
    }
    for fields in variants.values():  # warm-up: compile, caches, first-step costs
        run(engine, GenerateRequest(messages=PROMPT, max_new_tokens=4, **fields))
    rates: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            request = GenerateRequest(messages=PROMPT, max_new_tokens=args.tokens, **variants[name])
            done = run(engine, request)
            rates[name].append(done.decode_tok_s)
            tokens[name].append(done.completion_tokens)
    free = statistics.median(rates["free"])
    print(f"device {args.device}, threads {args.threads}, {args.tokens} tokens, "
          f"{args.rounds} rounds")  # fmt: skip
    for name in names:
        rate = statistics.median(rates[name])
        print(
            f"{name:12} decode {rate:8.2f} tok/s  ({100 * (rate / free - 1):+.1f}% vs free)  "
            f"tokens {statistics.median(tokens[name]):.0f}  "
            f"[{min(rates[name]):.2f}-{max(rates[name]):.2f}]"
        )


if __name__ == "__main__":
    main()
