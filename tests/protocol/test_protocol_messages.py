"""Round trips of every message, the seed keys on the wire, and the seed line forms."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
from protocol_samples import EVENTS, REQUESTS, done_event

from protocol import (
    EVENT_TYPES,
    REQUEST_TYPES,
    ClosedEvent,
    DoneEvent,
    ErrorEvent,
    GenerateRequest,
    IdsSegment,
    OpenedEvent,
    PongEvent,
    ProtocolError,
    ReadyEvent,
    ResetEvent,
    TextSegment,
    TokenEvent,
    decode_event,
    decode_request,
    encode_event,
    encode_request,
)

SEED_DONE_KEYS = {
    "done",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "reused_prompt_tokens",
    "prefilled_prompt_tokens",
    "session_reset_reason",
    "prefill_ms",
    "decode_ms",
    "total_ms",
    "prefill_tok_s",
    "decode_tok_s",
}


def test_samples_cover_every_message_type() -> None:
    assert {type(r) for r in REQUESTS} == set(REQUEST_TYPES.values())
    assert {type(e) for e in EVENTS} == set(EVENT_TYPES.values())


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_request_round_trip(request_: object) -> None:
    line = encode_request(request_)  # type: ignore[arg-type]
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["op"] == request_.op  # type: ignore[attr-defined]
    assert decode_request(line) == request_


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_event_round_trip(event: object) -> None:
    line = encode_event(event)  # type: ignore[arg-type]
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    payload = json.loads(line)
    assert payload["event"] == event.event  # type: ignore[attr-defined]
    assert event.event in payload  # type: ignore[attr-defined]  # payload key named like the tag
    assert decode_event(line) == event
    assert decode_event(line.decode()) == event


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_event_without_event_tag_decodes_by_payload_key(event: object) -> None:
    payload = json.loads(encode_event(event))  # type: ignore[arg-type]
    del payload["event"]
    assert decode_event(json.dumps(payload).encode()) == event


def test_done_with_zero_values_keeps_every_seed_key() -> None:
    payload = json.loads(encode_event(done_event()))
    assert set(payload) == SEED_DONE_KEYS | {"event"}
    assert payload["done"] is True and payload["prompt_tokens"] == 0
    assert payload["finish_reason"] == "stop" and payload["session_reset_reason"] == "new"


def test_done_generated_token_ids_omitted_only_when_none() -> None:
    assert "generated_token_ids" not in json.loads(encode_event(done_event()))
    empty = json.loads(encode_event(done_event(generated_token_ids=[])))
    assert empty["generated_token_ids"] == []


def test_flag_events_always_write_their_flag() -> None:
    assert json.loads(encode_event(ReadyEvent(max_sessions=1, max_named_sessions=0))) == {
        "event": "ready",
        "ready": True,
        "max_sessions": 1,
        "max_named_sessions": 0,
    }
    for event_type, flag in (
        (OpenedEvent, "opened"),
        (ClosedEvent, "closed"),
        (ResetEvent, "reset"),
    ):
        payload = json.loads(encode_event(event_type(session_id="s")))
        assert payload == {"event": flag, flag: True, "session_id": "s"}
    assert json.loads(encode_event(PongEvent())) == {"event": "pong", "pong": True}


def test_optional_fields_are_omitted() -> None:
    assert json.loads(encode_event(TokenEvent(token="a"))) == {"event": "token", "token": "a"}
    assert json.loads(encode_event(ErrorEvent(error="m", code="c"))) == {
        "event": "error",
        "error": "m",
        "code": "c",
    }
    token = json.loads(encode_event(TokenEvent(token="a", token_ids=[5], id=0)))
    assert token == {"event": "token", "id": 0, "token": "a", "token_ids": [5]}
    assert json.loads(encode_request(GenerateRequest(prompt="p"))) == {
        "op": "generate",
        "prompt": "p",
    }


def test_event_line_is_one_line_whatever_the_text() -> None:
    line = encode_event(TokenEvent(token='a\nb\r\u2028\u2029\x00"\\'))
    assert line.count(b"\n") == 1 and line.endswith(b"\n")
    assert decode_event(line) == TokenEvent(token='a\nb\r\u2028\u2029\x00"\\')


# --------------------------------------------------------------------------- seed-format lines


def test_seed_generate_line_without_op() -> None:
    line = (
        b'{"prompt": "Hi", "max_new_tokens": 8, "temperature": 0, "top_p": 1, "top_k": 0,'
        b' "seed": 0, "stop": ["\\n"], "session_id": ""}\n'
    )
    req = decode_request(line)
    assert isinstance(req, GenerateRequest)
    assert (req.prompt, req.max_new_tokens, req.stop, req.session_id) == ("Hi", 8, ["\n"], "")
    assert isinstance(req.temperature, float) and isinstance(req.top_p, float)


def test_seed_prompt_segments_decode_to_segment_types() -> None:
    req = decode_request(b'{"prompt_segments": [{"text": "a"}, {"ids": [1, 2]}, {"text": "b"}]}')
    assert isinstance(req, GenerateRequest)
    assert req.prompt_segments == [TextSegment("a"), IdsSegment([1, 2]), TextSegment("b")]


def test_seed_session_ops() -> None:
    for op in ("open", "close", "reset"):
        req = decode_request(b'{"op": "%s", "session_id": "s"}' % op.encode())
        assert not isinstance(req, ProtocolError)
        assert req.op == op and req.session_id == "s"  # type: ignore[union-attr]


def test_seed_event_lines_decode_to_the_right_types() -> None:
    ready = decode_event(b'{"ready": true, "max_sessions": 4, "max_named_sessions": 3}')
    assert ready == ReadyEvent(max_sessions=4, max_named_sessions=3)
    assert decode_event(b'{"token": "Hi"}') == TokenEvent(token="Hi")
    done = decode_event(
        b'{"done": true, "prompt_tokens": 3, "completion_tokens": 2, "finish_reason": "length",'
        b' "reused_prompt_tokens": 0, "prefilled_prompt_tokens": 3,'
        b' "session_reset_reason": "new", "prefill_ms": 1.0, "decode_ms": 2.0, "total_ms": 3.0,'
        b' "prefill_tok_s": 3000.0, "decode_tok_s": 1000.0}'
    )
    assert isinstance(done, DoneEvent)
    assert done.finish_reason == "length" and done.generated_token_ids is None
    error = decode_event(b'{"error": "no slots", "code": "capacity_exhausted"}')
    assert error == ErrorEvent(error="no slots", code="capacity_exhausted")
    assert decode_event(b'{"opened": true, "session_id": "s"}') == OpenedEvent(session_id="s")
    assert decode_event(b'{"closed": true, "session_id": "s"}') == ClosedEvent(session_id="s")
    assert decode_event(b'{"reset": true, "session_id": "s"}') == ResetEvent(session_id="s")


def test_decode_event_ignores_unknown_fields() -> None:
    assert decode_event(b'{"event": "token", "token": "a", "later": 1}') == TokenEvent(token="a")


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[1]",
        b'{"nothing": 1}',
        b'{"event": "token"}',
        b'{"event": "nope", "token": "a"}',
        b'{"token": 5}',
        b'{"done": true}',
    ],
)
def test_decode_event_rejects_bad_lines(line: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_event(line)


def test_protocol_does_not_import_torch() -> None:
    code = "import sys, protocol, protocol.schema; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
