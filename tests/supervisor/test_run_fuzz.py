"""Fuzzing `tokenpipe run` (a real process, fake workers) with generated lines: sizes around
every limit, deep nesting, unicode edge cases, missing, duplicate and unreadable ids, many
requests in one write (or split across writes at random points).

Invariants checked after every example: each line gets exactly the answers its own decoding
says (one terminal line carrying its id; none for a blank line), and `stats` then shows no
request active, queued or held by the supervisor.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import MAX_LINE_BYTES, WORKER_MAX_LINE_BYTES, ProtocolError, decode_request
from protocol.codec import line_too_long
from protocol.peek import PEEK_BYTES
from tests.reliability.helpers import TERMINAL, LineProcess, run_argv
from tests.supervisor.conftest import FAKE_WORKER

pytestmark = pytest.mark.timeout(600)

IDS = st.one_of(st.none(), st.sampled_from(["a", "b", 7, -1, 2**63 - 1, "é", ""]))
SESSIONS = st.sampled_from(["s1", "s2", "", "bad\x00", "x" * 257])
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\u2028\u2029", "\x00", "\ufeff", "😀" * 5, "\\", '"', "\ud800", "\udfff"]),
)
# msgspec reads 999 levels of nesting and no more; orjson writes only 254
DEPTHS = st.sampled_from([1, 200, 254, 255, 256, 300, 998, 999, 1000, 5000])
# line sizes next to each limit: the client's, a worker's (+64 KiB), the id-peek window
SIZES = st.sampled_from(
    [
        MAX_LINE_BYTES - 17,
        MAX_LINE_BYTES - 8,
        MAX_LINE_BYTES,
        MAX_LINE_BYTES + 1,
        MAX_LINE_BYTES + 2,
        MAX_LINE_BYTES + 3,
        WORKER_MAX_LINE_BYTES,
        WORKER_MAX_LINE_BYTES + 1,
        3 * MAX_LINE_BYTES,
        PEEK_BYTES - 1,
        PEEK_BYTES + 1,
    ]
)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _with_id(fields: dict[str, Any], rid: Any) -> dict[str, Any]:
    return fields if rid is None else {"id": rid, **fields}


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    rid = draw(IDS)
    op = draw(
        st.sampled_from(
            ["generate", "seed", "ping", "info", "stats", "tokenize", "detokenize", "open"]
            + ["close", "reset", "cancel"]
        )
    )
    if op in ("generate", "seed"):
        fields: dict[str, Any] = {
            "prompt": draw(TEXT),
            "max_new_tokens": draw(st.integers(-2, 3)),
        }
        if draw(st.booleans()):
            fields["session_id"] = draw(SESSIONS)
        if op == "generate":
            fields = {"op": "generate", **fields}
        return _json(_with_id(fields, rid))
    if op == "cancel":  # of an id never in flight: answered unknown_id
        return _json({"op": "cancel", "id": f"never-{draw(st.integers(0, 9))}"})
    if op in ("open", "close", "reset"):
        return _json(_with_id({"op": op, "session_id": draw(SESSIONS)}, rid))
    if op == "tokenize":
        return _json(_with_id({"op": op, "text": draw(TEXT)}, rid))
    if op == "detokenize":
        return _json(_with_id({"op": op, "ids": draw(st.lists(st.integers(-1, 300)))}, rid))
    return _json(_with_id({"op": op}, rid))


@st.composite
def nested(draw: st.DrawFn) -> bytes:
    depth = draw(DEPTHS)
    content = b"[" * depth + b"]" * depth
    head = _json(_with_id({"max_new_tokens": 1}, draw(IDS)))[:-1]
    return head + b', "messages": [{"role": "user", "content": ' + content + b"}]}"


@st.composite
def sized(draw: st.DrawFn) -> bytes:
    """A generate line of an exact size; its id first, last, or absent."""
    size = draw(SIZES)
    rid = draw(st.sampled_from(["big", 42, None]))
    where = draw(st.sampled_from(["first", "last"]))
    with_op = draw(st.booleans())
    head = b'{"op":"generate",' if with_op else b"{"
    if rid is not None and where == "first":
        head += b'"id":' + _json(rid) + b","
    head += b'"max_new_tokens":1,"prompt":"'
    tail = b'"' + (b',"id":' + _json(rid) if rid is not None and where == "last" else b"") + b"}"
    fill = max(0, size - len(head) - len(tail))
    return head + b"a" * fill + tail


GARBAGE = st.one_of(
    st.binary(max_size=64).map(lambda b: b.replace(b"\n", b"")),
    st.sampled_from(
        [b"", b"  ", b"\xef\xbb\xbf{}", b'{"id": 1', b'{"id": "x", "op": 5}', b"[1,2]", b"null"]
        + [b'{"id": "sur", "prompt": "\\ud800"}', b'{"id": {"a": 1}, "op": "ping"}', b"{}"]
    ),
)
LINES = st.one_of(requests(), requests(), nested(), GARBAGE, sized())


def expected_answer(line: bytes) -> tuple[bool, Any]:
    """Whether `line` gets an answer, and the id that answer carries (the codec's view)."""
    content = line[:-1] if line.endswith(b"\r") else line
    if len(content) > MAX_LINE_BYTES + 1:
        return True, line_too_long(content, None, MAX_LINE_BYTES).id
    if not content.strip():
        return False, None
    decoded = decode_request(content)
    if isinstance(decoded, ProtocolError):
        return True, decoded.id
    return True, decoded.id


def _key(rid: Any) -> str:
    return json.dumps(rid)  # 7 and "7" differ; None is an id-less answer


@pytest.fixture(scope="module")
def run() -> Iterator[LineProcess]:
    worker = " ".join([*FAKE_WORKER, "--fake-token-delay", "0"])
    proc = LineProcess(run_argv("--workers", "2", "--worker-command", worker))
    proc.wait_ready(timeout=60)
    proc.examples = 0  # type: ignore[attr-defined]
    yield proc
    started = time.monotonic()
    assert proc.close() == 0, proc.stderr_text()
    assert time.monotonic() - started < 10, "shutting down took too long"
    assert not proc.bad_lines, proc.bad_lines[:3]


@settings(
    max_examples=int(os.environ.get("TOKENPIPE_FUZZ_EXAMPLES", "40")),
    deadline=None,
    derandomize=os.environ.get("TOKENPIPE_FUZZ_EXAMPLES") is None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    lines=st.lists(LINES, min_size=1, max_size=6),
    crlf=st.booleans(),
    cuts=st.lists(st.floats(0, 1), max_size=3),
)
def test_one_answer_per_line_and_nothing_held(
    run: LineProcess, lines: list[bytes], crlf: bool, cuts: list[float]
) -> None:
    expected: Counter[str] = Counter()
    for line in lines:
        answered, rid = expected_answer(line)
        if answered:
            expected[_key(rid)] += 1
    end = b"\r\n" if crlf else b"\n"
    data = b"".join(line + end for line in lines)
    points = sorted({int(cut * len(data)) for cut in cuts} | {0, len(data)})
    for start, stop in zip(points, points[1:], strict=False):
        run.send_raw(data[start:stop])  # several requests per write, lines split across writes

    got: Counter[str] = Counter()
    run.examples += 1  # type: ignore[attr-defined]
    stats_id = f"stats-{run.examples}"  # type: ignore[attr-defined]

    def settled(event: dict[str, Any]) -> bool:
        if event["event"] in TERMINAL and event.get("id") != stats_id:
            got[_key(event.get("id"))] += 1
        return got == expected

    if expected:
        run.read_until(settled, timeout=20)
    assert got == expected
    # Nothing held afterwards (fake workers answer every request they take).
    deadline = time.monotonic() + 10
    while True:
        run.send({"op": "stats", "id": stats_id})
        stats = run.read_until(lambda e: e.get("id") == stats_id, timeout=60)[-1]["stats"]
        held = (
            stats["active_requests"],
            stats["queued_requests"],
            stats["supervisor"]["requests_in_flight"],
            sum(w["queue_depth"] for w in stats["workers"]),
        )
        if held == (0, 0, 0, 0) or time.monotonic() > deadline:
            break
    assert held == (0, 0, 0, 0), stats
