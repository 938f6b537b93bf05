"""xgrammar and llguidance side by side on the default model's vocabulary (issue 22).

    python tools/bench_grammar.py                  # the 56-schema suite, 48-token walks
    python tools/bench_grammar.py --tokens 16 --limit 10   # smoke

For each schema of tests/data/json_schemas.json and each library:
- compile: schema -> a ready matcher, ms (xgrammar: `compile_json_schema` with its cache off;
  llguidance: `grammar_from_json_schema` + `LLMatcher(...)`, its first mask included, since
  llguidance builds its lexer lazily);
- mask: the next-token bitmask of one step, us per token, along a token walk per schema and
  library (seeded random choice among the allowed tokens, ended when EOS is allowed or after
  --tokens tokens). Each library walks its own allowed set: they disagree on some tokens
  (llguidance keeps to canonical tokenizations at some boundaries, e.g. only `{"` first,
  and allows `:-` where xgrammar does not), so a shared walk ends early.
Both libraries run with their JSON defaults except whitespace: compact JSON (no free
whitespace) in both, as tokenpipe compiles schemas. Single-threaded mask calls.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _load_tokenizer() -> object:
    from worker.loading.default_model import default_model_path
    from worker.loading.gguf_convert import convert_gguf
    from worker.loading.tokenizer import Tokenizer

    directory = convert_gguf(default_model_path(), torch.float32, progress=False, weights=False)
    return Tokenizer.from_file(directory / "tokenizer.json")


def _allowed(bits: torch.Tensor, vocab: int) -> set[int]:
    allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return set(allowed[:vocab].nonzero().flatten().tolist())


def _walk(
    fill: Callable[[], None], mask: torch.Tensor, consume: Callable[[int], bool], vocab: int,
    eos: set[int], tokens: int, rng: random.Random,
) -> list[float]:  # fmt: skip
    """Seconds per mask along one walk: a random allowed token each step, until EOS is
    allowed or `tokens` steps."""
    times: list[float] = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        allowed = _allowed(mask[0], vocab)
        if allowed & eos or not allowed or not consume(rng.choice(sorted(allowed))):
            break
    return times


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import llguidance
    import llguidance.torch as llg_torch
    import xgrammar as xgr

    from worker.engine.constraints import llguidance_tokenizer

    torch.set_num_threads(1)
    suite = json.loads((ROOT / "tests/data/json_schemas.json").read_text())
    if args.limit:
        suite = suite[: args.limit]
    tok = _load_tokenizer()
    vocab = tok.vocab_size
    eos = sorted(tok.eos_ids)
    eos_set = set(eos)

    t0 = time.perf_counter()
    ll_tok = llguidance_tokenizer(tok)
    ll_tok_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    table = [tok.token_bytes(i) for i in range(vocab)]
    xgr_info = xgr.TokenizerInfo(table, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=eos)
    xgr_compiler = xgr.GrammarCompiler(xgr_info, max_threads=1, cache_enabled=False)
    xgr_tok_ms = (time.perf_counter() - t0) * 1000

    rows: list[tuple[str, float, float, float, float, int]] = []
    ll_masks: list[float] = []
    xg_masks: list[float] = []
    seed = args.seed
    for entry in suite:
        schema = entry["schema"]
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        ll_mask = llg_torch.allocate_token_bitmask(1, vocab)
        llg_torch.fill_next_token_bitmask(matcher, ll_mask)
        ll_compile = (time.perf_counter() - t0) * 1000
        assert not matcher.is_error(), (entry["name"], matcher.get_error())

        t0 = time.perf_counter()
        compiled = xgr_compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=True
        )
        xg_matcher = xgr.GrammarMatcher(compiled)
        xg_mask = xgr.allocate_token_bitmask(1, xgr_info.vocab_size)
        xg_compile = (time.perf_counter() - t0) * 1000

        ll_times = _walk(
            functools.partial(llg_torch.fill_next_token_bitmask, matcher, ll_mask),
            ll_mask, matcher.consume_token, vocab, eos_set, args.tokens, random.Random(seed),
        )  # fmt: skip
        xg_times = _walk(
            functools.partial(xg_matcher.fill_next_token_bitmask, xg_mask),
            xg_mask, xg_matcher.accept_token, vocab, eos_set, args.tokens, random.Random(seed),
        )  # fmt: skip
        seed += 1
        ll_masks.extend(ll_times)
        xg_masks.extend(xg_times)
        rows.append(
            (
                entry["name"],
                ll_compile,
                xg_compile,
                statistics.mean(ll_times) * 1e6,
                statistics.mean(xg_times) * 1e6,
                len(ll_times),
            )
        )

    print(f"vocabulary {vocab}; tokenizer set-up: llguidance {ll_tok_ms:.0f} ms, "
          f"xgrammar {xgr_tok_ms:.0f} ms")  # fmt: skip
    print(f"{'schema':24} {'llg ms':>8} {'xgr ms':>8} {'llg us/tok':>11} {'xgr us/tok':>11}")
    for name, llc, xgc, llm, xgm, n in rows:
        print(f"{name:24} {llc:8.1f} {xgc:8.1f} {llm:11.0f} {xgm:11.0f}  ({n} tokens)")
    ll_c = [r[1] for r in rows]
    xg_c = [r[2] for r in rows]
    print()
    print(f"{len(rows)} schemas; mask steps: llguidance {len(ll_masks)}, "
          f"xgrammar {len(xg_masks)}")  # fmt: skip
    print(f"{'':24} {'llguidance':>12} {'xgrammar':>12}")
    for label, a, b in (
        ("compile median ms", statistics.median(ll_c), statistics.median(xg_c)),
        ("compile p90 ms", _percentile(ll_c, 0.9), _percentile(xg_c, 0.9)),
        ("compile max ms", max(ll_c), max(xg_c)),
        ("mask mean us", statistics.mean(ll_masks) * 1e6, statistics.mean(xg_masks) * 1e6),
        ("mask p50 us", _percentile(ll_masks, 0.5) * 1e6, _percentile(xg_masks, 0.5) * 1e6),
        ("mask p99 us", _percentile(ll_masks, 0.99) * 1e6, _percentile(xg_masks, 0.99) * 1e6),
    ):
        print(f"{label:24} {a:12.1f} {b:12.1f}")


if __name__ == "__main__":
    main()
