"""Structured output and logprobs parameters of serve (pure): response_format, a forced tool
call, logprobs / top_logprobs -> the generate request; bad values -> 400 naming the problem."""

from __future__ import annotations

import json
from typing import Any

import pytest

from supervisor.openai.errors import APIError
from supervisor.openai.forced_calls import forced_call_grammar
from supervisor.openai.params import parse_chat, parse_completion
from supervisor.openai.prepare import generate_request

pytest.importorskip("llguidance")

USER = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "noop"}},
]


def request_of(body: dict[str, Any]) -> dict[str, Any]:
    params = parse_chat({"messages": USER, **body})
    return generate_request([{"text": "x"}], params.sampling, None, True, False)


def error_of(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat({"messages": USER, **body})
    return info.value


def test_response_format_and_logprobs_reach_the_generate_request() -> None:
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert request_of({"response_format": wrapped})["json_schema"] == SCHEMA
    assert request_of({"response_format": {"type": "json_object"}})["json_object"] is True
    plain = request_of({"response_format": {"type": "text"}})
    assert "json_schema" not in plain and "json_object" not in plain
    lp = request_of({"logprobs": True, "top_logprobs": 3})
    assert (lp["return_logprobs"], lp["top_logprobs"]) == (True, 3)
    assert "return_logprobs" not in request_of({"logprobs": False})
    text = parse_completion({"prompt": "x", "logprobs": 2}).sampling
    assert (text.logprobs, text.top_logprobs) == (True, 2)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"response_format": {"type": "yaml"}}, "'response_format' must be"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "json_schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "uniqueItems",
        ),
        ({"top_logprobs": 2}, "needs 'logprobs'"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "'f'"),
    ],
)
def test_bad_structured_parameters(body: dict[str, Any], needle: str) -> None:
    error = error_of(body)
    assert (error.status, error.code) == (400, "invalid_value")
    assert needle in error.message


def test_forced_tool_call_grammar() -> None:
    params = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    assert params.forced_tools == ("get_weather", "noop") and params.parse_tools
    named = parse_chat(
        {
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    assert named.forced_tools == ("get_weather",)
    grammar = forced_call_grammar(TOOLS, named.forced_tools, "hermes")
    assert grammar.startswith('start: "<tool_call>" call "</tool_call>"')
    assert '{\\"name\\":\\"get_weather\\",\\"arguments\\":' in grammar
    schema = json.loads(grammar.split("%json ", 1)[1].rsplit(' "}"', 1)[0])
    assert schema.pop("x-guidance") == {"whitespace_flexible": False}
    assert schema == SCHEMA
    with pytest.raises(APIError) as info:
        forced_call_grammar(TOOLS, named.forced_tools, "no-such-format")
    assert info.value.code == "unsupported_parameter"
