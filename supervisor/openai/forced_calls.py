"""A forced tool call (`tool_choice` "required" or a named function) as a grammar (pure).

`forced_call_grammar(tools, names, fmt, marker_ids)` is an llguidance Lark grammar whose
every output is exactly one call of one of `names`, in the markup of the tool-call format
`fmt`, that `tool_parsers.FORMATS[fmt]` turns back into that call with arguments valid under
the tool's `parameters` schema:

- `hermes`: `<tool_call>{"name":NAME,"arguments":{...}}</tool_call>`, the arguments by
  llguidance's own `%json` (compact);
- `gemma4`: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, the arguments in Gemma 4's
  syntax (`schema_grammar.gemma4_syntax`);
- `qwen`: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>` (Qwen3-Coder / Qwen 3.5). The parser reads a parameter as
  JSON when its schema's `type` is one of integer, number, boolean, null, object, array, and
  as the text verbatim otherwise, so a typed parameter is JSON (objects and arrays in
  `schema_grammar.json_syntax`, whose strings never hold a closing tag) and any other is
  text that satisfies the schema's string keywords and holds no closing tag.

A marker that the model's tokenizer writes as one token (`marker_ids`: id -> text, as
`state.load_model_state` finds them) is written `<[id]>`, so the model emits the very token
it was trained on. A schema the format cannot express is a 400 `unsupported_parameter`
naming the tool and the keyword; a tool whose arguments nothing satisfies is a 400
`unsatisfiable_constraint`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from protocol.constraints import ConstraintError, check_constraint

from .errors import APIError, unsupported
from .schema_grammar import (
    ANNOTATIONS,
    SchemaGrammar,
    SchemaGrammarError,
    UnsatisfiableSchema,
    gemma4_syntax,
    json_syntax,
    lark_literal,
    text_body_regex,
)

GEMMA4_NAME = re.compile(r"[A-Za-z0-9_\-.]+")
QWEN_CLOSERS = ("</parameter>", "</function>", "</tool_call>")
# A Qwen parameter read as JSON when its schema's type is one of these (tool_parsers._qwen_value)
QWEN_JSON_TYPES = ("integer", "number", "boolean", "object", "array", "null")
QWEN_TEXT_KEYS = frozenset({"type", "enum", "const", "minLength", "maxLength", "pattern"})


def unsatisfiable(message: str) -> APIError:
    return APIError(400, "unsatisfiable_constraint", message, param="tools")


def _token(marker: str, marker_ids: Mapping[int, str]) -> str:
    """`<[id]>` when the tokenizer writes `marker` as one token, else the literal text."""
    for token_id, text in marker_ids.items():
        if text == marker:
            return f"<[{token_id}]>"
    return lark_literal(marker)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameters schema; a tool without one takes no arguments."""
    parameters = tool["function"].get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return parameters


def _hermes(tools: list[dict[str, Any]], marker_ids: Mapping[int, str]) -> str:
    calls = []
    for tool in tools:
        name = orjson.dumps(tool["function"]["name"]).decode()
        # the arguments are their own %json, so the tool's `$ref`s resolve against its schema
        arguments = {**_parameters(tool), "x-guidance": {"whitespace_flexible": False}}
        head = lark_literal(f'{{"name":{name},"arguments":')
        calls.append(f'{head} %json {orjson.dumps(arguments).decode()} "}}"')
    open_, close = _token("<tool_call>", marker_ids), _token("</tool_call>", marker_ids)
    return f"start: {open_} call {close}\ncall: " + " | ".join(calls)


def _gemma4(tools: list[dict[str, Any]], marker_ids: Mapping[int, str]) -> str:
    quote = next((i for i, text in marker_ids.items() if text == '<|"|>'), None)
    syntax = gemma4_syntax(quote)
    open_, close = _token("<|tool_call>", marker_ids), _token("<tool_call|>", marker_ids)
    lines, calls = [], []
    for index, tool in enumerate(tools):
        name = tool["function"]["name"]
        if not GEMMA4_NAME.fullmatch(name):
            raise SchemaGrammarError(f"the name {name!r} is not one gemma4 calls can write")
        parameters = _parameters(tool)
        if parameters.get("type", "object") != "object":
            raise SchemaGrammarError("'parameters' must be an object schema")
        grammar = SchemaGrammar(syntax, parameters, prefix=f"t{index}")
        arguments = grammar.value({**parameters, "type": "object"})
        lines.append(grammar.rules())
        calls.append(f"{lark_literal('call:' + name)} {arguments}")
    head = f"start: {open_} call {close}\ncall: " + " | ".join(calls)
    return "\n".join([head, *lines])


def _qwen_text(schema: Any, index: int, lines: list[str]) -> str:
    """A rule for a parameter the parser keeps as text: the string keywords of `schema`."""
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise UnsatisfiableSchema("the schema is false")
    keys = set(schema) - ANNOTATIONS
    unknown = sorted(keys - QWEN_TEXT_KEYS)
    if unknown:
        raise SchemaGrammarError(
            f"keyword{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} not supported for "
            "a qwen text parameter (one whose 'type' is not a single JSON type)"
        )
    kind = schema.get("type")
    if kind is not None and "string" not in (kind if isinstance(kind, list) else [kind]):
        raise SchemaGrammarError(f"a qwen parameter of type {kind!r} is written as text")
    end = lark_literal("\n</parameter>\n")
    members = [schema["const"]] if "const" in schema else schema.get("enum")
    if members is not None:
        if not isinstance(members, list) or not members:
            raise UnsatisfiableSchema("'enum' is empty")
        if not any(isinstance(m, str) for m in members):
            raise SchemaGrammarError(
                "a qwen parameter without a JSON 'type' is text: give it 'type' to use "
                "a non-string 'enum'/'const'"
            )
        texts = [m for m in members if isinstance(m, str) and not _closes(m)]
        if not texts:
            raise UnsatisfiableSchema("every 'enum'/'const' member holds a closing tag")
        body = " | ".join(lark_literal(text + "\n</parameter>\n") for text in texts)
        lines.append(f"text_{index}: {body}")
        return f"text_{index}"
    # the closing tag inside the terminal: a lexeme ends only where it cannot go on
    lines.append(f"BODY_{index}: {text_body_regex(schema, '(?s:.)', QWEN_CLOSERS)}")
    lines.append(f"TEXT_{index}: BODY_{index} {end}")
    return f"TEXT_{index}"


def _closes(text: str) -> bool:
    return any(closer in text for closer in QWEN_CLOSERS)


def _qwen(tools: list[dict[str, Any]], marker_ids: Mapping[int, str]) -> str:
    open_, close = _token("<tool_call>", marker_ids), _token("</tool_call>", marker_ids)
    syntax = json_syntax(QWEN_CLOSERS)
    lines: list[str] = []
    calls = []
    count = 0
    for index, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name != name.strip() or re.search(r"[>\n]", name):
            raise SchemaGrammarError(f"the name {name!r} is not one qwen calls can write")
        parameters = _parameters(tool)
        properties = parameters.get("properties") or {}
        required = parameters.get("required") or []
        additional = parameters.get("additionalProperties", True)
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise SchemaGrammarError("'properties' must be an object and 'required' a list")
        grammar = SchemaGrammar(syntax, parameters, prefix=f"t{index}")
        fields: list[tuple[str, bool]] = []
        for key in list(properties) + [r for r in required if r not in properties]:
            key = str(key)
            if key != key.strip() or re.search(r"[>\n]", key):
                raise SchemaGrammarError(f"the parameter name {key!r} cannot be written")
            if key in properties:
                sub = properties[key]
            elif additional is False:
                raise UnsatisfiableSchema(f"required property {key!r} is not allowed")
            else:
                sub = additional
            kind = sub.get("type") if isinstance(sub, dict) else None
            try:
                if kind in QWEN_JSON_TYPES:
                    value = f'{grammar.value(sub)} "\\n</parameter>\\n"'
                else:
                    count += 1
                    value = _qwen_text(sub, count, lines)
            except UnsatisfiableSchema as exc:
                if key in required:
                    raise UnsatisfiableSchema(f"required property {key!r}: {exc}") from None
                continue
            tag = lark_literal(f"<parameter={key}>\n")
            fields.append((f"{tag} {value}", key in required))
        parts = [lark_literal(f"\n<function={name}>\n")]
        parts += [pair if needed else f"({pair})?" for pair, needed in fields]
        parts.append(lark_literal("</function>\n"))
        calls.append(" ".join(parts))
        lines.append(grammar.rules())
    head = f"start: {open_} call {close}\ncall: " + " | ".join(calls)
    return "\n".join([head, *lines])


BUILDERS = {"hermes": _hermes, "gemma4": _gemma4, "qwen": _qwen}


def forced_call_grammar(
    tools: list[dict[str, Any]],
    names: tuple[str, ...],
    fmt: str,
    marker_ids: Mapping[int, str] | None = None,
) -> str:
    """The grammar of exactly one call of one of `names` in format `fmt` (module docstring).
    Raises `APIError` 400 when a schema cannot be written or satisfied."""
    build = BUILDERS.get(fmt)
    if build is None:
        raise unsupported(
            f"'tool_choice' 'required' or a named function is not supported for the "
            f"'{fmt}' tool-call format",
            "tool_choice",
        )
    chosen = [tool for tool in tools if tool["function"]["name"] in names]
    marker_ids = marker_ids or {}
    try:
        grammar = build(chosen, marker_ids)
    except UnsatisfiableSchema as exc:
        raise unsatisfiable(f"'tools': no call can satisfy the parameters: {exc}") from None
    except SchemaGrammarError as exc:
        raise unsupported(f"'tools' in the {fmt} tool-call format: {exc}", "tools") from None
    try:
        check_constraint("grammar", grammar)
    except ConstraintError as exc:
        if getattr(exc, "unsatisfiable", False):
            raise unsatisfiable(f"'tools': {exc}") from None
        raise APIError(400, "invalid_value", f"'tools': {exc}", param="tools") from None
    return grammar
