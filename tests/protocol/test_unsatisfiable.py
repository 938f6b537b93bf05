"""Constraints no output can satisfy (pure): found before generation and named, with the
`unsatisfiable_constraint` code; satisfiable look-alikes are left alone."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol import ErrorCode
from protocol.constraints import ConstraintError, check_constraint

pytest.importorskip("llguidance")

LOOP = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
UNSATISFIABLE: list[tuple[str, Any, str]] = [
    ("json_schema", {"type": "integer", "minimum": 5, "maximum": 3}, "minimum"),
    ("json_schema", {"type": "string", "minLength": 5, "maxLength": 3}, "minLength"),
    ("json_schema", {"enum": []}, "empty"),
    ("json_schema", {"allOf": [{"type": "string"}, {"type": "integer"}]}, "incompatible"),
    ("json_schema", {"type": "object", "additionalProperties": False, "required": ["a"]}, "'a'"),
    ("json_schema", {"type": "array", "items": False, "minItems": 1}, "item"),
    ("json_schema", {"type": "string", "pattern": "^a$", "enum": ["b"]}, "empty"),
    ("json_schema", LOOP, "infinitely deep"),
    (
        "json_schema",
        {
            "$defs": {
                "a": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/b"}},
                "b": {
                    "type": "object",
                    "required": ["x"],
                    "properties": {"x": {"$ref": "#/$defs/a"}},
                },
            },
            "$ref": "#/$defs/a",
        },
        "#/$defs/a",
    ),  # fmt: skip
    ("regex", r"[^\s\S]", "matches nothing"),
    ("grammar", "start: A\nA: /a/ & /b/", "matches nothing"),
    ("grammar", 'start: "x" "y" A\nA: /[0-9]{2}/ & /[a-z]+/', "after 2 forced bytes"),
]
SATISFIABLE: list[tuple[str, Any]] = [
    ("json_schema", {"type": "object", "properties": {"next": {"$ref": "#"}}}),
    ("json_schema", {"anyOf": [{"type": "null"}, LOOP]}),
    ("json_schema", {"$defs": {"t": {"type": "object", "required": ["kids"], "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"}),
    ("json_schema", {"type": "array", "minItems": 0, "items": False}),
    ("regex", "a{3}"),
    ("grammar", 'start: "a" | "b" A\nA: /a/ & /b/'),
]  # fmt: skip


def source_of(kind: str, source: Any) -> str:
    return json.dumps(source) if kind == "json_schema" else str(source)


@pytest.mark.parametrize(("kind", "source", "needle"), UNSATISFIABLE)
def test_unsatisfiable_constraints_are_named(kind: str, source: Any, needle: str) -> None:
    with pytest.raises(ConstraintError) as info:
        check_constraint(kind, source_of(kind, source))
    assert info.value.unsatisfiable and info.value.code == ErrorCode.UNSATISFIABLE_CONSTRAINT
    assert needle in str(info.value)


@pytest.mark.parametrize(("kind", "source"), SATISFIABLE)
def test_satisfiable_constraints_pass(kind: str, source: Any) -> None:
    check_constraint(kind, source_of(kind, source))


def test_a_bad_constraint_keeps_its_invalid_request_code() -> None:
    with pytest.raises(ConstraintError) as info:
        check_constraint("json_schema", json.dumps({"type": "strng"}))
    assert not info.value.unsatisfiable and info.value.code == ErrorCode.INVALID_REQUEST
