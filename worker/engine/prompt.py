"""The prompt of a generate: text, segments, or chat `messages` rendered with the model's
chat template in a jinja2 sandbox, turned into the token ids the engine feeds.

The template sees `messages`, `bos_token`, `eos_token`, `add_generation_prompt`, `tools`
and any extra `chat_template_kwargs`; `raise_exception(msg)` and the `tojson` filter are
available as in Hugging Face templates. A model without a template gets the built-in Gemma
one (a system message is folded into the first user turn, as Gemma's own template does).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from protocol import ErrorCode, GenerateRequest, IdsSegment, TextSegment

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + message['content'] + '\\n\\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ ns.system }}{{ message['content'] | trim }}<end_of_turn>\n"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The messages could not be rendered (the template raised or is broken)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def render_chat(
    messages: list[dict[str, Any]],
    template: str | None,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """The prompt text for `messages`; raises `ChatTemplateError`."""
    source = template if template else GEMMA_TEMPLATE
    variables: dict[str, Any] = dict(extra or {})
    variables.update(
        messages=messages,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
        add_generation_prompt=add_generation_prompt,
        tools=tools,
    )
    try:
        return str(_compile(source).render(**variables))
    except Exception as exc:  # any template failure is the request's problem, not ours
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


class PromptError(ValueError):
    """A prompt the engine refuses; `code` is the protocol error code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def build_prompt(
    req: GenerateRequest,
    tokenizer: Any,
    prefix_ids: list[int],
    vocab_size: int,
    max_context: int,
) -> list[int]:
    """The token ids a generate request feeds: prefix (unless `add_prefix` is false), then
    its `prompt`, `prompt_segments` or rendered `messages`. Raises `PromptError`."""
    body: list[int] = []
    if req.prompt is not None:
        body = tokenizer.encode(req.prompt)
    elif req.prompt_segments is not None:
        for segment in req.prompt_segments:
            if isinstance(segment, IdsSegment):
                body.extend(segment.ids)
            elif isinstance(segment, TextSegment):
                body.extend(tokenizer.encode(segment.text))
    elif req.messages is not None:
        try:
            text = render_chat(
                req.messages,
                tokenizer.chat_template,
                bos_token=tokenizer.bos_token,
                eos_token=tokenizer.eos_token,
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tools,
                extra=req.chat_template_kwargs,
            )
        except ChatTemplateError as exc:
            raise PromptError(str(exc), ErrorCode.TEMPLATE_ERROR) from exc
        bos = tokenizer.bos_token
        if req.add_prefix and prefix_ids and bos and text.startswith(bos):
            text = text[len(bos) :]  # the prefix ids already carry BOS
        body = tokenizer.encode(text)
    if not body:
        raise PromptError("the prompt encodes to zero tokens", ErrorCode.EMPTY_PROMPT)
    ids = (list(prefix_ids) + body) if req.add_prefix else body
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise PromptError(
                f"token id {token_id} is not below the vocabulary size {vocab_size}",
                ErrorCode.INVALID_TOKEN_ID,
            )
    needed = len(ids) + (1 if req.max_new_tokens != 0 else 0)
    if needed > max_context:
        raise PromptError(
            f"the prompt has {len(ids)} tokens and the context holds {max_context} "
            f"(at least one more is needed to generate)"
            if req.max_new_tokens != 0
            else f"the prompt has {len(ids)} tokens and the context holds {max_context}",
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        )
    return ids
