"""Request validation, session ids, turn fingerprints and assistant-turn splicing (pure)."""

from __future__ import annotations

import pytest

from supervisor.openai.errors import APIError
from supervisor.openai.params import (
    check_model,
    parse_chat,
    parse_completion,
)
from supervisor.openai.sessions import (
    TurnStore,
    render_prompt,
    session_from_request,
    spliceable_turns,
    turn_fingerprint,
)
from supervisor.openai.templates import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplate

USER = [{"role": "user", "content": "Hi"}]


def error_of(body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat(body)
    return info.value


def test_honoured_parameters() -> None:
    params = parse_chat(
        {
            "model": "m",
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief"}],
                },
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "hmm",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a": 1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 0,
            "max_completion_tokens": 7,
            "stop": "END",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",
            "chat_template_kwargs": {"enable_thinking": False},
            "session_id": "abc",
            "user": "u",
            "store": False,
            "metadata": {"a": "b"},
            "reasoning_effort": "low",
        }
    )
    assert params.messages[0] == {"role": "system", "content": "Be\nbrief"}
    assert params.messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert params.messages[2]["reasoning_content"] == "hmm"
    assert params.messages[3]["tool_call_id"] == "c1"
    s = params.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.max_new_tokens) == (0.5, 0.9, 40, 0.05, 7)
    assert s.seed == 1 and s.stop == ("END",)  # OpenAI seed 0 is a real seed
    assert params.stream and params.include_usage and params.parse_tools
    assert params.template_kwargs == {"enable_thinking": False} and params.session_id == "abc"
    assert (
        parse_chat(
            {
                "messages": USER,
                "tool_choice": "none",
                "tools": [{"type": "function", "function": {"name": "f"}}],
            }
        ).parse_tools
        is False
    )
    assert parse_chat({"messages": USER}).sampling.max_new_tokens == -1


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 2},
        {"logit_bias": {"1": 5}},
        {"presence_penalty": 0.5},
    ],
)
def test_unsupported_parameters(extra: dict) -> None:
    error = error_of({"messages": USER, **extra})
    assert (error.status, error.code) == (400, "unsupported_parameter")


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 3},
        {"temperature": "hot"},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2},
        {"seed": -1},
        {"max_tokens": 0},
        {"stop": [""]},
        {"stop": ["a"] * 17},
        {"messages": []},
        {"messages": [{"role": "bot", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"stream": "yes"},
        {"session_id": ""},
        {"session_id": "é"},
        {"session_id": "x" * 257},
        {"tools": [{"type": "function"}]},
        {"chat_template_kwargs": []},
    ],
)
def test_invalid_values(extra: dict) -> None:
    error = error_of({"messages": USER, **extra})
    assert (error.status, error.code) == (400, "invalid_value")
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_completion_params_and_model_check() -> None:
    assert parse_completion({"prompt": "Hi"}).sampling.max_new_tokens == 16
    assert parse_completion({"prompt": [[2, 3]]}).prompt == [2, 3]
    with pytest.raises(APIError) as info:
        parse_completion({"prompt": "Hi", "echo": True})
    assert info.value.code == "unsupported_parameter"
    with pytest.raises(APIError) as info:
        check_model("gpt-4", "gemma")
    assert (info.value.status, info.value.code) == (404, "model_not_found")
    check_model(None, "gemma")
    check_model("gemma", "gemma")


def test_session_sources_in_order() -> None:
    headers = {"session_id": "h2", "x-tokenpipe-session-id": "h3"}
    assert session_from_request("body", {"x-session-affinity": "h1"}) == "body"
    assert session_from_request(None, {"x-session-affinity": "h1", **headers}) == "h1"
    assert session_from_request(None, headers) == "h2"
    assert session_from_request(None, {}) is None
    with pytest.raises(APIError):
        session_from_request(None, {"session_id": "\x01bad"})


def test_fingerprint_ignores_ids_and_argument_formatting() -> None:
    a = turn_fingerprint(
        None, [{"id": "1", "function": {"name": "f", "arguments": '{"x":1,"y":2}'}}]
    )
    b = turn_fingerprint(
        "", [{"id": "9", "function": {"name": "f", "arguments": {"y": 2, "x": 1}}}]
    )
    c = turn_fingerprint(
        "", [{"id": "9", "function": {"name": "f", "arguments": {"y": 3, "x": 1}}}]
    )
    assert a == b != c
    assert turn_fingerprint("hello", None) != turn_fingerprint("hello!", None)


def test_store_is_bounded() -> None:
    store = TurnStore(max_sessions=2, max_turns=2)
    for i in range(3):
        store.remember("s", f"f{i}", [i])
    assert store.lookup("s", "f0") is None and store.lookup("s", "f2") == (2,)
    store.remember("t", "f", [1])
    store.remember("u", "f", [1])
    assert store.lookup("s", "f2") is None  # least recently used session dropped


def test_splice_replaces_exactly_the_remembered_turn() -> None:
    template = ChatTemplate(GEMMA_TEMPLATE, "<bos>", "<eos>")
    store = TurnStore()
    store.remember("s", turn_fingerprint("Hello there", None), [7, 8, 9])
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Edited by the user"},
        {"role": "user", "content": "Bye"},
    ]
    turns = spliceable_turns(store, "s", messages)
    assert turns == {1: (7, 8, 9)}
    assert spliceable_turns(store, "other", messages) == {}
    rendered = render_prompt(template, messages, tools=None, template_kwargs={}, turn_ids=turns)
    assert rendered.spliced_turns == 1
    plain = template.render(messages)
    segments = rendered.segments
    assert segments[1] == {"ids": [7, 8, 9]}
    # Text around the ids is the plain rendering with the turn's text cut out, BOS stripped.
    assert segments[0]["text"] + "Hello there" + segments[2]["text"] == plain
    assert not plain.startswith("<bos>")


def test_splice_falls_back_to_text_when_the_template_drops_the_turn() -> None:
    # A template that renders only the last two messages drops the spliced assistant turn.
    source = "{% for m in messages[-1:] %}{{ m['content'] }}{% endfor %}"
    template = ChatTemplate(source)
    messages = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    rendered = render_prompt(
        template, messages, tools=None, template_kwargs={}, turn_ids={0: (1, 2)}
    )
    assert rendered.spliced_turns == 0 and rendered.text_only() == "y"


def test_chatml_splice_with_tool_calls() -> None:
    template = ChatTemplate(CHATML_TEMPLATE)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "ok", "tool_call_id": "c"},
    ]
    store = TurnStore()
    store.remember("", turn_fingerprint(None, [call]), [5])
    rendered = render_prompt(
        template,
        messages,
        tools=None,
        template_kwargs={},
        turn_ids=spliceable_turns(store, "", messages),
    )
    assert rendered.segments[1] == {"ids": [5]}
    assert rendered.segments[0]["text"].endswith("<|im_start|>assistant\n")
    assert rendered.segments[2]["text"].startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")
