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

from .errors import ErrorCode
from .messages import GenerateRequest

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message names the problem. `unsatisfiable`:
    it compiles, but no output can satisfy it (`unsatisfiable_constraint` on the wire)."""

    def __init__(self, message: str, unsatisfiable: bool = False) -> None:
        super().__init__(message)
        self.unsatisfiable = unsatisfiable

    @property
    def code(self) -> str:
        """The wire error code of this failure."""
        if self.unsatisfiable:
            return ErrorCode.UNSATISFIABLE_CONSTRAINT
        return ErrorCode.INVALID_REQUEST


UNSATISFIABLE_PREFIX = "Unsatisfiable schema"
"""How llguidance's JSON compiler begins the error of a schema it proves empty."""
MAX_FORCED_BYTES = 1 << 16
"""How far `first_dead_end` follows bytes the grammar forces before it gives up."""


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
        raise ConstraintError(f"{kind}: {exc}", UNSATISFIABLE_PREFIX in str(exc)) from exc
    raise ConstraintError(f"unknown constraint kind {kind!r}")


def check_constraint(kind: str, source: str) -> None:
    """Raise ConstraintError naming the problem when llguidance rejects the constraint, or
    when no output can satisfy it (`unsatisfiable_reason`)."""
    import llguidance

    grammar = grammar_text(kind, source)
    problem = str(llguidance.LLMatcher.validate_grammar(grammar))
    if problem and not problem.startswith("WARNING"):
        raise ConstraintError(f"{kind}: {problem}", UNSATISFIABLE_PREFIX in problem)
    reason = unsatisfiable_reason(kind, source, grammar)
    if reason is not None:
        raise ConstraintError(f"{kind}: {reason}", unsatisfiable=True)


def unsatisfiable_reason(kind: str, source: str, grammar: str) -> str | None:
    """Why no output can satisfy a constraint that compiles, or None when none is found.

    Two checks, both sound (a reason is only given for a constraint that matches nothing),
    neither complete: a JSON Schema whose every instance would be infinite (a required
    property that leads back to itself with no way out, `recursion_reason`), and a grammar
    that reaches a dead end before its first choice (`first_dead_end`). llguidance's own
    compiler already proves many schemas empty (min > max, an empty enum, disjoint types in
    allOf, a required property that is not allowed) and says so in its error."""
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except ValueError:
            schema = None
        reason = recursion_reason(schema)
        if reason is not None:
            return reason
    return first_dead_end(grammar)


# ------------------------------------------------------------------- matches-nothing checks


def recursion_reason(schema: Any) -> str | None:
    """A reason when every instance of `schema` would be infinite: the least fixed point of
    "this schema has a finite instance" over its local `$ref` targets leaves the root out.

    Over-approximates "has an instance" in everything but `$ref` cycles: types, ranges and
    keywords other than the structural ones are assumed satisfiable (llguidance checks
    those), so a reason is only ever given for a schema that truly has no finite instance."""
    if not isinstance(schema, dict) or "$ref" not in json.dumps(schema):
        return None
    finite: dict[str, bool] = {}
    refs: dict[str, Any] = {}

    def target(ref: str) -> Any:
        if ref == "#":
            return schema
        node: Any = schema
        for part in ref.removeprefix("#/").split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return True  # not ours to judge (llguidance reports a dangling $ref)
            node = node[part]
        return node

    def has_instance(node: Any) -> bool:
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str):
            refs.setdefault(ref, target(ref))
            if not finite.get(ref, False):
                return False
        for branch in node.get("allOf") or []:
            if not has_instance(branch):
                return False
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                if not any(has_instance(branch) for branch in branches):
                    return False
        kinds = node.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds] if kinds is not None else None
        if kinds is None or any(k not in ("object", "array") for k in kinds):
            return True  # a scalar instance needs no nested value
        if "object" in kinds and _object_has_instance(node, has_instance):
            return True
        return "array" in kinds and _array_has_instance(node, has_instance)

    has_instance(schema)  # collects the $ref targets
    while True:
        changed = False
        for ref, node in list(refs.items()):
            if not finite.get(ref, False) and has_instance(node):
                finite[ref] = changed = True
        if not changed:
            break
    if has_instance(schema):
        return None
    cycle = ", ".join(sorted(ref for ref in refs if not finite.get(ref)))
    return f"every instance would be infinitely deep (through $ref {cycle})"


def _object_has_instance(node: dict[str, Any], has_instance: Any) -> bool:
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    additional = node.get("additionalProperties", True)
    for name in node.get("required") or []:
        sub = properties.get(name, additional) if isinstance(name, str) else True
        if not has_instance(sub):
            return False
    return True


def _array_has_instance(node: dict[str, Any], has_instance: Any) -> bool:
    low = node.get("minItems", 0)
    if not isinstance(low, int) or low <= 0:
        return True
    prefix = node.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    needed = prefix[:low] + [node.get("items", True)] * max(low - len(prefix), 0)
    return all(has_instance(sub) for sub in needed)


def first_dead_end(grammar: str) -> str | None:
    """A reason when the grammar reaches a dead end before its first choice: from the start,
    bytes are followed while exactly one is allowed; a state that allows no byte and does not
    accept is a grammar that matches nothing. Run on a vocabulary of the 256 bytes (no model
    needed); a grammar that names token ids (`<[id]>`) is not judged."""
    import llguidance

    if "<[" in grammar:
        return None
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        return None  # reported by validation
    forced = 0
    while forced <= MAX_FORCED_BYTES:
        mask = matcher.compute_bitmask()
        allowed = [b for b in range(256) if mask[b >> 3] >> (b & 7) & 1]
        if not allowed:
            if matcher.is_accepting():
                return None
            where = "at the start" if forced == 0 else f"after {forced} forced bytes"
            return f"the grammar matches nothing (a dead end {where})"
        if len(allowed) > 1 or matcher.is_accepting() or not matcher.consume_token(allowed[0]):
            return None
        forced += 1
    return None


_BYTE_TOKENIZER: Any = None


def _byte_tokenizer() -> Any:
    """An llguidance tokenizer of the 256 single bytes and an EOS (id 256)."""
    global _BYTE_TOKENIZER
    if _BYTE_TOKENIZER is None:
        import llguidance

        class _Bytes:
            eos_token_id = 256
            bos_token_id = None
            tokens = [bytes([i]) for i in range(256)] + [b""]
            special_token_ids = [256]

            def __call__(self, data: bytes) -> list[int]:
                return list(data)

        _BYTE_TOKENIZER = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=[256]
        )
    return _BYTE_TOKENIZER
