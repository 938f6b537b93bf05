"""The prompt of a generate: text, segments, or chat `messages` rendered with the model's
chat template, turned into the token ids the engine feeds.

`messages` are rendered by the renderer `tokenpipe serve` uses too
(`protocol/chat_template.py`): the same normalization (text parts joined, `developer` as
`system`, tool-call arguments parsed), sandbox, helpers and built-in template for the model's
family, with the request's `tools` and `chat_template_kwargs`; so a chat sent as JSONL gives
the same prompt ids as the same chat sent to `serve`.
"""

from __future__ import annotations

import time
from typing import Any

from protocol import ErrorCode, GenerateRequest, IdsSegment, TextSegment
from protocol.chat_template import (
    GEMMA_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    MessageError,
    RenderBudgetExceeded,
    builtin_template,
    model_family,
    normalize_messages,
    render_deadline,
    strip_leading_bos,
)

RENDER_BUDGET_S = 5.0
"""How long one render may take: the engine loop renders, so a runaway template must stop."""


def chat_template_for(tokenizer: Any, architecture: str | None) -> ChatTemplate:
    """The model's template, else the built-in one for its family (as `serve` chooses)."""
    source = tokenizer.chat_template or builtin_template(model_family(architecture))
    # The BOS a template writes is dropped in `build_prompt`, only when the prefix adds it.
    return ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token, strip_bos=False)


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
    """The prompt text for `messages` with `template` (None: the built-in Gemma one), BOS
    included as the template writes it; raises `ChatTemplateError` (a `ValueError`)."""
    chat = ChatTemplate(template or GEMMA_TEMPLATE, bos_token, eos_token, strip_bos=False)
    return _render(chat, messages, add_generation_prompt, tools, extra)


def _render(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    extra: dict[str, Any] | None,
) -> str:
    render_deadline(time.monotonic() + RENDER_BUDGET_S)
    try:
        return template.render_raw(
            normalize_messages(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=extra,
        )
    except MessageError as exc:
        raise ChatTemplateError(f"chat template input: {exc}") from exc
    except RenderBudgetExceeded:
        raise ChatTemplateError(
            f"the chat template took longer than {RENDER_BUDGET_S:g} s on these messages"
        ) from None
    finally:
        render_deadline(None)


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
    template: ChatTemplate | None = None,
) -> list[int]:
    """The token ids a generate request feeds: prefix (unless `add_prefix` is false), then
    its `prompt`, `prompt_segments` or rendered `messages` (with `template`, by default the
    tokenizer's or the built-in Gemma one). Raises `PromptError`."""
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
        chat = template or chat_template_for(tokenizer, None)
        try:
            text = _render(
                chat,
                req.messages,
                req.add_generation_prompt,
                req.tools,
                req.chat_template_kwargs,
            )
        except ChatTemplateError as exc:
            raise PromptError(str(exc), ErrorCode.TEMPLATE_ERROR) from exc
        if req.add_prefix and prefix_ids:
            text = strip_leading_bos(text, tokenizer.bos_token)  # the prefix ids carry BOS
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
