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
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol import DoneEvent, GenerateRequest  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def run(engine: Any, request: GenerateRequest) -> DoneEvent:
    events = engine.submit(request)
    while not engine.idle:
        events.extend(engine.step())
    done = [e for e in events if isinstance(e, DoneEvent)]
    assert done, events
    return done[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

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
