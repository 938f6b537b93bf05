"""A JSON Schema (the subset tool parameters use) as llguidance Lark rules in a call syntax.

Forced tool calls (`forced_calls.py`) need arguments in syntaxes that are not plain JSON:
Gemma 4's `{city:<|"|>Paris<|"|>,days:3}` and JSON inside Qwen's XML `<parameter=...>`, where
no string may contain the tags that end the call. `SchemaGrammar(syntax).value(schema)` adds
the rules for a schema and returns the name of its rule; `rules()` is the grammar text.

- numbers, integers, booleans and null are llguidance's own `%json` of their keywords
  (ranges, `multipleOf`), compact;
- a string is one terminal: opening delimiter, a body, closing delimiter. The body's regex is
  `minLength`/`maxLength` and `pattern` intersected with "contains none of the syntax's
  forbidden substrings". The closing delimiter is inside the terminal (a lexeme ends only
  where it cannot go on, so a body followed by a separate literal could never end), or a
  special token right after it (its bytes cannot extend a body);
- objects write their declared properties in order (the required ones always, optional ones
  maybe) and never others, so `additionalProperties` is honoured whatever its value; an
  object with no declared properties takes any keys with `additionalProperties`' values;
- arrays honour `items`, `minItems`, `maxItems`; `enum`/`const` become literals;
  `anyOf`/`oneOf` alternatives (oneOf as anyOf); `$ref` to `#`, `#/$defs/..` or
  `#/definitions/..` one rule per target (recursion allowed).

Annotations (title, description, default, examples, ...) are ignored; any other keyword
raises `SchemaGrammarError` naming it, and a schema no value can satisfy (an empty `enum`,
`false`, a required property that is not allowed) raises `UnsatisfiableSchema`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment",
        "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict",
    }
)  # fmt: skip
NUMBER_KEYS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
STRING_KEYS = frozenset({"minLength", "maxLength", "pattern"})
OBJECT_KEYS = frozenset({"properties", "required", "additionalProperties"})
ARRAY_KEYS = frozenset({"items", "minItems", "maxItems"})
SUPPORTED = (
    ANNOTATIONS | NUMBER_KEYS | STRING_KEYS | OBJECT_KEYS | ARRAY_KEYS
    | {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"}
)  # fmt: skip
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
# Characters with a meaning in a regex (Rust `regex` syntax), and `/` which ends a Lark regex.
# `<` and `>` are not escaped: `\<` is a word boundary there.
_REGEX_META = set("\\.+*?()|[]{}^$/")
ANY_CHAR = "(?s:.)"


class SchemaGrammarError(ValueError):
    """A schema this syntax cannot express; the message names the keyword."""


class UnsatisfiableSchema(SchemaGrammarError):
    """A schema that no value satisfies; the message says why."""


def regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class Delimiter:
    """A string delimiter: text, or one special token (`token_id`) written `<[id]>`."""

    text: str
    token_id: int | None = None


@dataclass(frozen=True)
class Syntax:
    """How values are written: string delimiters, which characters a string body may hold,
    the substrings it must not contain, and how property names are written."""

    name: str
    quote: Delimiter
    body_char: str
    """Regex of one character a string body may hold (the value is the body verbatim)."""
    forbidden: tuple[str, ...]
    bare_key: str | None
    """Regex of the names written without quotes (Gemma 4), or None: always quoted."""
    json_quoted: bool = False
    """Literals (`enum`, `const`, names) are JSON strings, escapes and all."""

    def string_literal(self, text: str) -> str:
        """A Lark expression writing `text` as a string of this syntax."""
        if self.quote.token_id is not None:
            token = f"<[{self.quote.token_id}]>"
            return f"{token} {lark_literal(text)} {token}" if text else f"{token} {token}"
        return lark_literal(self.quote.text + text + self.quote.text)


def gemma4_syntax(quote_token: int | None) -> Syntax:
    """Gemma 4's call arguments: strings in `<|"|>`, names bare where they can be."""
    return Syntax(
        "gemma4",
        Delimiter('<|"|>', quote_token),
        ANY_CHAR,
        ('<|"|>', "<tool_call|>"),
        r"[A-Za-z0-9_\-.]+",
    )


def json_syntax(forbidden: tuple[str, ...]) -> Syntax:
    """JSON whose strings hold no escapes (so `pattern` and lengths apply to the text as
    written) and none of `forbidden`."""
    return Syntax("json", Delimiter('"'), r'[^"\\\x00-\x1f]', forbidden, None, json_quoted=True)


def text_body_regex(schema: dict[str, Any], body_char: str, forbidden: tuple[str, ...]) -> str:
    """The Lark terminal expression of a string's body under `schema`'s length and pattern
    keywords, without any of `forbidden` (several `/regex/` joined by `&`)."""
    low = schema.get("minLength", 0)
    high = schema.get("maxLength")
    for key, value in (("minLength", low), ("maxLength", high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SchemaGrammarError(f"'{key}' must be an integer")
    if high is not None and low > high:
        raise UnsatisfiableSchema(f"minLength ({low}) is greater than maxLength ({high})")
    if low == 0 and high is None:
        parts = [f"/(?:{body_char})*/"]
    else:
        parts = [f"/(?:{body_char}){{{low},{'' if high is None else high}}}/"]
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise SchemaGrammarError("'pattern' must be a string")
        parts.append(f"/{_anchored(pattern)}/")
    if forbidden:
        words = "|".join(regex_escape(word) for word in forbidden)
        parts.append(f"~/(?s:.*)(?:{words})(?s:.*)/")
    return " & ".join(parts)


def _anchored(pattern: str) -> str:
    """A JSON Schema `pattern` (found anywhere in the string) as a whole-string regex."""
    body = pattern
    start = "" if body.startswith("^") else "(?s:.*)"
    body = body.removeprefix("^")
    ends = body.endswith("$") and not body.endswith("\\$")
    end = "" if ends else "(?s:.*)"
    body = body[:-1] if ends else body
    body = body.replace("\\/", "/").replace("/", "\\/")
    return f"{start}(?:{body}){end}"


class SchemaGrammar:
    """Lark rules for schemas in one syntax; `root` is the schema `$ref`s resolve against."""

    def __init__(self, syntax: Syntax, root: Any, prefix: str = "a") -> None:
        self.syntax = syntax
        self.root = root
        self.prefix = prefix
        self._lines: list[str] = []
        self._count = 0
        self._refs: dict[str, str] = {}
        self._any: str | None = None

    def rules(self) -> str:
        return "\n".join(self._lines)

    def _new(self, body: str, terminal: bool = False) -> str:
        self._count += 1
        name = f"{self.prefix}_{self._count}"
        name = name.upper() if terminal else name
        self._lines.append(f"{name}: {body}")
        return name

    def _reserve(self) -> tuple[str, int]:
        self._count += 1
        self._lines.append("")
        return f"{self.prefix}_{self._count}", len(self._lines) - 1

    # ------------------------------------------------------------------------ dispatch

    def value(self, schema: Any) -> str:
        """The rule name of a value valid under `schema`."""
        if schema is True or (isinstance(schema, dict) and not set(schema) - ANNOTATIONS):
            return self.any_value()
        if schema is False:
            raise UnsatisfiableSchema("the schema is false")
        if not isinstance(schema, dict):
            raise SchemaGrammarError("a schema must be an object or a boolean")
        unknown = sorted(set(schema) - SUPPORTED)
        if unknown:
            raise SchemaGrammarError(
                f"keyword{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                f"not supported in the {self.syntax.name} call syntax"
            )
        rest = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
        if "$ref" in rest:
            if set(rest) != {"$ref"}:
                raise SchemaGrammarError("'$ref' with sibling keywords is not supported")
            return self._ref(rest["$ref"])
        if "allOf" in rest:
            branches = rest.pop("allOf")
            if (
                not isinstance(branches, list)
                or len(branches) != 1
                or not isinstance(branches[0], dict)
            ):
                raise SchemaGrammarError("'allOf' of more than one schema is not supported")
            return self.value({**rest, **branches[0]})
        for key in ("anyOf", "oneOf"):
            if key in rest:
                branches = rest.pop(key)
                if not isinstance(branches, list) or not branches:
                    raise UnsatisfiableSchema(f"'{key}' is empty")
                options = []
                for branch in branches:
                    if branch is False:
                        continue
                    merged = rest if branch is True else {**rest, **branch}
                    try:
                        options.append(self.value(merged))
                    except UnsatisfiableSchema:
                        continue
                if not options:
                    raise UnsatisfiableSchema(f"no branch of '{key}' can be satisfied")
                return self._new(" | ".join(options))
        if "const" in rest:
            return self._new(self.literal(rest["const"]))
        if "enum" in rest:
            members = rest["enum"]
            if not isinstance(members, list):
                raise SchemaGrammarError("'enum' must be a list")
            options = []
            for member in members:
                try:
                    options.append(self.literal(member))
                except UnsatisfiableSchema:
                    continue
            if not options:
                raise UnsatisfiableSchema("'enum' has no value this syntax can write")
            return self._new(" | ".join(options))
        types = self._types(rest)
        options = []
        for kind in types:
            try:
                options.append(self._typed(kind, rest))
            except UnsatisfiableSchema:
                if len(types) == 1:
                    raise
        if not options:
            raise UnsatisfiableSchema("no type of the schema can be satisfied")
        return options[0] if len(options) == 1 else self._new(" | ".join(options))

    @staticmethod
    def _types(schema: dict[str, Any]) -> list[str]:
        kind = schema.get("type")
        if kind is None:
            if set(schema) & OBJECT_KEYS:
                return ["object"]
            if set(schema) & ARRAY_KEYS:
                return ["array"]
            if set(schema) & STRING_KEYS:
                return ["string"]
            if set(schema) & NUMBER_KEYS:
                return ["number"]
            return list(TYPES)
        kinds = kind if isinstance(kind, list) else [kind]
        for item in kinds:
            if item not in TYPES:
                raise SchemaGrammarError(f"unknown type {item!r}")
        if not kinds:
            raise UnsatisfiableSchema("'type' is an empty list")
        return list(kinds)

    def _typed(self, kind: str, schema: dict[str, Any]) -> str:
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "string":
            return self._string(schema)
        if kind == "boolean":
            return self._new('"true" | "false"')
        if kind == "null":
            return self._new('"null"')
        numeric = {k: v for k, v in schema.items() if k in NUMBER_KEYS}
        return self._number(kind, numeric)

    def _number(self, kind: str, keywords: dict[str, Any]) -> str:
        spec = {"type": kind, **keywords, "x-guidance": {"whitespace_flexible": False}}
        return self._new(f"%json {json.dumps(spec, sort_keys=True)}")

    def _ref(self, ref: Any) -> str:
        if not isinstance(ref, str):
            raise SchemaGrammarError("'$ref' must be a string")
        name = self._refs.get(ref)
        if name is not None:
            return name
        target: Any
        if ref == "#":
            target = self.root
        else:
            target = None
            for section in ("#/$defs/", "#/definitions/"):
                if ref.startswith(section) and isinstance(self.root, dict):
                    defs = self.root.get(section[2:-1])
                    key = ref[len(section) :].replace("~1", "/").replace("~0", "~")
                    if isinstance(defs, dict) and key in defs:
                        target = defs[key]
            if target is None:
                raise SchemaGrammarError(f"'$ref' {ref!r} names no definition of this schema")
        name, line = self._reserve()
        self._refs[ref] = name
        self._lines[line] = f"{name}: {self.value(target)}"
        return name

    # ------------------------------------------------------------------------- values

    def any_value(self) -> str:
        """Any value of the syntax (strings in the syntax's limits, numbers, objects...)."""
        if self._any is not None:
            return self._any
        name, line = self._reserve()
        self._any = name
        string = self._string({})
        number = self._number("number", {})
        key = self._key_any()
        obj = self._new(f'"{{" ({key} ":" {name} ("," {key} ":" {name})*)? "}}"')
        arr = self._new(f'"[" ({name} ("," {name})*)? "]"')
        self._lines[line] = (
            f'{name}: {string} | {number} | "true" | "false" | "null" | {obj} | {arr}'
        )
        return name

    def _key_any(self) -> str:
        if self.syntax.bare_key is not None:
            return self._new(f"/{self.syntax.bare_key}/", terminal=True)
        return self._string({"minLength": 1})

    def key(self, name: str) -> str:
        """A Lark expression writing the property name `name` and the `:` after it."""
        for word in self.syntax.forbidden:
            if word in name:
                raise SchemaGrammarError(f"property name {name!r} holds {word!r}")
        bare = self.syntax.bare_key
        if self.syntax.json_quoted or bare is None:
            return lark_literal(json.dumps(name, ensure_ascii=False) + ":")
        if re.fullmatch(bare, name):
            return lark_literal(name + ":")
        return f'{self.syntax.string_literal(name)} ":"'

    def literal(self, value: Any) -> str:
        """A Lark expression writing exactly `value` (an `enum`/`const` member)."""
        if isinstance(value, str):
            json_quoted = self.syntax.json_quoted
            written = json.dumps(value, ensure_ascii=False) if json_quoted else value
            for word in self.syntax.forbidden:
                if word in written:
                    raise UnsatisfiableSchema(f"{value!r} holds {word!r}")
            return lark_literal(written) if json_quoted else self.syntax.string_literal(value)
        if value is None or isinstance(value, (bool, int, float)):
            return lark_literal(json.dumps(value))
        if isinstance(value, list):
            items = ' "," '.join(self.literal(item) for item in value)
            return f'"[" {items} "]"' if items else '"[" "]"'
        if isinstance(value, dict):
            pairs = ' "," '.join(f"{self.key(str(k))} {self.literal(v)}" for k, v in value.items())
            return f'"{{" {pairs} "}}"' if pairs else '"{" "}"'
        raise SchemaGrammarError(f"cannot write {value!r}")

    def _string(self, schema: dict[str, Any]) -> str:
        syntax = self.syntax
        body = text_body_regex(schema, syntax.body_char, syntax.forbidden)
        quote = syntax.quote
        if quote.token_id is not None:
            token = f"<[{quote.token_id}]>"
            return self._new(f"{token} {self._new(body, terminal=True)} {token}")
        inner = self._new(body, terminal=True)
        quoted = lark_literal(quote.text)
        return self._new(f"{quoted} {inner} {quoted}", terminal=True)

    def _object(self, schema: dict[str, Any]) -> str:
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        additional = schema.get("additionalProperties", True)
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise SchemaGrammarError("'properties' must be an object and 'required' a list")
        names = list(properties) + [r for r in required if r not in properties]
        if not names and additional is not False:
            value = self.value(additional)
            key = self._key_any()
            return self._new(f'"{{" ({key} ":" {value} ("," {key} ":" {value})*)? "}}"')
        fields: list[tuple[str, bool]] = []
        for name in names:
            if name in properties:
                sub = properties[name]
            elif additional is False:
                raise UnsatisfiableSchema(f"required property {name!r} is not allowed")
            else:
                sub = additional
            try:
                pair = f"{self.key(str(name))} {self.value(sub)}"
            except UnsatisfiableSchema as exc:
                if name in required:
                    raise UnsatisfiableSchema(f"required property {name!r}: {exc}") from None
                continue
            fields.append((pair, name in required))
        # first: the fields from here on when none is written yet; later: after one was
        first, later = "", ""
        for pair, needed in reversed(fields):
            head = f"{pair} {later}".strip()
            tail = f'"," {pair} {later}'.strip()
            if needed:
                first, later = self._new(head), self._new(tail)
            else:
                first = self._new(f"{head} | {first}" if first else f"({head})?")
                later = self._new(f"{tail} | {later}" if later else f"({tail})?")
        return self._new(f'"{{" {first} "}}"' if first else '"{" "}"')

    def _array(self, schema: dict[str, Any]) -> str:
        items = schema.get("items", True)
        low = schema.get("minItems", 0)
        high = schema.get("maxItems")
        for key, value in (("minItems", low), ("maxItems", high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise SchemaGrammarError(f"'{key}' must be an integer")
        if high is not None and low > high:
            raise UnsatisfiableSchema(f"minItems ({low}) is greater than maxItems ({high})")
        if high == 0:
            return self._new('"[" "]"')
        try:
            item = self.value(items)
        except UnsatisfiableSchema:
            if low > 0:
                raise
            return self._new('"[" "]"')
        more = f"{{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        elements = f'{item} ("," {item}){more}'
        return self._new(f'"[" {elements} "]"' if low > 0 else f'"[" ({elements})? "]"')
