"""Malformed request lines: a fixed corpus and a hypothesis generator, with the answer each
line must get. Pure (no torch, no processes); tools/fuzz_lines.py uses it for the long runs.

The oracle for a line the codec rejects is the codec itself (`decode_request` gives the code
and the id it could read); lines the codec accepts but the engine must reject (token ids past
the vocabulary, prompts over the context, duplicate ids, cancels of unknown ids) carry their
expected code explicitly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from protocol import ProtocolError, decode_request

NO_ANSWER = "-"  # a blank line is skipped: no answer at all


@dataclass(frozen=True)
class Case:
    """One line to send. `code` is the error code its one answer must carry (or NO_ANSWER);
    `rid` the id that answer must carry (None: no id)."""

    label: str
    line: bytes
    code: str
    rid: Any = None


def _json(obj: Any) -> bytes:
    """Compact JSON; unlike orjson, the stdlib writes integers of any size."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _exact_size(head: bytes, tail: bytes, size: int) -> bytes:
    """`head` + words + `tail`, `size` bytes long."""
    fill = size - len(head) - len(tail)
    return head + (b"hi " * (fill // 3 + 1))[:fill] + tail


def expect_from_codec(label: str, line: bytes) -> Case | None:
    """The case for a line the codec rejects (None when the codec accepts it)."""
    if not line.strip():
        return Case(label, line, NO_ANSWER)
    decoded = decode_request(line)
    if isinstance(decoded, ProtocolError):
        return Case(label, line, decoded.code, decoded.id)
    return None


def static_corpus(vocab_size: int, max_context: int, busy_id: str) -> list[Case]:
    """The fixed corpus. `busy_id` is the id of a request in flight while it is sent."""
    raw: list[tuple[str, bytes]] = [
        # not JSON
        ("text", b"not json"),
        ("open brace", b"{"),
        ("close brace", b"}"),
        ("unterminated string", b'{"prompt": "unterminated'),
        ("unterminated object", b'{"prompt": "x"'),
        ("trailing comma", b'{"prompt": "x",}'),
        ("single quotes", b"{'prompt': 'x'}"),
        ("two objects", b'{"op":"ping"} {"op":"ping"}'),
        ("NaN", b'{"id": 1, "prompt": "x", "temperature": NaN}'),
        ("Infinity", b'{"id": 2, "prompt": "x", "top_p": Infinity}'),
        ("-Infinity", b'{"prompt": "x", "temperature": -Infinity}'),
        ("nul byte", b'{"prompt": "a\x00b"}'),
        ("raw control char", b'{"prompt": "a\x01b", "id": "ctl"}'),
        # not UTF-8
        ("invalid utf8 in string", b'{"id": "u1", "prompt": "\xff\xfe"}'),
        ("invalid utf8 bare", b"\xc3\x28"),
        ("utf8 surrogate", b'{"prompt": "\xed\xa0\x80"}'),
        ("overlong utf8", b'{"prompt": "\xc0\xaf"}'),
        ("latin-1 line", '{"prompt": "caf\xe9"}'.encode("latin-1")),
        # valid JSON, not an object
        ("array", b"[]"),
        ("number", b"42"),
        ("string", b'"prompt"'),
        ("null", b"null"),
        ("true", b"true"),
        # wrong types
        ("prompt int", _json({"id": "t1", "prompt": 5})),
        ("max_new_tokens str", _json({"id": "t2", "prompt": "x", "max_new_tokens": "10"})),
        ("temperature str", _json({"id": "t3", "prompt": "x", "temperature": "hot"})),
        ("stop str", _json({"id": "t4", "prompt": "x", "stop": "x"})),
        ("session_id int", _json({"id": "t5", "prompt": "x", "session_id": 5})),
        ("segments str", _json({"id": "t6", "prompt_segments": "abc"})),
        ("segment ids str", _json({"id": "t7", "prompt_segments": [{"ids": "x"}]})),
        ("segment text int", _json({"id": "t8", "prompt_segments": [{"text": 1}]})),
        ("segment both keys", _json({"id": "t9", "prompt_segments": [{"text": "a", "ids": [1]}]})),
        ("segment empty obj", _json({"id": "t10", "prompt_segments": [{}]})),
        ("messages str", _json({"id": "t11", "messages": "hi"})),
        ("messages empty", _json({"id": "t12", "messages": []})),
        ("message role int", _json({"id": "t13", "messages": [{"role": 1, "content": "x"}]})),
        ("op int", _json({"id": "t14", "op": 5})),
        ("id list", b'{"id": [1], "op": "ping"}'),
        ("id object", b'{"id": {"a": 1}, "op": "ping"}'),
        ("id float", b'{"id": 1.5, "op": "ping"}'),
        ("id bool", b'{"id": true, "op": "ping"}'),
        ("add_prefix str", _json({"id": "t15", "prompt": "x", "add_prefix": "yes"})),
        ("tokenize no text", _json({"id": "t16", "op": "tokenize"})),
        ("detokenize ids str", _json({"id": "t17", "op": "detokenize", "ids": "1,2"})),
        # out of range
        ("float overflow", b'{"id": "r0", "prompt": "x", "temperature": 1e999}'),
        ("max_new_tokens 2^64", _json({"id": "r1", "prompt": "x", "max_new_tokens": 2**64})),
        ("max_new_tokens -2", _json({"id": "r2", "prompt": "x", "max_new_tokens": -2})),
        ("seed 2^64", b'{"id": "r3", "prompt": "x", "seed": 18446744073709551616}'),
        ("seed -1", _json({"id": "r4", "prompt": "x", "seed": -1})),
        ("top_k 2^31", _json({"id": "r5", "prompt": "x", "top_k": 2**31})),
        ("top_k -1", _json({"id": "r6", "prompt": "x", "top_k": -1})),
        ("top_p 0", _json({"id": "r7", "prompt": "x", "top_p": 0})),
        ("top_p 1.5", _json({"id": "r8", "prompt": "x", "top_p": 1.5})),
        ("min_p 2", _json({"id": "r9", "prompt": "x", "min_p": 2})),
        ("temperature -1", _json({"id": "r10", "prompt": "x", "temperature": -1})),
        ("id 2^63", b'{"id": 9223372036854775808, "op": "ping"}'),
        ("id 2^70", b'{"id": 1180591620717411303424, "op": "ping"}'),
        ("id -2^64", b'{"id": -18446744073709551616, "op": "ping"}'),
        ("huge int literal", b'{"id": "r11", "prompt": "x", "top_k": 1' + b"0" * 400 + b"}"),
        ("empty stop", _json({"id": "r12", "prompt": "x", "stop": [""]})),
        ("negative token id", _json({"id": "r13", "prompt_segments": [{"ids": [-1]}]})),
        ("token id 2^40", _json({"id": "r14", "prompt_segments": [{"ids": [2**40]}]})),
        ("negative stop token", _json({"id": "r15", "prompt": "x", "stop_token_ids": [-5]})),
        ("negative detokenize", _json({"id": "r16", "op": "detokenize", "ids": [-1]})),
        # unknown ops and fields, missing fields
        ("unknown op", _json({"id": "u-op", "op": "fly"})),
        ("empty op", _json({"id": "u-op2", "op": ""})),
        ("upper op", _json({"op": "GENERATE", "prompt": "x"})),
        ("op null", _json({"id": "u-op3", "op": None, "prompt": "x"})),
        ("unknown field", _json({"id": "f1", "prompt": "x", "bogus": 1})),
        ("unknown field ping", _json({"id": "f2", "op": "ping", "extra": True})),
        ("model path field", _json({"id": "f3", "prompt": "x", "model": "/etc/passwd"})),
        ("model_path field", _json({"id": "f4", "op": "info", "model_path": "/tmp/x.gguf"})),
        ("tokenizer_path field", _json({"id": "f5", "prompt": "x", "tokenizer_path": "/x"})),
        ("no prompt", _json({"id": "f6"})),
        ("empty object", b"{}"),
        (
            "two prompt forms",
            _json({"id": "f7", "prompt": "x", "prompt_segments": [{"text": "x"}]}),
        ),
        ("open no session", _json({"id": "f8", "op": "open"})),
        ("cancel no id", _json({"op": "cancel"})),
        # session ids
        ("open empty session", _json({"id": "s1", "op": "open", "session_id": ""})),
        ("open 257-char session", _json({"id": "s2", "op": "open", "session_id": "a" * 257})),
        ("open nul session", _json({"id": "s3", "op": "open", "session_id": "a\x00b"})),
        ("open non-ascii session", _json({"id": "s4", "op": "open", "session_id": "caf\u00e9"})),
        ("open newline session", _json({"id": "s5", "op": "open", "session_id": "a\nb"})),
        ("generate DEL session", _json({"id": "s6", "prompt": "x", "session_id": "a\x7f"})),
        ("close path session", _json({"id": "s7", "op": "close", "session_id": "../" * 90})),
        # framing
        ("blank", b""),
        ("spaces", b"   \t  "),
        # over 1 MiB and over a worker's limit (1 MiB + 64 KiB of headroom for the supervisor)
        ("line over 1 MiB", _json({"id": "big1", "prompt": "a" * ((1 << 20) + (1 << 16))})),
        ("10 MB line", b'{"id": "big2", "prompt": "' + b"a" * 10_000_000 + b'"}'),
        ("10 MB garbage", b"\xff" * 10_000_000),
    ]
    cases = []
    for label, line in raw:
        case = expect_from_codec(label, line)
        assert case is not None, f"corpus line {label!r} is accepted by the codec"
        cases.append(case)
    over = max_context  # with room for one generated token this is one token too many
    cases += [
        Case(
            "token id = vocab",
            _json({"id": "v1", "prompt_segments": [{"ids": [vocab_size]}]}),
            "invalid_token_id",
            "v1",
        ),
        Case(
            "token id 2^31-1",
            _json({"id": "v2", "prompt_segments": [{"ids": [2**31 - 1]}]}),
            "invalid_token_id",
            "v2",
        ),
        Case(
            "detokenize past vocab",
            _json({"id": "v3", "op": "detokenize", "ids": [vocab_size + 7]}),
            "invalid_token_id",
            "v3",
        ),
        Case(
            "prompt one over context",
            _json({"id": "c1", "prompt_segments": [{"ids": [1] * over}], "add_prefix": False}),
            "context_length_exceeded",
            "c1",
        ),
        Case(
            "prefill one over context",
            _json(
                {
                    "id": "c2",
                    "prompt_segments": [{"ids": [1] * (over + 1)}],
                    "add_prefix": False,
                    "max_new_tokens": 0,
                }
            ),
            "context_length_exceeded",
            "c2",
        ),
        Case(
            "empty prompt",
            _json({"id": "e1", "prompt": "", "add_prefix": False}),
            "empty_prompt",
            "e1",
        ),
        Case(
            "empty segments",
            _json({"id": "e2", "prompt_segments": [], "add_prefix": False}),
            "empty_prompt",
            "e2",
        ),
        Case(
            # inside the 1 MiB limit; the supervisor's re-encoding adds `"op":"generate",`
            # (16 bytes), which a worker's headroom takes: answered like any long prompt
            "1,048,568-byte line without op",
            _exact_size(b'{"id":"grow","max_new_tokens":1,"prompt":"', b'"}', 1_048_568),
            "context_length_exceeded",
            "grow",
        ),
        Case("duplicate id", _json({"id": busy_id, "op": "ping"}), "duplicate_id", busy_id),
        Case(
            "duplicate id generate",
            _json({"id": busy_id, "prompt": "x", "max_new_tokens": 1}),
            "duplicate_id",
            busy_id,
        ),
        Case("cancel unknown str", _json({"op": "cancel", "id": "nope"}), "unknown_id", "nope"),
        Case(
            "cancel unknown int", _json({"op": "cancel", "id": 123456789}), "unknown_id", 123456789
        ),
        Case(
            "cancel unknown negative",
            _json({"op": "cancel", "id": -(2**63)}),
            "unknown_id",
            -(2**63),
        ),
    ]
    return cases


# --------------------------------------------------------------------------- hypothesis

_FIELDS = [
    "prompt",
    "prompt_segments",
    "messages",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "session_id",
    "add_prefix",
    "return_token_ids",
    "op",
    "text",
    "ids",
    "id",
    "model",
    "path",
]
_OPS = [
    "generate",
    "open",
    "close",
    "reset",
    "cancel",
    "ping",
    "info",
    "stats",
    "tokenize",
    "detokenize",
    "shutdown",
    "fly",
    "",
    "Generate",
    "load_model",
]

_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def _mutated_request(draw: st.DrawFn) -> bytes:
    """A request-shaped object with one or more fields of the wrong type or range."""
    obj: dict[str, Any] = {}
    if draw(st.booleans()):
        obj["op"] = draw(st.sampled_from(_OPS))
    for name in draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=4, unique=True)):
        obj[name] = draw(_json_values)
    if draw(st.booleans()):
        obj["id"] = draw(
            st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=12), _json_values)
        )
    data = _json(obj)
    # splice in a non-JSON number now and then
    if draw(st.integers(0, 5)) == 0 and data.endswith(b"}") and len(data) > 2:
        token = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e99999", b"0x10"]))
        data = data[:-1] + b',"temperature":' + token + b"}"
    return data


@st.composite
def _corrupted_bytes(draw: st.DrawFn) -> bytes:
    """A valid request with bytes flipped, cut or inserted."""
    base = draw(
        st.sampled_from(
            [
                b'{"id": 7, "prompt": "Hello", "max_new_tokens": 1}',
                b'{"op": "open", "session_id": "abc", "id": "o"}',
                b'{"op": "tokenize", "text": "caf\xc3\xa9", "id": 3}',
                b'{"prompt_segments": [{"ids": [2, 3]}, {"text": "x"}], "id": "seg"}',
            ]
        )
    )
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.integers(0, 2))
        pos = draw(st.integers(0, len(data)))
        if action == 0 and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        elif action == 1:
            data[pos : pos + draw(st.integers(1, 8))] = b""
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data).replace(b"\n", b" ").replace(b"\r", b" ")


malformed_lines = st.one_of(
    _mutated_request(),
    _corrupted_bytes(),
    st.binary(max_size=64).map(lambda b: b.replace(b"\n", b" ").replace(b"\r", b" ")),
    _json_values.map(_json),
)
"""Lines of any shape; keep those `expect_from_codec` rejects (a generated line that happens
to be a valid request is skipped: it would run, not fail)."""


def is_cheap_valid(line: bytes) -> bool:
    """A generated line the codec accepts: harmless to skip."""
    return not isinstance(decode_request(line), ProtocolError)
