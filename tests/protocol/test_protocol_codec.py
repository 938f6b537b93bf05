"""decode_request: every validation rule, error codes, id recovery, the line limit."""

from __future__ import annotations

import json

import pytest

from protocol import (
    ERROR_CODES,
    CancelRequest,
    ErrorCode,
    ErrorEvent,
    GenerateRequest,
    ProtocolError,
    decode_event,
    decode_request,
    encode_event,
)


def reject(line: bytes | str, **kwargs: int) -> ProtocolError:
    result = decode_request(line.encode() if isinstance(line, str) else line, **kwargs)
    assert isinstance(result, ProtocolError), result
    assert result.code in ERROR_CODES and result.message
    return result


def gen(**fields: object) -> str:
    """A generate line with `fields` plus a prompt unless a prompt form is given."""
    if not {"prompt", "prompt_segments", "messages"} & set(fields):
        fields = {"prompt": "hi", **fields}
    return json.dumps({"id": 42, **fields})


# (line, message fragment): each breaks exactly one rule; every line carries id 42.
INVALID_GENERATE = [
    (gen(top_p=1.5), "top_p: must be in (0, 1], got 1.5"),
    (gen(top_p=0), "top_p: must be in (0, 1], got 0"),
    (gen(top_p=-0.1), "top_p:"),
    (gen(top_k=-1), "top_k: must be in [0, "),
    (gen(top_k=2**40), "top_k: must be in [0, "),
    (gen(temperature=-0.5), "temperature: must be a finite number >= 0, got -0.5"),
    ('{"id": 42, "prompt": "x", "temperature": 1e999}', "temperature: must be a finite number"),
    (gen(min_p=1.01), "min_p: must be in [0, 1], got 1.01"),
    (gen(min_p=-0.01), "min_p: must be in [0, 1]"),
    (gen(seed=-1), "seed: must be in [0, 2**64 - 1], got -1"),
    (gen(seed=2**64), "seed: must be in"),
    (gen(max_new_tokens=-2), "max_new_tokens: must be -1 or in [0, "),
    (gen(max_new_tokens=2**31), "max_new_tokens:"),
    (gen(stop=["ok", ""]), "stop[1]: must not be empty"),
    (gen(stop_token_ids=[1, -1]), "stop_token_ids[1]: must be in [0, "),
    (gen(prompt_segments=[{"ids": [0, -5]}]), "prompt_segments[0].ids[1]: must be in [0, "),
    (gen(prompt_segments=[{"ids": [2**31]}]), "prompt_segments[0].ids[0]: must be in [0, "),
    (gen(prompt_segments=[{"ids": [True]}]), "prompt_segments[0].ids[0]: expected int, got bool"),
    (gen(prompt_segments=[{"ids": [7] * 5000 + [2.5]}]), "prompt_segments[0].ids[5000]: expect"),
    (gen(prompt_segments=[{"text": 3}]), "prompt_segments[0].text: expected str, got int"),
    (gen(prompt_segments=[{"ids": "1"}]), "prompt_segments[0].ids: expected array, got str"),
    (gen(prompt_segments=[{"text": "a", "ids": [1]}]), "prompt_segments[0]: expected {"),
    (gen(prompt_segments=[{}]), "prompt_segments[0]: expected {"),
    (gen(prompt_segments=["a"]), "prompt_segments[0]: expected {"),
    (gen(prompt="a", messages=[{"role": "user", "content": "b"}]), "got prompt and messages"),
    (gen(prompt="a", prompt_segments=[]), "got prompt and prompt_segments"),
    (json.dumps({"id": 42, "max_new_tokens": 3}), "exactly one of prompt, prompt_segments"),
    (gen(prompt=None), "exactly one of"),
    (gen(messages=[]), "messages: must not be empty"),
    (gen(messages=[{"content": "x"}]), "messages[0].role: must be a string"),
    (gen(messages=["x"]), "messages[0]: expected object, got str"),
    (gen(session_id="a\nb"), "session_id: must be 1 to 256 printable ASCII characters"),
    (gen(session_id="é"), "session_id: must be 1 to 256"),
    (gen(session_id="x" * 257), "session_id: must be 1 to 256"),
    (gen(top_k="5"), "top_k: expected int, got str"),
    (gen(top_k=1.5), "top_k: expected int, got float"),
    (gen(temperature="0"), "temperature: expected float, got str"),
    (gen(temperature=True), "temperature: expected float, got bool"),
    (gen(add_prefix=1), "add_prefix: expected bool, got int"),
    (gen(stop="x"), "stop: expected array, got str"),
    (gen(prompt=5), "prompt: expected str | null, got int"),
    (gen(tools={}), "tools: expected array | null, got object"),
    (gen(chat_template_kwargs=[]), "chat_template_kwargs: expected object | null"),
    (gen(bogus=1), "bogus: unknown field"),
    (gen(op="generate", bogus=1), "bogus: unknown field"),
]


@pytest.mark.parametrize("line,fragment", INVALID_GENERATE)
def test_generate_rule(line: str, fragment: str) -> None:
    error = reject(line)
    assert error.code == ErrorCode.INVALID_REQUEST
    assert fragment in error.message
    assert error.id == 42 and error.op == "generate"


@pytest.mark.parametrize(
    "fields",
    [
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"min_p": 0.0},
        {"min_p": 1},
        {"temperature": 0},
        {"temperature": 100.0},
        {"seed": 2**64 - 1},
        {"max_new_tokens": -1},
        {"max_new_tokens": 0},
        {"session_id": ""},
        {"session_id": " "},
        {"session_id": "~" * 256},
        {"stop": []},
        {"prompt": ""},
        {"prompt_segments": []},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
        {"stop_token_ids": [0, 2**31 - 1]},
    ],
)
def test_generate_boundaries_are_accepted(fields: dict[str, object]) -> None:
    req = decode_request(gen(**fields).encode())
    assert isinstance(req, GenerateRequest), req
    for name, value in fields.items():
        assert getattr(req, name) == value or name == "prompt_segments"


@pytest.mark.parametrize("op", ["open", "close", "reset"])
@pytest.mark.parametrize(
    "fields,fragment",
    [
        ({}, "session_id: required field missing"),
        ({"session_id": ""}, "session_id: must be 1 to 256"),
        ({"session_id": "\t"}, "session_id: must be 1 to 256"),
        ({"session_id": None}, "session_id: expected str, got null"),
        ({"session_id": 3}, "session_id: expected str, got int"),
    ],
)
def test_session_op_rules(op: str, fields: dict[str, object], fragment: str) -> None:
    error = reject(json.dumps({"op": op, "id": "r", **fields}))
    assert error.code == ErrorCode.INVALID_REQUEST and fragment in error.message
    assert error.id == "r" and error.op == op


def test_other_op_rules() -> None:
    assert "ids[1]: must be in [0, " in reject('{"op": "detokenize", "ids": [1, -1]}').message
    assert "text: required field missing" in reject('{"op": "tokenize"}').message
    assert "id: required field missing" in reject('{"op": "cancel"}').message
    assert "id: expected int | str, got null" in reject('{"op": "cancel", "id": null}').message
    assert "x: unknown field" in reject('{"op": "ping", "x": 1}').message
    assert decode_request(b'{"op": "cancel", "id": "r1"}') == CancelRequest(id="r1")


@pytest.mark.parametrize(
    "line,code",
    [
        (b"", ErrorCode.INVALID_JSON),
        (b"\n", ErrorCode.INVALID_JSON),
        (b"{", ErrorCode.INVALID_JSON),
        (b'{"prompt": "x"} trailing', ErrorCode.INVALID_JSON),
        (b'{"prompt": "x", "temperature": NaN}', ErrorCode.INVALID_JSON),
        (b'{"prompt": "x", "temperature": Infinity}', ErrorCode.INVALID_JSON),
        (b'{"prompt": "\\ud800"}', ErrorCode.INVALID_JSON),
        (b'{"prompt": "\xff"}', ErrorCode.INVALID_UTF8),
        (b'{"prompt": "\xed\xa0\x80"}', ErrorCode.INVALID_UTF8),
        (b"\xc3", ErrorCode.INVALID_UTF8),
        (b"[" * 100_000, ErrorCode.INVALID_JSON),
        (b"[]", ErrorCode.INVALID_REQUEST),
        (b"null", ErrorCode.INVALID_REQUEST),
        (b'"generate"', ErrorCode.INVALID_REQUEST),
        (b'{"op": "fly"}', ErrorCode.UNKNOWN_OP),
        (b'{"op": "", "prompt": "x"}', ErrorCode.UNKNOWN_OP),
        (b'{"op": 1, "prompt": "x"}', ErrorCode.INVALID_REQUEST),
        (b'{"op": null, "prompt": "x"}', ErrorCode.INVALID_REQUEST),
    ],
)
def test_error_codes(line: bytes, code: str) -> None:
    assert reject(line).code == code


def test_huge_integers_are_rejected_not_crashing() -> None:
    big = "1" + "0" * 400
    assert "top_k: must be in" in reject(f'{{"prompt": "x", "top_k": {big}}}').message
    assert "seed: must be in" in reject(f'{{"prompt": "x", "seed": {big}}}').message
    error = reject(f'{{"prompt": "x", "id": {big}}}')
    assert error.message.startswith("id: must be a string or an integer") and error.id is None
    error = reject(f'{{"op": "cancel", "id": -{big}}}')
    assert error.id is None
    encode_event(error.to_event())  # an unreadable id is dropped, so the answer still encodes


@pytest.mark.parametrize(
    "line,expected_id",
    [
        (b'{"id": 7, "top_p": 2, "prompt": "x"}', 7),  # fast path, range check
        (b'{"id": "a", "top_k": "x", "prompt": "x"}', "a"),  # slow path, type error
        (b'{"id": -3, "unknown": 1, "prompt": "x"}', -3),  # unknown field
        (b'{"id": "b", "op": "nope"}', "b"),  # unknown op
        (b'{"id": 0, "op": 7}', 0),  # op of the wrong type
        (b'{"id": "c", "temperature": 1e999, "prompt": "x"}', "c"),  # out-of-range number
        (b'{"id": "d"}', "d"),  # no prompt form
        (b'{"id": true, "prompt": "x"}', None),  # an id of the wrong type is not echoed
        (b'{"id": 1.5, "prompt": "x"}', None),
    ],
)
def test_id_is_recovered_from_invalid_lines(line: bytes, expected_id: object) -> None:
    error = reject(line)
    assert error.id == expected_id
    event = error.to_event()
    assert isinstance(event, ErrorEvent) and event.id == expected_id
    assert decode_event(encode_event(event)) == event


def test_error_converts_to_event_with_op_and_session() -> None:
    error = reject(b'{"id": 1, "session_id": "s1", "prompt": "x", "top_p": 0}')
    assert error.session_id == "s1"
    payload = json.loads(encode_event(error.to_event()))
    assert payload == {
        "event": "error",
        "id": 1,
        "error": "top_p: must be in (0, 1], got 0.0",
        "code": "invalid_request",
        "op": "generate",
        "session_id": "s1",
    }


def test_line_limit() -> None:
    line = b'{"prompt": "' + b"a" * 100 + b'"}'
    assert isinstance(decode_request(line, max_line_bytes=len(line)), GenerateRequest)
    assert isinstance(decode_request(line + b"\r\n", max_line_bytes=len(line)), GenerateRequest)
    error = reject(line, max_line_bytes=len(line) - 1)
    assert error.code == ErrorCode.LINE_TOO_LONG and str(len(line)) in error.message
    assert reject(b"x" * ((1 << 20) + 1)).code == ErrorCode.LINE_TOO_LONG


def test_error_codes_table_is_complete() -> None:
    required = {
        "invalid_json",
        "invalid_utf8",
        "invalid_request",
        "unknown_op",
        "line_too_long",
        "capacity_exhausted",
        "unsupported_session",
        "unknown_session",
        "session_busy",
        "duplicate_id",
        "unknown_id",
        "context_length_exceeded",
        "empty_prompt",
        "invalid_token_id",
        "overloaded",
        "worker_lost",
        "out_of_memory",
        "internal_error",
        "shutting_down",
    }
    assert required <= set(ERROR_CODES)
    constants = {v for k, v in vars(ErrorCode).items() if k.isupper()}
    assert constants == set(ERROR_CODES)
    assert all(meaning.strip() and "\n" not in meaning for meaning in ERROR_CODES.values())


def test_number_too_long_for_any_parser() -> None:
    error = reject('{"id": 1, "prompt": "x", "top_k": 1' + "0" * 100_000 + "}")
    assert error.code == ErrorCode.INVALID_REQUEST and "out of range" in error.message
