"""Our sandboxed rendering == transformers' `apply_chat_template` on the same template and
messages (tools included), with a tokenizer built from the default model's tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor.openai.params import normalize_messages
from supervisor.openai.templates import (
    CHATML_TEMPLATE,
    GEMMA4_TEMPLATE,
    GEMMA_TEMPLATE,
    LLAMA3_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    builtin_template,
    model_family,
    strip_leading_bos,
)

HERE = Path(__file__).parent / "templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «quoted» & <escaped>?",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

ALTERNATING = [
    {"role": "system", "content": "You are terse. Ünïcødé ✓"},
    {"role": "user", "content": "  Hello there  "},
    {"role": "assistant", "content": "Hi! <b>bold</b>"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}],
    },
]

WITH_TOOLS = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {"role": "assistant", "content": "Sunny in Paris.", "reasoning_content": "easy"},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir: Path) -> Any:
    """transformers' tokenizer from the default model's tokenizer.json (the worker's GGUF
    conversion of the default model)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(default_model_dir / "tokenizer.json"),
        bos_token="<bos>",
        eos_token="<eos>",
    )


def hf_render(tokenizer: Any, source: str, messages: list[dict], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)


def ours(tokenizer: Any, source: str) -> ChatTemplate:
    return ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)


CASES = [
    ("gemma3_it", ALTERNATING, None, {}),
    ("gemma3_it", ALTERNATING[:3], None, {}),
    ("qwen2_5_tools", WITH_TOOLS, TOOLS, {}),
    ("qwen2_5_tools", WITH_TOOLS[1:2], None, {}),
    ("helpers", WITH_TOOLS, TOOLS, {"enable_thinking": False}),
    ("builtin_gemma", WITH_TOOLS, TOOLS, {}),
    ("builtin_gemma", ALTERNATING, None, {}),
    ("builtin_chatml", WITH_TOOLS, TOOLS, {}),
    ("builtin_llama3", WITH_TOOLS, None, {}),
    ("builtin_gemma4", ALTERNATING, None, {}),
]
BUILTINS = {
    "builtin_gemma": GEMMA_TEMPLATE,
    "builtin_chatml": CHATML_TEMPLATE,
    "builtin_llama3": LLAMA3_TEMPLATE,
    "builtin_gemma4": GEMMA4_TEMPLATE,
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(("name", "messages", "tools", "kwargs"), CASES)
def test_rendering_matches_transformers(
    hf_tokenizer: Any,
    name: str,
    messages: list[dict],
    tools: list | None,
    kwargs: dict,
    add_generation_prompt: bool,
) -> None:
    source = BUILTINS.get(name) or (HERE / f"{name}.jinja").read_text()
    normalized = normalize_messages(messages)  # what the server hands the template
    expected = hf_render(
        hf_tokenizer,
        source,
        normalized,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    rendered = ours(hf_tokenizer, source).render_raw(
        normalized,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        template_kwargs=kwargs,
    )
    assert rendered == expected
    assert len(rendered) > 20


def test_bos_is_stripped_once_and_counted_once(hf_tokenizer: Any) -> None:
    source = (HERE / "gemma3_it.jinja").read_text()
    template = ours(hf_tokenizer, source)
    raw = template.render_raw(normalize_messages(ALTERNATING))
    text = template.render(normalize_messages(ALTERNATING))
    assert raw.startswith("<bos>") and raw == "<bos>" + text
    # The worker prepends BOS as an id: the tokenized prompt holds exactly one BOS.
    ids = [hf_tokenizer.bos_token_id] + hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(hf_tokenizer.bos_token_id) == 1
    assert ids == hf_tokenizer.encode(raw, add_special_tokens=False)
    assert strip_leading_bos("x<bos>", "<bos>") == "x<bos>"
    keep = ChatTemplate(source, "<bos>", "<eos>", strip_bos=False)
    assert keep.render(normalize_messages(ALTERNATING)) == raw


def test_template_errors_are_reported(hf_tokenizer: Any) -> None:
    template = ours(hf_tokenizer, (HERE / "gemma3_it.jinja").read_text())
    with pytest.raises(ChatTemplateError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}").render([])
    with pytest.raises(ChatTemplateError, match="may not set"):
        template.render(normalize_messages(ALTERNATING), template_kwargs={"messages": []})


def test_sandbox_blocks_attribute_escapes() -> None:
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])


def test_family_and_builtin_choice() -> None:
    assert model_family("Gemma3ForCausalLM") == "gemma"
    assert model_family("gemma4") == "gemma4"
    assert model_family("Qwen2ForCausalLM") == "qwen"
    assert model_family("LlamaForCausalLM") == "llama"
    assert builtin_template("gemma") is GEMMA_TEMPLATE
    assert builtin_template("unknown") is GEMMA_TEMPLATE
