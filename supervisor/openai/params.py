"""Request validation: an OpenAI request body -> frozen parameters, or an `APIError` (pure).

Structured output: `response_format` `json_schema` / `json_object` and a forced tool call
(`tool_choice` "required" or a named function) become the generate's `json_schema`,
`json_object` or `grammar` (checked with llguidance here, so a bad schema is a 400 naming
the problem before anything is sent, and one no output can satisfy a 400
`unsatisfiable_constraint`); `logprobs` / `top_logprobs` become `return_logprobs` /
`top_logprobs`.

Honoured, accepted-and-ignored (`user`, `store`, `metadata`, `strict`, `reasoning_effort`,
`parallel_tool_calls` and unknown keys) and rejected parameters: anything the server cannot
do is rejected with 400 `unsupported_parameter`, never silently ignored; a bad value is 400
`invalid_value`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from protocol import chat_template
from protocol.constraints import ConstraintError, check_constraint

from .errors import APIError, invalid_value, unsupported

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_SESSION_ID_LEN = 256
MAX_NESTING = 64
"""Deepest JSON nesting accepted anywhere in a request (tool schemas and call arguments
included): deeper data would make rendering and `tojson` recurse toward Python's limit."""
TOO_DEEP = f"the request is nested more than {MAX_NESTING} levels deep"
MAX_TOP_LOGPROBS = 20
# Protocol seeds are >= 1 (0 means "unset"); an OpenAI seed s maps to s + 1.
SEED_OFFSET = 1


@dataclass(frozen=True)
class SamplingParams:
    """What the worker is asked for, shared by chat and text completions."""

    max_new_tokens: int = -1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    grammar: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class ChatParams:
    """A validated chat completion request. `messages` are normalized for templates: text
    content as one string, `developer` as `system`, tool-call arguments parsed to objects."""

    model: str | None
    messages: list[dict[str, Any]]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None
    forced_tools: tuple[str, ...] = ()
    """`tool_choice` "required" (every tool) or a named function: the output must be one
    call of one of these tools (`forced_calls.forced_call_grammar` builds the grammar)."""


@dataclass(frozen=True)
class CompletionParams:
    """A validated text completion request: `prompt` text or token ids."""

    model: str | None
    prompt: str | list[int]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None


# ------------------------------------------------------------------------------- primitives


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_value(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise invalid_value(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_value(f"'{name}' must be an integer", name)
    if value < low:
        raise invalid_value(f"'{name}' must be at least {low}, got {value}", name)
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid_value(f"'{name}' must be a boolean", name)
    return value


def validate_session_id(value: Any, source: str = "session_id") -> str:
    """1..256 printable ASCII characters, else 400 `invalid_value`."""
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= MAX_SESSION_ID_LEN
        or not all(" " <= ch <= "~" for ch in value)
    ):
        raise invalid_value(
            f"{source} must be 1 to {MAX_SESSION_ID_LEN} printable ASCII characters", "session_id"
        )
    return value


def check_nesting(value: Any, limit: int = MAX_NESTING) -> None:
    """400 `invalid_value` (a fixed message) when `value` nests lists and objects deeper than
    `limit`; iterative, so it is linear in the value's size and never recurses."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= limit:
            raise invalid_value(TOO_DEEP)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_value("'model' must be a string", "model")
    return model


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise invalid_value("'stop' must be a non-empty string or a list of them", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid_value(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(items)


def _reject_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise unsupported("'n' other than 1 is not supported", "n")
    if body.get("logit_bias"):
        raise unsupported("'logit_bias' is not supported", "logit_bias")
    # Penalties are not implemented: only their neutral values are accepted.
    for penalty, neutral in (
        ("presence_penalty", 0),
        ("frequency_penalty", 0),
        ("repetition_penalty", 1),
    ):
        value = body.get(penalty)
        if value is not None and value != neutral:
            raise unsupported(f"'{penalty}' is not supported", penalty)


def sampling_params(body: dict[str, Any], default_max_tokens: int | None) -> SamplingParams:
    """The sampling fields shared by both endpoints."""
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = default_max_tokens
    top_k = _integer(body, "top_k", -1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise invalid_value("'seed' must be a non-negative integer", "seed")
    if seed is not None and seed >= (1 << 63) - SEED_OFFSET:
        raise invalid_value("'seed' is too large", "seed")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise invalid_value("'top_p' must be greater than 0", "top_p")
    json_schema, json_object = _response_format(body)
    return SamplingParams(
        max_new_tokens=-1 if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=top_p,
        top_k=0 if top_k is None or top_k == -1 else top_k,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=0 if seed is None else seed + SEED_OFFSET,
        stop=_stop(body),
        json_schema=json_schema,
        json_object=json_object,
    )


def _response_format(body: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """(json_schema, json_object) of `response_format`; the schema checked by llguidance."""
    response_format = body.get("response_format")
    if response_format is None:
        return None, False
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None, False
    if kind == "json_object":
        return None, True
    if kind != "json_schema":
        raise invalid_value(
            "'response_format' must be {type: text}, {type: json_object} or "
            "{type: json_schema, json_schema: {name, schema}}",
            "response_format",
        )
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise invalid_value(
            "'response_format.json_schema.schema' must be a JSON Schema object",
            "response_format",
        )
    _check("json_schema", orjson.dumps(schema).decode(), "response_format")
    return schema, False


def _check(kind: str, source: str, param: str) -> None:
    try:
        check_constraint(kind, source)
    except ConstraintError as exc:
        if exc.unsatisfiable:
            raise APIError(400, exc.code, f"'{param}': {exc}", param=param) from None
        raise invalid_value(f"'{param}': {exc}", param) from None


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """(return_logprobs, top_logprobs). Chat: `logprobs` true and `top_logprobs` 0..20;
    completions: `logprobs` an integer 0..20 (the top count; 0 is the sampled token only)."""
    value = body.get("logprobs")
    if chat:
        wanted = _bool(body, "logprobs")
        top = _integer(body, "top_logprobs", 0)
        if top is not None and top > MAX_TOP_LOGPROBS:
            raise invalid_value(
                f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs"
            )
        if top and not wanted:
            raise invalid_value("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return wanted, top or 0
    if value is None or value is False:
        return False, 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid_value(
            f"'logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}", "logprobs"
        )
    return True, value


def with_logprobs(sampling: SamplingParams, body: dict[str, Any], chat: bool) -> SamplingParams:
    wanted, top = _logprobs(body, chat)
    return replace(sampling, logprobs=wanted, top_logprobs=top)


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid_value("'stream_options' must be an object", "stream_options")
    return _bool(options, "include_usage")


# --------------------------------------------------------------------------------- messages


def normalize_messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> the plain dicts a chat template reads (the shared
    `protocol.chat_template.normalize_messages`, the worker's too), roles checked."""
    if isinstance(value, list):
        for index, message in enumerate(value):
            if isinstance(message, dict) and message.get("role") not in ROLES:
                raise invalid_value(
                    f"messages[{index}]: role must be one of {', '.join(ROLES)}", "messages"
                )
    try:
        return chat_template.normalize_messages(value)
    except chat_template.MessageError as exc:
        raise invalid_value(str(exc), exc.param) from None


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid_value("'tools' must be a list", "tools")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise invalid_value(
                "each tool must be {type: function, function: {name, ...}}", "tools"
            )
    return tools or None


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> tuple[str, ...]:
    """("auto",), ("none",), or the names of the tools a forced call may name."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto",)
    if choice in ("auto", "none"):
        return (str(choice),)
    names = [t["function"]["name"] for t in tools or ()]
    if choice == "required":
        if not names:
            raise invalid_value("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return tuple(names)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid_value(
            "'tool_choice' must be 'auto', 'none', 'required' or "
            "{type: function, function: {name}}",
            "tool_choice",
        )
    if name not in names:
        raise invalid_value(f"'tool_choice' names '{name}', which is not in 'tools'", "tool_choice")
    return (name,)


def _body_session(body: dict[str, Any]) -> str | None:
    value = body.get("session_id")
    return None if value is None else validate_session_id(value)


def parse_chat(body: Any) -> ChatParams:
    """Validate a `/v1/chat/completions` body."""
    if not isinstance(body, dict):
        raise invalid_value("the request body must be a JSON object")
    check_nesting(body)
    _reject_unsupported(body)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    forced = () if choice in (("auto",), ("none",)) else choice
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise invalid_value("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return ChatParams(
        model=_model(body),
        messages=normalize_messages(body.get("messages")),
        sampling=with_logprobs(sampling_params(body, None), body, chat=True),
        stream=_bool(body, "stream"),
        include_usage=_include_usage(body),
        tools=tools,
        parse_tools=tools is not None and choice != ("none",),
        template_kwargs=dict(kwargs),
        session_id=_body_session(body),
        forced_tools=forced,
    )


def parse_completion(body: Any) -> CompletionParams:
    """Validate a `/v1/completions` body (a prompt string or a list of token ids)."""
    if not isinstance(body, dict):
        raise invalid_value("the request body must be a JSON object")
    check_nesting(body)
    _reject_unsupported(body)
    if body.get("echo"):
        raise unsupported("'echo' is not supported", "echo")
    if body.get("suffix"):
        raise unsupported("'suffix' is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise unsupported("'best_of' other than 1 is not supported", "best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt
        ):
            if prompt and all(isinstance(p, str) for p in prompt):
                raise unsupported("a batch of several prompts is not supported", "prompt")
            raise invalid_value("'prompt' must be a string or a list of token ids", "prompt")
    elif not isinstance(prompt, str):
        raise invalid_value("'prompt' must be a string or a list of token ids", "prompt")
    return CompletionParams(
        model=_model(body),
        prompt=prompt,
        sampling=with_logprobs(sampling_params(body, 16), body, chat=False),
        stream=_bool(body, "stream"),
        include_usage=_include_usage(body),
        session_id=_body_session(body),
    )


def check_model(requested: str | None, served: str) -> None:
    """404 `model_not_found` unless `requested` is absent or the served model id."""
    if requested is not None and requested != served:
        raise APIError(
            404,
            "model_not_found",
            f"The model '{requested}' does not exist; this server serves '{served}'",
            param="model",
        )
