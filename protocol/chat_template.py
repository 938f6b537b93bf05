"""Chat templates: one sandboxed renderer for every path that turns chat `messages` into a
prompt, the worker's `messages` (worker/engine/prompt.py) and `tokenpipe serve`
(supervisor/openai/), so the same messages and tools give the same prompt on both.

The environment matches what `transformers.apply_chat_template` gives a template, so the
same template and messages render the same text: `ImmutableSandboxedEnvironment` with
`trim_blocks`, `lstrip_blocks` and the `loopcontrols` extension; `raise_exception`,
`strftime_now`, `namespace`, a `tojson` filter that does not escape HTML; the variables
`messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`, `eos_token` and the
request's `chat_template_kwargs` (e.g. `enable_thinking`).

Messages go through `normalize_messages` first (text parts joined, `developer` as `system`,
tool-call arguments parsed to objects), the form Hugging Face templates expect. A model
without a template gets a built-in one for its family (`builtin_template`).

Pure Python (jinja2, no torch): the supervisor imports it too.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)


class ChatTemplateError(ValueError):
    """The messages could not be rendered: the template raised, or does not compile."""


class RenderBudgetExceeded(Exception):
    """The render ran past the deadline set with `render_deadline` (checked at each call,
    item and attribute access the template makes, so a runaway loop stops too)."""


class RenderTooLong(Exception):
    """The rendered text passed the length the caller allows (`max_chars`)."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(f"the rendered prompt exceeds {max_chars} characters")
        self.max_chars = max_chars


_deadline = threading.local()


def render_deadline(deadline: float | None) -> None:
    """Set (or clear, with None) this thread's render deadline, in `time.monotonic()` s."""
    _deadline.at = deadline


def check_deadline() -> None:
    """`RenderBudgetExceeded` when this thread is past its render deadline."""
    at = getattr(_deadline, "at", None)
    if at is not None and time.monotonic() > at:
        raise RenderBudgetExceeded()


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, checking this thread's deadline wherever the template does work."""

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getitem(self, obj: Any, argument: Any) -> Any:
        check_deadline()
        return super().getitem(obj, argument)

    def getattr(self, obj: Any, attribute: str) -> Any:
        check_deadline()
        return super().getattr(obj, attribute)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no reaching into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template; raises `ChatTemplateError` when it does not parse."""
    env = _BudgetedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """Templates read a turn's reasoning as `reasoning_content` (some as `thinking`)."""
    for key in ("reasoning_content", "thinking", "reasoning"):
        if message.get(key) is not None:
            value = message[key]
            return {"thinking": value, **message, "reasoning_content": value}
    return message


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template bound to the model's special tokens.

    `strip_bos`: the worker prepends the BOS prefix itself, so a literal `bos_token` at the
    start of the rendered text is removed (it would otherwise be fed twice).
    """

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    strip_bos: bool = True

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        max_chars: int | None = None,
    ) -> str:
        """The prompt text for `messages` (already normalized, see `params.py`)."""
        return strip_leading_bos(
            self.render_raw(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                template_kwargs=template_kwargs,
                max_chars=max_chars,
            ),
            self.bos_token if self.strip_bos else None,
        )

    def render_raw(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        max_chars: int | None = None,
    ) -> str:
        """The text exactly as the template renders it (BOS included); `RenderTooLong` as
        soon as it passes `max_chars` (the render stops there)."""
        extra = dict(template_kwargs or {})
        clash = RESERVED_TEMPLATE_VARIABLES & extra.keys()
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(clash)}")
        variables: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **extra,
        }
        template = compile_template(self.source)
        try:
            pieces = template.generate(
                messages=[_alias_reasoning(m) for m in messages],
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
            out: list[str] = []
            length = 0
            for piece in pieces:
                out.append(piece)
                length += len(piece)
                if max_chars is not None and length > max_chars:
                    raise RenderTooLong(max_chars)
            return "".join(out)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except RecursionError as exc:  # a recursive macro, or tojson on deep data
            raise ChatTemplateError(
                "the chat template recursed too deeply on these messages"
            ) from exc
        except (
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
            OverflowError,
        ) as exc:  # OverflowError: the sandbox refuses huge ranges
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc


def strip_leading_bos(text: str, bos_token: str | None) -> str:
    """`text` without one leading literal `bos_token` (the worker adds BOS as an id)."""
    if bos_token and text.startswith(bos_token):
        return text[len(bos_token) :]
    return text


# ----------------------------------------------------------------------------- messages


class MessageError(ValueError):
    """A message the renderer cannot take (content that is not text, a malformed tool call);
    `param` names the request field, when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def content_text(content: Any, where: str) -> str:
    """A message's content as one string: text parts joined with newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MessageError(f"{where}: only text content parts are supported, got {kind}")
            text = part.get("text")
            if not isinstance(text, str):
                raise MessageError(f"{where}: a text part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise MessageError(f"{where}: content must be a string or a list of content parts")


MAX_ARGUMENT_NESTING = 64
"""Deepest nesting of a tool call's parsed arguments (`tojson` on deeper data would recurse
toward Python's limit)."""


def _too_deep(where: str) -> str:
    return f"{where}: tool call arguments are nested more than {MAX_ARGUMENT_NESTING} levels deep"


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and objects deeper than `limit` (iterative)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Any
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls -> `{id, type, function: {name, arguments}}` with the arguments
    parsed (JSON text that does not parse stays text; blank arguments are `{}`)."""
    if not isinstance(value, list):
        raise MessageError(f"{where}: tool_calls must be a list")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise MessageError(f"{where}: each tool call needs a function with a name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # templates get the raw text
            except RecursionError:
                raise MessageError(_too_deep(where), "messages") from None
            if _depth_exceeds(arguments, MAX_ARGUMENT_NESTING):
                raise MessageError(_too_deep(where), "messages")
        calls.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


_NORMALIZED_KEYS = frozenset(
    {"role", "content", "tool_calls", "reasoning_content", "reasoning", "tool_call_id", "name"}
)


def normalize_message(message: Any, where: str) -> dict[str, Any]:
    """One message in the form templates read: `role` (`developer` as `system`), `content`
    as one string; for the assistant, `tool_calls` with parsed arguments and
    `reasoning_content` (from `reasoning` too); `tool_call_id` of a tool result; `name`.
    Any other key is kept as it is unless it is None. Raises `MessageError`."""
    if not isinstance(message, dict):
        raise MessageError(f"{where} must be an object", "messages")
    role = message.get("role")
    if not isinstance(role, str):
        raise MessageError(f"{where}: role must be a string", "messages")
    normalized: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": content_text(message.get("content"), where),
    }
    for key, value in message.items():
        if value is not None and key not in _NORMALIZED_KEYS:
            normalized[key] = value
    if role == "assistant":
        if message.get("tool_calls"):
            normalized["tool_calls"] = _tool_calls(message["tool_calls"], where)
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if isinstance(reasoning, str) and reasoning:
            normalized["reasoning_content"] = reasoning
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        normalized["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        normalized["name"] = message["name"]
    return normalized


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages -> the plain dicts a chat template reads (`normalize_message` each)."""
    if not isinstance(messages, list) or not messages:
        raise MessageError("'messages' must be a non-empty list", "messages")
    return [normalize_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


# ------------------------------------------------------------------------ built-in templates

# Gemma 3 style turns; system text folds into the next user turn; tools and tool results use
# the Hermes `<tool_call>` JSON convention (Gemma 3 has no native tool format). Linear in the
# messages and tools: each system message is written once, at the user turn that follows it
# (never accumulated by repeated concatenation).
GEMMA_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(tools=tools, start=0) -%}
{%- for message in messages -%}
{%- set content = message['content'] if message['content'] is string else '' -%}
{%- if message['role'] in ['system', 'developer'] -%}
{%- elif message['role'] == 'assistant' -%}
{{ '<start_of_turn>model\\n' + content | trim }}
{%- for call in message.get('tool_calls') or [] -%}
{%- set fn = call['function'] if call['function'] is defined else call -%}
{{ '<tool_call>' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) + '</tool_call>' }}
{%- endfor -%}
{{ '<end_of_turn>\\n' }}
{%- elif message['role'] == 'tool' -%}
{{ '<start_of_turn>user\\n<tool_response>\\n' + content + '\\n</tool_response><end_of_turn>\\n' }}
{%- else -%}
{{ '<start_of_turn>user\\n' }}
{%- if ns.tools -%}
{{ 'You may call these tools. To call one, answer with '
  + '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>.\\n<tools>\\n'
  + (ns.tools | map('tojson') | join('\\n')) + '\\n</tools>\\n\\n' }}
{%- set ns.tools = none -%}
{%- endif -%}
{%- for earlier in messages[ns.start:loop.index0] -%}
{%- if earlier['role'] in ['system', 'developer'] -%}
{{ (earlier['content'] if earlier['content'] is string else '') + '\\n\\n' }}
{%- endif -%}
{%- endfor -%}
{%- set ns.start = loop.index -%}
{{ content | trim + '<end_of_turn>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
"""

# Gemma 4 turns (`<|turn>role ... <turn|>`); a checkpoint's own template replaces this.
GEMMA4_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
{%- set content = message['content'] if message['content'] is string else '' -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{%- set role = 'system' if role == 'developer' else role -%}
{{ '<|turn>' + role + '\\n' + content | trim + '<turn|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}
"""

# ChatML with Hermes tools (Qwen 2.5 style).
CHATML_TEMPLATE = """
{%- if tools -%}
{{ '<|im_start|>system\\n' }}
{%- if messages and messages[0]['role'] == 'system' -%}{{ messages[0]['content'] + '\\n\\n' }}
{%- endif -%}
{{ '# Tools\\n\\nYou may call one or more functions.\\n<tools>' }}
{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}
{{ '\\n</tools>\\n\\nFor each call return <tool_call>{"name": NAME, "arguments": ARGS}'
   + '</tool_call>.<|im_end|>\\n' }}
{%- endif -%}
{%- for message in messages -%}
{%- set content = message['content'] if message['content'] is string else '' -%}
{%- if message['role'] == 'system' and tools and loop.first -%}
{%- elif message['role'] == 'tool' -%}
{{ '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
{%- else -%}
{{ '<|im_start|>' + message['role'] + '\\n' + content }}
{%- for call in message.get('tool_calls') or [] -%}
{%- set fn = call['function'] if call['function'] is defined else call -%}
{{ '\\n<tool_call>\\n' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson)
   + '\\n</tool_call>' }}
{%- endfor -%}
{{ '<|im_end|>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""

LLAMA3_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
{%- set content = message['content'] if message['content'] is string else '' -%}
{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] -%}
{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + content | trim + '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif -%}
"""


def model_family(architecture: str | None) -> str:
    """A family key (`gemma4`, `gemma`, `qwen3_5`, `qwen`, `llama`, `other`) from the
    architecture name the worker reports (`Gemma3ForCausalLM`, `gemma3`, ...)."""
    name = (architecture or "").lower()
    if "gemma4" in name:
        return "gemma4"
    if "gemma" in name:
        return "gemma"
    if "qwen3_5" in name or "qwen3.5" in name or "qwen3next" in name:
        return "qwen3_5"
    if "qwen" in name or "smollm" in name:
        return "qwen"
    if "llama" in name or "mistral" in name:
        return "llama"
    return "other"


def builtin_template(family: str) -> str:
    """The template used when the model ships none."""
    return {
        "gemma": GEMMA_TEMPLATE,
        "gemma4": GEMMA4_TEMPLATE,
        "qwen": CHATML_TEMPLATE,
        "qwen3_5": CHATML_TEMPLATE,
        "llama": LLAMA3_TEMPLATE,
    }.get(family, GEMMA_TEMPLATE)
