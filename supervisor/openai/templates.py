"""Chat templates for `serve`: the shared renderer in `protocol/chat_template.py`, the one the
worker renders `messages` with too (same sandbox, helpers, built-in templates and message
normalization), so the same request gives the same prompt over HTTP and over JSONL."""

from protocol.chat_template import (
    CHATML_TEMPLATE,
    GEMMA4_TEMPLATE,
    GEMMA_TEMPLATE,
    LLAMA3_TEMPLATE,
    RESERVED_TEMPLATE_VARIABLES,
    ChatTemplate,
    ChatTemplateError,
    RenderBudgetExceeded,
    RenderTooLong,
    builtin_template,
    check_deadline,
    compile_template,
    model_family,
    render_deadline,
    strip_leading_bos,
)

__all__ = [
    "CHATML_TEMPLATE",
    "GEMMA4_TEMPLATE",
    "GEMMA_TEMPLATE",
    "LLAMA3_TEMPLATE",
    "RESERVED_TEMPLATE_VARIABLES",
    "ChatTemplate",
    "ChatTemplateError",
    "RenderBudgetExceeded",
    "RenderTooLong",
    "builtin_template",
    "check_deadline",
    "compile_template",
    "model_family",
    "render_deadline",
    "strip_leading_bos",
]
