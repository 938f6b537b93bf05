"""Tool-call and thinking markup in generated text (pure: no I/O, no torch).

One incremental engine, `OutputParser`, turns the generated text into `Piece`s: content,
reasoning (the thinking channel) and complete tool calls. Non-streaming responses feed the
whole text at once through the same engine, so streaming and non-streaming always agree.

Formats (`FORMATS`):
- `gemma4`: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, strings delimited by
  `<|"|>`; thinking in `<|channel>thought\\n...<channel|>`.
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `qwen`: `<function=NAME><parameter=K>V</parameter></function>`, possibly inside
  `<tool_call>...</tool_call>` (Qwen3-Coder, Qwen 3.5).

Invariants: text that could begin a marker is held back until it is known not to; a call
whose markup is malformed, unfinished at the end, or names a tool the request did not
offer comes out as content, verbatim; nothing here raises on model output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class ToolCall:
    """A complete call: `arguments` is a JSON object serialized as a string."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Piece:
    """One output item: content text, reasoning text, or a tool call."""

    kind: Literal["content", "reasoning", "tool_call"]
    text: str = ""
    call: ToolCall | None = None


ToolSchemas = dict[str, dict[str, Any]]
"""tool name -> its JSON-schema `parameters` (may be {})."""

BodyParser = Callable[[str, ToolSchemas], list[ToolCall] | None]
"""(markup from start marker through end marker, tools) -> calls, or None if malformed."""


# ----------------------------------------------------------------------------- gemma 4 body

GEMMA4_STRING = '<|"|>'


class _Gemma4Reader:
    """Recursive-descent reader of Gemma 4's argument syntax: `{key:value,...}` where a
    value is `<|"|>text<|"|>`, a number, true/false/null, `{...}` or `[...]`."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
            self.pos += 1

    def expect(self, char: str) -> None:
        self.skip_space()
        if not self.text.startswith(char, self.pos):
            raise ValueError(f"expected {char!r} at {self.pos}")
        self.pos += len(char)

    def value(self) -> Any:
        self.skip_space()
        text, pos = self.text, self.pos
        if text.startswith(GEMMA4_STRING, pos):
            end = text.find(GEMMA4_STRING, pos + len(GEMMA4_STRING))
            if end < 0:
                raise ValueError("unterminated string")
            self.pos = end + len(GEMMA4_STRING)
            return text[pos + len(GEMMA4_STRING) : end]
        if text.startswith("{", pos):
            return self.object()
        if text.startswith("[", pos):
            return self.array()
        match = re.compile(r"[^,\}\]]*").match(text, pos)
        raw = match.group(0).strip() if match else ""
        self.pos = match.end() if match else pos
        if raw in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[raw]
        try:
            number = json.loads(raw)
        except ValueError:
            number = None
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return number
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            return json.loads(raw)
        if not raw:
            raise ValueError(f"empty value at {pos}")
        return raw  # a bare word: keep it as a string rather than fail the whole call

    def object(self) -> dict[str, Any]:
        self.expect("{")
        result: dict[str, Any] = {}
        self.skip_space()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return result
        while True:
            self.skip_space()
            if self.text.startswith(GEMMA4_STRING, self.pos):
                key = self.value()
            else:
                match = re.compile(r"[A-Za-z0-9_\-\.]+").match(self.text, self.pos)
                if not match:
                    raise ValueError(f"expected a key at {self.pos}")
                key = match.group(0)
                self.pos = match.end()
            self.expect(":")
            result[str(key)] = self.value()
            self.skip_space()
            if self.text.startswith(",", self.pos):
                self.pos += 1
                continue
            self.expect("}")
            return result

    def array(self) -> list[Any]:
        self.expect("[")
        items: list[Any] = []
        self.skip_space()
        if self.text.startswith("]", self.pos):
            self.pos += 1
            return items
        while True:
            items.append(self.value())
            self.skip_space()
            if self.text.startswith(",", self.pos):
                self.pos += 1
                continue
            self.expect("]")
            return items


_GEMMA4_CALL = re.compile(
    r"<\|tool_call>\s*call:([A-Za-z0-9_\-\.]+)\s*(\{.*\})\s*<tool_call\|>\Z", re.S
)


def parse_gemma4_call(markup: str, tools: ToolSchemas) -> list[ToolCall] | None:
    match = _GEMMA4_CALL.match(markup)
    if not match:
        return None
    reader = _Gemma4Reader(match.group(2))
    try:
        arguments = reader.object()
        reader.skip_space()
        if reader.pos != len(reader.text):
            return None
    except (ValueError, RecursionError):
        return None
    return [ToolCall(match.group(1), json.dumps(arguments, ensure_ascii=False))]


# ------------------------------------------------------------------------------ hermes body


def parse_hermes_call(markup: str, tools: ToolSchemas) -> list[ToolCall] | None:
    body = markup.removeprefix("<tool_call>").removesuffix("</tool_call>").strip()
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return [ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))]


# -------------------------------------------------------------------------------- qwen body

_QWEN_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _qwen_value(raw: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as the JSON type its schema asks for (text when unsure)."""
    value = raw.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in ("integer", "number", "boolean", "object", "array", "null"):
        try:
            return json.loads(value.strip())
        except ValueError:
            return value
    return value


def parse_qwen_call(markup: str, tools: ToolSchemas) -> list[ToolCall] | None:
    body = markup
    if body.startswith("<tool_call>"):
        body = body.removeprefix("<tool_call>").removesuffix("</tool_call>")
    calls: list[ToolCall] = []
    position = 0
    for function in _QWEN_FUNCTION.finditer(body):
        if body[position : function.start()].strip():
            return None  # stray text between functions: not a clean call
        position = function.end()
        name = function.group(1).strip()
        properties = tools.get(name, {}).get("properties", {})
        arguments: dict[str, Any] = {}
        rest = _QWEN_PARAMETER.sub("", function.group(2))
        if rest.strip():
            return None
        for parameter in _QWEN_PARAMETER.finditer(function.group(2)):
            key = parameter.group(1).strip()
            arguments[key] = _qwen_value(parameter.group(2), properties.get(key, {}))
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    if not calls or body[position:].strip():
        return None
    return calls


# ---------------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call markup: (start marker, end marker) pairs and the body parser; `inner`:
    markup inside a call that a tokenizer may write as one special token (put back into the
    text like the markers, `state.event_text`)."""

    name: str
    markers: tuple[tuple[str, str], ...]
    parse: BodyParser
    inner: tuple[str, ...] = ()


FORMATS: dict[str, ToolFormat] = {
    "gemma4": ToolFormat(
        "gemma4", (("<|tool_call>", "<tool_call|>"),), parse_gemma4_call, (GEMMA4_STRING,)
    ),
    "hermes": ToolFormat("hermes", (("<tool_call>", "</tool_call>"),), parse_hermes_call),
    "qwen": ToolFormat(
        "qwen", (("<tool_call>", "</tool_call>"), ("<function=", "</function>")), parse_qwen_call
    ),
}

# Thinking-channel markup per family: (start, end, channel-name prefix to drop).
REASONING_MARKERS: dict[str, tuple[str, str, str]] = {
    "gemma4": ("<|channel>", "<channel|>", "thought\n"),
}


def default_tool_format(family: str) -> str:
    """The tool-call format a model family speaks."""
    return {"gemma4": "gemma4", "qwen3_5": "qwen"}.get(family, "hermes")


def tool_schemas(tools: Sequence[dict[str, Any]] | None) -> ToolSchemas:
    """name -> parameters schema, from OpenAI `tools` entries."""
    schemas: ToolSchemas = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return schemas


def _held_prefix_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


# ----------------------------------------------------------------------------------- engine


@dataclass
class OutputParser:
    """Incremental parser of one completion. `feed(text)` then `finish()`; both return the
    pieces that are now certain. Calls are extracted only for the tools in `tools`; with
    `tool_format` None (no tools, or tool_choice "none") only reasoning is split off.

    Whitespace-only content next to a tool call is dropped, so the content of a turn made of
    calls is empty whichever way the text was cut into deltas.
    """

    tool_format: ToolFormat | None = None
    tools: ToolSchemas = field(default_factory=dict)
    reasoning: tuple[str, str, str] | None = None
    max_call_chars: int = 1 << 20

    _buffer: str = ""
    _mode: Literal["text", "call", "reasoning"] = "text"
    _end_marker: str = ""
    _reasoning_started: bool = False
    _pending_space: str = ""
    _calls_seen: int = 0
    _after_call: bool = False

    def _starts(self) -> list[tuple[str, str, str]]:
        """(start, end, mode) for every marker that opens a region."""
        starts = []
        if self.tool_format is not None:
            starts += [(start, end, "call") for start, end in self.tool_format.markers]
        if self.reasoning is not None:
            starts.append((self.reasoning[0], self.reasoning[1], "reasoning"))
        return starts

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while True:
            if self._mode == "text":
                if not self._scan_text(out):
                    break
            elif self._mode == "call":
                if not self._scan_call(out):
                    break
            elif not self._scan_reasoning(out):
                break
        return out

    def finish(self) -> list[Piece]:
        """Release everything held: an unfinished call comes out as content."""
        out: list[Piece] = []
        rest, self._buffer = self._buffer, ""
        if self._mode == "reasoning":
            self._emit_reasoning(rest, out)
        elif rest:
            self._emit_content(rest, out)
        self._mode = "text"
        if self._pending_space:
            out.append(Piece("content", self._pending_space))
        self._pending_space = ""
        return out

    # -- modes

    def _scan_text(self, out: list[Piece]) -> bool:
        best: tuple[int, str, str, str] | None = None
        for start, end, mode in self._starts():
            index = self._buffer.find(start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, start, end, mode)
        if best is None:
            held = _held_prefix_len(self._buffer, [s for s, _, _ in self._starts()])
            cut = len(self._buffer) - held
            self._emit_content(self._buffer[:cut], out)
            self._buffer = self._buffer[cut:]
            return False
        index, start, end, mode = best
        self._emit_content(self._buffer[:index], out)
        self._end_marker = end
        if mode == "call":
            self._buffer = self._buffer[index:]  # the body parser sees the whole markup
            self._mode = "call"
        else:
            self._buffer = self._buffer[index + len(start) :]
            self._mode = "reasoning"
            self._reasoning_started = False
        return True

    def _scan_call(self, out: list[Piece]) -> bool:
        end = self._buffer.find(self._end_marker)
        if end < 0:
            if len(self._buffer) > self.max_call_chars:
                self._mode = "text"
                self._emit_content(self._buffer, out)
                self._buffer = ""
                return True
            return False
        markup = self._buffer[: end + len(self._end_marker)]
        self._buffer = self._buffer[end + len(self._end_marker) :]
        self._mode = "text"
        calls = self._parse(markup)
        if calls is None:
            self._emit_content(markup, out)
        else:
            self._pending_space = ""
            self._after_call = True
            self._calls_seen += len(calls)
            out.extend(Piece("tool_call", call=call) for call in calls)
        return True

    def _scan_reasoning(self, out: list[Piece]) -> bool:
        end = self._buffer.find(self._end_marker)
        if end >= 0:
            self._emit_reasoning(self._buffer[:end], out)
            self._buffer = self._buffer[end + len(self._end_marker) :]
            self._mode = "text"
            return True
        held = _held_prefix_len(self._buffer, [self._end_marker])
        # The channel name ("thought\n") is dropped once, so hold until it is decided.
        assert self.reasoning is not None
        prefix = self.reasoning[2]
        if not self._reasoning_started and prefix.startswith(self._buffer):
            return False
        cut = len(self._buffer) - held
        self._emit_reasoning(self._buffer[:cut], out)
        self._buffer = self._buffer[cut:]
        return False

    # -- emitting

    def _parse(self, markup: str) -> list[ToolCall] | None:
        assert self.tool_format is not None
        try:
            calls = self.tool_format.parse(markup, self.tools)
        except Exception:  # a parser bug must never turn model output into a 500
            return None
        if not calls or any(call.name not in self.tools for call in calls):
            return None
        return calls

    def _emit_content(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self.tool_format is None:
            out.append(Piece("content", text))
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        full = self._pending_space + text
        stripped = full.rstrip()
        self._pending_space = full[len(stripped) :]
        if stripped:
            out.append(Piece("content", stripped))

    def _emit_reasoning(self, text: str, out: list[Piece]) -> None:
        if not self._reasoning_started:
            assert self.reasoning is not None
            text = text.removeprefix(self.reasoning[2])
            self._reasoning_started = True
        if text:
            out.append(Piece("reasoning", text))
