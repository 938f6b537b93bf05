"""Hypothesis-generated bodies into `tokenpipe serve` over real HTTP (fake worker): sizes
around the body and worker-line limits, deep nesting, unicode edge cases (lone surrogates,
NUL, RTL marks, invalid UTF-8), many tools, many turns. Every request gets one answer, never a
500, every error is the JSON envelope, and afterwards nothing is active or queued."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.openai.prepare import LINE_LIMIT
from tests.openai.hostile_server import HostileServer

MAX_BODY = 2 << 20
PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
EDGE_TEXT = [
    "\ud800",
    "\udfff",
    "\x00",
    "\u202e",
    "\u200f",
    "\ufeff",
    "\ue000tokenpipe-turn-0\ue001",
]


@pytest.fixture(scope="module")
def server() -> Iterator[HostileServer]:
    server = HostileServer(max_body_bytes=MAX_BODY).start()
    yield server
    server.wait_idle()
    server.stop()


def _text() -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=40),
        st.lists(st.sampled_from(EDGE_TEXT) | st.text(max_size=4), max_size=8).map("".join),
        st.integers(LINE_LIMIT - 64, LINE_LIMIT + 64).map(lambda n: "a" * n),
    )


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), _text())
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "bogus"])},
    optional={
        "content": st.one_of(_text(), st.none(), st.just([{"type": "text", "text": "x"}])),
        "tool_calls": st.just([{"function": {"name": "f", "arguments": "[" * 70}}])
        | st.just([{"function": {"name": "f", "arguments": '{"x": 1}'}}]),
    },
)
_tools = st.one_of(
    st.none(),
    st.integers(0, 30_000).map(
        lambda n: [{"type": "function", "function": {"name": f"t{i}"}} for i in range(n)]
    ),
    st.integers(60, 70).map(
        lambda d: [{"type": "function", "function": {"name": "f", "parameters": _nested(d)}}]
    ),
)
_chat = st.fixed_dictionaries(
    {
        "messages": st.one_of(
            st.lists(_message, min_size=0, max_size=6),
            st.integers(1, 30_000).map(lambda n: [{"role": "user", "content": "x"}] * n),
            st.integers(1, 3_000).map(
                lambda n: (
                    [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "c"}] * n
                )
            ),
        ),
        "max_tokens": st.integers(1, 3),
    },
    optional={"tools": _tools, "stream": st.booleans(), "temperature": _scalars},
)
_completion = st.fixed_dictionaries(
    {
        "prompt": st.one_of(_text(), st.lists(st.integers(-1, 300), max_size=20), _json),
        "max_tokens": st.integers(1, 3),
    },
    optional={"stream": st.booleans(), "stop": _json, "seed": _scalars},
)
_tokenize = st.one_of(
    st.fixed_dictionaries({"prompt": _text()}),
    st.fixed_dictionaries({"messages": st.lists(_message, max_size=4)}, optional={"tools": _tools}),
    st.fixed_dictionaries({"tokens": st.lists(st.integers(-5, 2**64), max_size=30) | _json}),
)
_body = st.one_of(_chat, _completion, _tokenize, _json)


def _encode(body: Any, mode: str) -> bytes:
    if mode == "ascii":  # lone surrogates as \ud800 escapes
        return json.dumps(body, ensure_ascii=True).encode()
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")  # invalid UTF-8


_raw = st.one_of(
    st.binary(max_size=64),
    st.integers(MAX_BODY - 16, MAX_BODY + 16).map(lambda n: b'{"prompt": "' + b"a" * n + b'"}'),
    st.integers(60, 1100).map(lambda d: b"[" * d + b"]" * d),
)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
@given(
    path=st.sampled_from(PATHS),
    body=_body,
    mode=st.sampled_from(["ascii", "utf8"]),
    raw=st.none() | _raw,
    content_type=st.sampled_from(["application/json", "application/json; charset=utf-8"]),
)
def test_one_answer_per_request_never_500(
    server: HostileServer, path: str, body: Any, mode: str, raw: bytes | None, content_type: str
) -> None:
    content = raw if raw is not None else _encode(body, mode)
    with httpx.Client(base_url=server.base, timeout=30) as http:
        response = http.post(path, content=content, headers={"Content-Type": content_type})
    assert 200 <= response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert response.json()["error"]["code"], response.text[:300]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
    else:
        response.json()


def test_nothing_left_behind(server: HostileServer) -> None:
    """After the fuzzing (module order): no request active or queued, and still serving."""
    server.wait_idle()
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    response = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200
