"""What a generate's constraint fields mean as an llguidance grammar (no tokenizer, no torch).

`request_constraint(req)` names a request's constraint as (kind, source); `grammar_text`
turns it into llguidance's grammar; `check_constraint` asks llguidance whether it compiles,
so `serve` rejects a bad schema or grammar with a 400 before sending anything, and the
worker (`worker/engine/constraints.py`, which compiles against the vocabulary) answers one
with an `error` line before generating. llguidance is imported on first use.
"""

from __future__ import annotations

import json
from typing import Any

from .messages import GenerateRequest

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message names the problem."""


def request_constraint(req: GenerateRequest) -> tuple[str, str] | None:
    """(kind, source) of a request's constraint, or None. The codec allows at most one."""
    if req.json_schema is not None:
        return "json_schema", json.dumps(req.json_schema, sort_keys=True)
    if req.json_object:
        return "json_schema", json.dumps(ANY_JSON_OBJECT)
    if req.regex is not None:
        return "regex", req.regex
    if req.grammar is not None:
        return "grammar", req.grammar
    return None


def grammar_text(kind: str, source: str) -> str:
    """llguidance's grammar for a constraint: kind "json_schema" (source: the schema as
    JSON text), "regex", or "grammar" (Lark, or GBNF converted). Raises ConstraintError.

    JSON output is compact: no whitespace between tokens (shorter output, no whitespace
    loops; with `, ` / `: ` separators the default model looped on the digits of numbers far
    more often); a schema's own "x-guidance" options still apply."""
    import llguidance

    try:
        if kind == "json_schema":
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(
                    source, defaults={"whitespace_flexible": False}
                )
            )
        if kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(source))
        if kind == "grammar":
            return str(llguidance.grammar_from("grammar", source))
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"{kind}: {exc}") from exc
    raise ConstraintError(f"unknown constraint kind {kind!r}")


def check_constraint(kind: str, source: str) -> None:
    """Raise ConstraintError naming the problem when llguidance rejects the constraint."""
    import llguidance

    grammar = grammar_text(kind, source)
    problem = str(llguidance.LLMatcher.validate_grammar(grammar))
    if problem and not problem.startswith("WARNING"):
        raise ConstraintError(f"{kind}: {problem}")
