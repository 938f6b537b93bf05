"""Prompt assembly and chat rendering (worker/engine/prompt.py), with a byte-level fake
tokenizer."""

from __future__ import annotations

import pytest

from protocol import GenerateRequest, IdsSegment, TextSegment
from worker.engine.prompt import PromptError, build_prompt, render_chat


class ByteTokenizer:
    chat_template: str | None = None
    bos_token = "<bos>"
    eos_token = "<eos>"

    def encode(self, text: str) -> list[int]:
        if text.startswith("<bos>"):
            return [1] + [b + 3 for b in text[5:].encode()]
        return [b + 3 for b in text.encode()]


def build(req: GenerateRequest, tok: ByteTokenizer | None = None, ctx: int = 1000) -> list[int]:
    return build_prompt(req, tok or ByteTokenizer(), [1], 300, ctx)


def test_prefix_once_and_add_prefix_false() -> None:
    assert build(GenerateRequest(prompt="ab")) == [1, 100, 101]
    assert build(GenerateRequest(prompt="ab", add_prefix=False)) == [100, 101]
    segments = [TextSegment("a"), IdsSegment([7, 8]), TextSegment("b")]
    assert build(GenerateRequest(prompt_segments=segments)) == [1, 100, 7, 8, 101]


def test_prompt_errors_have_codes() -> None:
    with pytest.raises(PromptError) as empty:
        build(GenerateRequest(prompt=""))
    assert empty.value.code == "empty_prompt"
    with pytest.raises(PromptError) as bad:
        build(GenerateRequest(prompt_segments=[IdsSegment([300])]))
    assert bad.value.code == "invalid_token_id"
    with pytest.raises(PromptError) as long:
        build(GenerateRequest(prompt="abcd"), ctx=5)
    assert long.value.code == "context_length_exceeded" and "5" in str(long.value)
    # exactly full is fine when nothing is generated
    assert len(build(GenerateRequest(prompt="abcd", max_new_tokens=0), ctx=5)) == 5


def test_messages_builtin_gemma_template_bos_not_doubled() -> None:
    req = GenerateRequest(messages=[{"role": "user", "content": "hi"}])
    ids = build(req)
    assert ids[0] == 1 and ids.count(1) == 1
    text = bytes(i - 3 for i in ids[1:]).decode()
    assert text == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_render_system_assistant_and_no_generation_prompt() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    text = render_chat(messages, None, bos_token="<bos>", add_generation_prompt=False)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nQ<end_of_turn>\n"
        "<start_of_turn>model\nA<end_of_turn>\n"
    )


def test_custom_template_sandbox_tools_and_errors() -> None:
    template = (
        "{{ bos_token }}{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    text = render_chat(
        [{"role": "user", "content": "x"}], template, bos_token="<s>", tools=[{"name": "f"}]
    )
    assert text == '<s>[{"name": "f"}]x'
    tok = ByteTokenizer()
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(PromptError) as err:
        build(GenerateRequest(messages=[{"role": "user", "content": "x"}]), tok)
    assert err.value.code == "template_error" and "no system role" in str(err.value)
    tok.chat_template = "{{ ''.__class__.__mro__ }}"  # the sandbox refuses attribute escapes
    with pytest.raises(PromptError):
        build(GenerateRequest(messages=[{"role": "user", "content": "x"}]), tok)
