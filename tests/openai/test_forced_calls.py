"""Forced tool calls in every tool-call format (pure): the grammar accepts exactly the markup
the format's parser turns back into a call whose arguments validate against the tool's
schema, and rejects calls that break the schema or the markup. Strings are run through
llguidance byte by byte (`protocol.constraints._byte_tokenizer`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from supervisor.openai.errors import APIError
from supervisor.openai.forced_calls import forced_call_grammar
from supervisor.openai.tool_parsers import FORMATS, OutputParser, ToolCall, tool_schemas

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "opts": {
            "type": "object",
            "properties": {"x": {"type": "boolean"}},
            "additionalProperties": False,
        },
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}},
                        "required": ["x"], "additionalProperties": False}},
    "properties": {"at": {"$ref": "#/$defs/point"},
                   "mode": {"anyOf": [{"const": "fast"}, {"type": "integer"}]},
                   "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["at", "code"],
    "additionalProperties": False,
}  # fmt: skip
# Qwen reads a parameter as JSON only when its own schema has a JSON `type`: `$ref` and
# `anyOf` go inside a typed parameter
NESTED_QWEN = {
    "type": "object",
    "$defs": {"num": {"anyOf": [{"type": "number"}, {"const": "fast"}]}},
    "properties": {"at": {"type": "object", "properties": {"x": {"$ref": "#/$defs/num"}},
                          "required": ["x"], "additionalProperties": False},
                   "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["at", "code"],
    "additionalProperties": False,
}  # fmt: skip


def tools_of(fmt: str) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
        {"type": "function", "function": {"name": "noop"}},
        {"type": "function", "function": {
            "name": "plot", "parameters": NESTED_QWEN if fmt == "qwen" else NESTED}},
    ]  # fmt: skip


def schema_of(fmt: str, name: str) -> dict[str, Any]:
    for tool in tools_of(fmt):
        if tool["function"]["name"] == name:
            return tool["function"].get("parameters") or {"additionalProperties": False}
    raise KeyError(name)


NAMES = ("get_weather", "noop", "plot")

GOOD = {
    "gemma4": [
        '<|tool_call>call:get_weather{city:<|"|>Paris, "FR" {x}<|"|>,days:3,unit:<|"|>c<|"|>,'
        'tags:[<|"|>a<|"|>,<|"|><|"|>],opts:{x:true}}<tool_call|>',
        "<|tool_call>call:noop{}<tool_call|>",
        '<|tool_call>call:plot{at:{x:-1.5},mode:<|"|>fast<|"|>,code:<|"|>ABC<|"|>}<tool_call|>',
        '<|tool_call>call:plot{at:{x:2},mode:7,code:<|"|>XYZ<|"|>}<tool_call|>',
    ],
    "qwen": [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</b> x\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=unit>\nc\n</parameter>\n"
        '<parameter=tags>\n["a","<b>"]\n</parameter>\n<parameter=opts>\n{"x":false}\n'
        "</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=noop>\n</function>\n</tool_call>",
        '<tool_call>\n<function=plot>\n<parameter=at>\n{"x":0.25}\n</parameter>\n'
        "<parameter=code>\nABC\n</parameter>\n</function>\n</tool_call>",
        '<tool_call>\n<function=plot>\n<parameter=at>\n{"x":"fast"}\n</parameter>\n'
        "<parameter=code>\nABC\n</parameter>\n</function>\n</tool_call>",
    ],
    "hermes": [
        '<tool_call>{"name":"get_weather","arguments":{"city":"P","days":2}}</tool_call>',
        '<tool_call>{"name":"noop","arguments":{}}</tool_call>',
    ],
}
BAD = {
    "gemma4": [
        "<|tool_call>call:get_weather{days:3}<tool_call|>",  # city is required
        '<|tool_call>call:get_weather{city:<|"|>x<|"|>,days:9}<tool_call|>',  # days <= 7
        '<|tool_call>call:get_weather{city:<|"|>x<|"|>,days:3,unit:<|"|>k<|"|>}<tool_call|>',
        '<|tool_call>call:get_weather{city:<|"|>a<tool_call|>',  # the end marker in a string
        '<|tool_call>call:plot{at:{x:1},code:<|"|>abc<|"|>}<tool_call|>',  # pattern
        "<|tool_call>call:other{}<tool_call|>",
        "Sure. <|tool_call>call:noop{}<tool_call|>",
    ],
    "qwen": [
        # a closing tag inside a text value would end the call early
        "<tool_call>\n<function=get_weather>\n<parameter=city>\na</parameter>b\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n"
        '<parameter=days>\n"3"\n</parameter>\n</function>\n</tool_call>',  # days is JSON
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n"
        '<parameter=days>\n3\n</parameter>\n<parameter=tags>\n["</function>"]\n</parameter>\n'
        "</function>\n</tool_call>",
        "<tool_call>\n<function=noop>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    ],
    "hermes": ['<tool_call>{"name":"get_weather","arguments":{"city":"P"}}</tool_call>'],
}


def accepts(grammar: str, text: str) -> bool:
    from protocol.constraints import _byte_tokenizer

    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(list(text.encode()))) and bool(matcher.is_accepting())


def parsed_calls(fmt: str, text: str) -> list[ToolCall]:
    parser = OutputParser(FORMATS[fmt], tool_schemas(tools_of(fmt)))
    pieces = parser.feed(text) + parser.finish()
    assert all(piece.kind == "tool_call" for piece in pieces), pieces
    return [piece.call for piece in pieces if piece.call is not None]


@pytest.mark.parametrize("fmt", sorted(GOOD))
def test_grammar_accepts_calls_the_parser_reads_back_valid(fmt: str) -> None:
    grammar = forced_call_grammar(tools_of(fmt), NAMES, fmt)
    for text in GOOD[fmt]:
        assert accepts(grammar, text), text
        calls = parsed_calls(fmt, text)
        assert len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments), schema_of(fmt, calls[0].name))
    for text in BAD[fmt]:
        assert not accepts(grammar, text), text


def test_named_function_allows_only_that_tool() -> None:
    for fmt in GOOD:
        grammar = forced_call_grammar(tools_of(fmt), ("noop",), fmt)
        assert accepts(grammar, GOOD[fmt][1])
        assert not accepts(grammar, GOOD[fmt][0])


def test_single_token_markers_are_written_as_token_ids() -> None:
    markers = {7000: "<|tool_call>", 7001: "<tool_call|>", 7002: '<|"|>'}
    grammar = forced_call_grammar(tools_of("gemma4"), ("get_weather",), "gemma4", markers)
    assert grammar.startswith("start: <[7000]> call <[7001]>")
    assert '"<|\\"|>"' not in grammar and grammar.count("<[7002]>") >= 4
    qwen = forced_call_grammar(
        tools_of("qwen"), ("noop",), "qwen", {5: "<tool_call>", 6: "</tool_call>"}
    )
    assert qwen.startswith("start: <[5]> call <[6]>")


@pytest.mark.parametrize(
    ("fmt", "parameters", "code", "needle"),
    [
        ("gemma4", {"type": "object", "properties": {"a": {"type": "string", "format": "email"}}},
         "unsupported_parameter", "format"),
        ("qwen", {"type": "object", "properties": {"a": {"enum": [1, 2]}}},
         "unsupported_parameter", "give it 'type'"),
        ("qwen", {"type": "object", "properties": {"a": {"$ref": "#"}}},
         "unsupported_parameter", "$ref"),
        ("gemma4", {"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]},
         "unsatisfiable_constraint", "'a'"),
        ("qwen", {"type": "object", "properties": {"a": {"type": "string", "minLength": 3,
                                                          "maxLength": 2}}, "required": ["a"]},
         "unsatisfiable_constraint", "minLength"),
        ("gemma4", {"type": "object", "additionalProperties": False, "required": ["z"]},
         "unsatisfiable_constraint", "'z'"),
        ("hermes", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 3,
                                                            "maximum": 1}}, "required": ["a"]},
         "unsatisfiable_constraint", "minimum"),
    ],
)  # fmt: skip
def test_schemas_a_format_cannot_write_or_nothing_satisfies(
    fmt: str, parameters: dict[str, Any], code: str, needle: str
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(APIError) as info:
        forced_call_grammar(tools, ("f",), fmt)
    assert (info.value.status, info.value.code) == (400, code), info.value.message
    assert needle in info.value.message
