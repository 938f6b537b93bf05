"""`tokenpipe serve` end to end with the official `openai` client (issue 22): response_format
json_schema / json_object, a forced tool call, logprobs in chat and completions, streaming
and not, and a bad schema answered with a 400 before anything runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from supervisor.client import run_command

pytestmark = pytest.mark.slow
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

REPO = Path(__file__).resolve().parents[2]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Reply with JSON only: a person named Ada, 36."}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from serve(tmp_path_factory, [])


@pytest.fixture(scope="module", params=["gemma4", "qwen"])
def format_client(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, openai.OpenAI]]:
    """serve with another family's tool-call format (the default model has none of its own)."""
    for api in serve(tmp_path_factory, ["--tool-parser", request.param]):
        yield request.param, api


def serve(tmp_path_factory: pytest.TempPathFactory, extra: list[str]) -> Iterator[openai.OpenAI]:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENPIPE_THREADS": "2"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*run_command(), "serve", "--port", str(port), "--max-context", "1024",
             "--max-sessions", "4", "--log-level", "warning", *extra],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(log_path.read_text()[-3000:])
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            with openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300
            ) as api:
                yield api
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_response_format_json_schema_whole_and_streamed(client: openai.OpenAI) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    whole = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=ASK, response_format=response_format, max_tokens=64, temperature=0,
    )  # fmt: skip
    content = whole.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), PERSON)
    stream = client.chat.completions.create(
        model=whole.model, messages=ASK, response_format=response_format, max_tokens=64,
        temperature=0.9, seed=5, stream=True,
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)
    anything = client.chat.completions.create(
        model=whole.model, messages=ASK, response_format={"type": "json_object"}, max_tokens=96,
        temperature=0,
    )  # fmt: skip
    # any object: the 270M model keeps adding keys to an open object up to max_tokens
    text = anything.choices[0].message.content or ""
    assert text.startswith('{"')
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_bad_schema_is_a_400_naming_the_problem(client: openai.OpenAI) -> None:
    bad: Any = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id, messages=ASK, response_format=bad
        )
    assert "uniqueItems" in str(info.value)


def test_forced_tool_call(client: openai.OpenAI) -> None:
    tools: Any = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"], "additionalProperties": False,
            }},
        }
    ]  # fmt: skip
    model = client.models.list().data[0].id
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = client.chat.completions.create(
            model=model, tools=tools, tool_choice=choice, max_tokens=64, temperature=0,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        )  # fmt: skip
        calls = response.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", response
        assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
        assert response.choices[0].finish_reason == "tool_calls"


TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False,
    }}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"], "additionalProperties": False,
    }}},
]  # fmt: skip
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def test_forced_tool_call_in_every_format(format_client: tuple[str, openai.OpenAI]) -> None:
    """gemma4 and qwen markup: the grammar's output comes back as one call whose arguments
    validate, whole and streamed, greedy and sampled."""
    fmt, api = format_client
    model = api.models.list().data[0].id
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice, extra in (
        ("required", {"temperature": 0}),
        ({"type": "function", "function": {"name": "get_time"}}, {"temperature": 1, "seed": 3}),
    ):
        response = api.chat.completions.create(
            model=model, tools=TOOLS, tool_choice=choice, max_tokens=96, messages=ASK_WEATHER,
            **extra,
        )  # fmt: skip
        message = response.choices[0].message
        assert response.choices[0].finish_reason == "tool_calls", (fmt, message)
        assert message.tool_calls and len(message.tool_calls) == 1 and not message.content
        call = message.tool_calls[0].function
        if choice != "required":
            assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    stream = api.chat.completions.create(
        model=model, tools=TOOLS, tool_choice="required", max_tokens=96, messages=ASK_WEATHER,
        temperature=0, stream=True,
    )  # fmt: skip
    streamed = [
        delta
        for chunk in stream
        if chunk.choices and chunk.choices[0].delta.tool_calls
        for delta in chunk.choices[0].delta.tool_calls
    ]
    assert streamed and streamed[0].function and streamed[0].function.name
    arguments = "".join(d.function.arguments or "" for d in streamed if d.function)
    jsonschema.validate(json.loads(arguments), schemas[streamed[0].function.name])


def test_unsatisfiable_constraints_are_a_400_before_generation(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    loop = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    bad_format: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": loop}}
    empty_tool: Any = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}},
        "required": ["n"]}}}]  # fmt: skip
    for kwargs in (
        {"response_format": bad_format},
        {"tools": empty_tool, "tool_choice": "required"},
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **kwargs)
        body: Any = info.value.body
        assert body["code"] == "unsatisfiable_constraint", body
    # the server serves on, unchanged
    ok = client.chat.completions.create(model=model, messages=ASK, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_logprobs_chat_and_completions(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    assert chat.choices[0].logprobs is not None
    content = chat.choices[0].logprobs.content or []
    assert chat.usage is not None and len(content) == chat.usage.completion_tokens
    text = "".join(item.token for item in content)
    assert text == chat.choices[0].message.content
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6  # greedy: the top token
        assert item.bytes == list(item.token.encode())
    streamed = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
        stream=True,
    )  # fmt: skip
    tokens = [
        item.token
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content
        for item in chunk.choices[0].logprobs.content
    ]
    assert "".join(tokens) == text
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens) == completion.choices[0].text
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
