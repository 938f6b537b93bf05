"""Structured output and logprobs on the default model, in process (issue 22).

- every schema of tests/data/json_schemas.json, greedy and sampled, in one batched engine
  (all requests in flight at once): every output parses and validates;
- regex and grammar constraints; bad constraints answered with an error before anything runs;
- logprobs equal transformers' log_softmax of the same logits (fp32, CPU).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol import DoneEvent, ErrorEvent, Event, GenerateRequest, TokenEvent, decode_request
from protocol.constraints import ConstraintError, check_constraint

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SUITE = json.loads((Path(__file__).parent.parent / "data" / "json_schemas.json").read_text())
MAX_NEW = 128
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Any:
    from worker.engine.engine import Engine, EngineConfig
    from worker.loading.loader import load_model

    torch.set_num_threads(2)
    loaded = load_model(None, "cpu", torch.float32, progress=False)
    config = EngineConfig(max_sessions=2 * len(SUITE) + 4, max_context=512, prefill_chunk=2048)
    return Engine(loaded, config, "cpu")


def drive(engine: Any, requests: list[GenerateRequest], max_steps: int = 2000) -> list[Event]:
    events: list[Event] = []
    for req in requests:
        events.extend(engine.submit(req))
    for _ in range(max_steps):
        if engine.idle:
            return events
        events.extend(engine.step())
    raise AssertionError("the engine did not finish")


def outputs(events: list[Event]) -> dict[Any, tuple[str, DoneEvent | ErrorEvent]]:
    text: dict[Any, list[str]] = {}
    out: dict[Any, tuple[str, DoneEvent | ErrorEvent]] = {}
    for e in events:
        if isinstance(e, TokenEvent):
            text.setdefault(e.id, []).append(e.token)
        elif isinstance(e, (DoneEvent, ErrorEvent)):
            out[e.id] = ("".join(text.get(e.id, [])), e)
    return out


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def test_schema_suite_greedy_and_sampled(engine: Any) -> None:
    assert len(SUITE) >= 50
    requests = []
    for index, entry in enumerate(SUITE):
        for mode, extra in (("greedy", {}), ("sampled", {"temperature": 1.0, "seed": 7 + index})):
            requests.append(
                GenerateRequest(
                    id=f"{entry['name']}/{mode}",
                    messages=chat(entry["prompt"]),
                    max_new_tokens=MAX_NEW,
                    json_schema=entry["schema"],
                    **extra,
                )
            )
    results = outputs(drive(engine, requests))
    failures = []
    for entry in SUITE:
        for mode in ("greedy", "sampled"):
            text, end = results[f"{entry['name']}/{mode}"]
            if not isinstance(end, DoneEvent) or end.finish_reason != "stop":
                failures.append(f"{entry['name']}/{mode}: ended by {end!r}: {text!r}")
                continue
            try:
                jsonschema.validate(json.loads(text), entry["schema"])
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append(f"{entry['name']}/{mode}: {text!r}: {exc}")
    assert not failures, "\n".join(failures)


def test_regex_grammar_and_json_object(engine: Any) -> None:
    requests = [
        GenerateRequest(
            id="regex", messages=chat("When was Rome founded?"), max_new_tokens=24,
            regex=r"[0-9]{3} (BC|AD)",
        ),
        GenerateRequest(
            id="lark", messages=chat("Is water wet?"), max_new_tokens=8,
            grammar='start: "yes" | "no"',
        ),
        GenerateRequest(
            id="gbnf", messages=chat("Pick a color."), max_new_tokens=8,
            grammar='root ::= "red" | "green" | "blue"',
        ),
        GenerateRequest(
            id="object",
            messages=chat('Reply with JSON only, like {"name": "Tom", "age": 3}: a cat.'),
            max_new_tokens=MAX_NEW, json_object=True,
        ),
    ]  # fmt: skip
    results = outputs(drive(engine, requests))
    assert re.fullmatch(r"[0-9]{3} (BC|AD)", results["regex"][0])
    assert results["lark"][0] in ("yes", "no")
    assert results["gbnf"][0] in ("red", "green", "blue")
    assert all(isinstance(end, DoneEvent) for _, end in results.values())
    # any JSON object: the 270M model keeps adding keys to an open object until the limit,
    # so it is checked as a well-formed start (a `stop` would have to parse)
    text, end = results["object"]
    assert text.startswith('{"') and '":' in text
    if isinstance(end, DoneEvent) and end.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json_schema": {"type": "strng"}}, "strng"),
        ({"json_schema": {"$ref": "#/$defs/missing"}}, "missing"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ],
)
def test_bad_constraints_answered_before_generation(
    engine: Any, fields: dict[str, Any], needle: str
) -> None:
    kind, source = next(iter(fields.items()))
    with pytest.raises(ConstraintError, match=re.escape(needle)):
        check_constraint(kind, json.dumps(source) if kind == "json_schema" else source)
    events = drive(engine, [GenerateRequest(id="bad", prompt="x", max_new_tokens=4, **fields)])
    assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
    assert events[0].code == "invalid_request" and needle in events[0].error


@pytest.mark.parametrize(
    "fields",
    [
        {"json_schema": {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}},
        {"json_schema": {"type": "integer", "minimum": 2, "maximum": 1}},
        {"regex": r"[^\s\S]"},
        {"grammar": 'start: "a" B\nB: /[0-9]/ & /[a-z]/'},
    ],
)
def test_unsatisfiable_constraint_is_an_error_line_that_changes_nothing(
    engine: Any, fields: dict[str, Any]
) -> None:
    from protocol import OpenRequest

    drive(engine, [OpenRequest(session_id="kept")])
    turn = GenerateRequest(id="turn", prompt="Hello", max_new_tokens=3, session_id="kept")
    drive(engine, [turn])
    before = list(engine.pool.get("kept").resident_ids)
    bad = GenerateRequest(id="bad", prompt="Goodbye", max_new_tokens=4, session_id="kept", **fields)
    events = drive(engine, [bad])
    assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
    assert events[0].code == "unsatisfiable_constraint", events[0]
    assert engine.pool.get("kept").resident_ids == before
    follow = decode_request(
        json.dumps({"id": "follow", "prompt_segments": [{"ids": [*before, 108]}],
                    "add_prefix": False, "max_new_tokens": 1, "session_id": "kept"}).encode()
    )  # fmt: skip
    assert isinstance(follow, GenerateRequest)
    done = outputs(drive(engine, [follow]))["follow"][1]
    assert isinstance(done, DoneEvent) and done.reused_prompt_tokens == len(before)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"prompt":"x","regex":"a","grammar":"start: \\"a\\""}', "at most one of"),
        (b'{"prompt":"x","json_object":true,"json_schema":{}}', "at most one of"),
        (b'{"prompt":"x","regex":""}', "regex: must not be empty"),
        (b'{"prompt":"x","return_logprobs":true,"top_logprobs":21}', "top_logprobs: must be"),
        (b'{"prompt":"x","top_logprobs":2}', "needs return_logprobs"),
        (b'{"prompt":"x","json_schema":"{}"}', "json_schema: expected object"),
    ],
)
def test_codec_rejects_bad_constraint_fields(line: bytes, message: str) -> None:
    result = decode_request(line)
    assert not isinstance(result, GenerateRequest) and message in result.message


def test_logprobs_match_transformers_log_softmax(engine: Any, default_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    prompt = chat("Name three fruits.")
    requests = [
        GenerateRequest(
            id="greedy", messages=prompt, max_new_tokens=6, return_logprobs=True,
            top_logprobs=5, return_token_ids=True,
        ),
        GenerateRequest(
            id="hot", messages=prompt, max_new_tokens=6, return_logprobs=True, top_logprobs=5,
            temperature=0.7, seed=11, return_token_ids=True,
        ),
    ]  # fmt: skip
    events = drive(engine, requests)
    from worker.engine.prompt import build_prompt

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    hf.eval()
    for rid, temperature in (("greedy", 1.0), ("hot", 0.7)):
        ids = build_prompt(
            requests[0], engine.tokenizer, engine.prefix_ids, engine.tokenizer.vocab_size,
            engine.config.max_context, engine.chat_template,
        )  # fmt: skip
        entries = [lp for e in events if isinstance(e, TokenEvent) and e.id == rid
                   for lp in (e.logprobs or [])]  # fmt: skip
        generated = [lp.id for lp in entries]
        assert len(generated) >= 3
        with torch.no_grad():
            logits = hf(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1].float()
        reference = torch.log_softmax(logits / temperature, dim=-1)
        for position, entry in enumerate(entries):
            row = reference[position]
            assert abs(entry.logprob - float(row[entry.id])) < 1e-4
            assert entry.top is not None and len(entry.top) == 5
            values, top_ids = torch.topk(row, 5)
            assert [t.id for t in entry.top] == top_ids.tolist()
            for t, v in zip(entry.top, values.tolist(), strict=True):
                assert abs(t.logprob - v) < 1e-4
