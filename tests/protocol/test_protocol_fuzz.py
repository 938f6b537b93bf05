"""Property tests: decode_request never raises, and its answers are self-consistent."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_samples import REQUESTS

from protocol import (
    ERROR_CODES,
    REQUEST_TYPES,
    GenerateRequest,
    ProtocolError,
    decode_event,
    decode_request,
    encode_event,
    encode_request,
    validate_request,
)

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)

FIELD_NAMES = sorted(
    {name for cls in REQUEST_TYPES.values() for name in cls.__struct_fields__}
    | {"op", "id", "text", "ids", "role", "content"}
)
plausible_values = (
    json_values
    | st.sampled_from(list(REQUEST_TYPES))
    | st.lists(st.integers(min_value=-2, max_value=2**31 + 1), max_size=4)
    | st.lists(st.text(max_size=4), max_size=3)
    | st.lists(
        st.fixed_dictionaries({"text": st.text(max_size=4)})
        | st.fixed_dictionaries({"ids": st.lists(st.integers(-1, 10), max_size=3)}),
        max_size=3,
    )
    | st.floats(min_value=-0.5, max_value=1.5)
    | st.just([{"role": "user", "content": "hi"}])
)
plausible_requests = st.dictionaries(st.sampled_from(FIELD_NAMES), plausible_values, max_size=8)


def check(line: bytes | str) -> None:
    """The properties every answer of decode_request has."""
    result = decode_request(line)
    if isinstance(result, ProtocolError):
        assert result.code in ERROR_CODES
        assert isinstance(result.message, str) and result.message
        out = encode_event(result.to_event())  # the answer always encodes, as one line
        assert out.count(b"\n") == 1 and out.endswith(b"\n")
        assert decode_event(out) == result.to_event()
    else:
        assert validate_request(result) is None
        assert decode_request(encode_request(result)) == result


@FAST
@given(st.binary(max_size=200))
def test_arbitrary_bytes(line: bytes) -> None:
    check(line)


@FAST
@given(st.text(max_size=100))
def test_arbitrary_text(line: str) -> None:
    check(line)


@FAST
@given(json_values)
def test_arbitrary_json_values(value: Any) -> None:
    check(json.dumps(value).encode())  # NaN/Infinity appear as invalid JSON literals


@FAST
@given(plausible_requests)
def test_plausible_dicts_with_wrong_typed_values(fields: dict[str, Any]) -> None:
    check(json.dumps(fields).encode())


@FAST
@given(st.dictionaries(st.sampled_from(FIELD_NAMES), plausible_values, max_size=8))
def test_plausible_generate_lines(fields: dict[str, Any]) -> None:
    fields.pop("op", None)
    fields.setdefault("prompt", "x")
    check(json.dumps(fields).encode())


@FAST
@given(st.text(max_size=40), st.integers(0, 5))
def test_truncated_and_spliced_lines(text: str, cut: int) -> None:
    line = encode_request(GenerateRequest(prompt=text, stop=["a"], id=text))
    check(line[: len(line) - cut])
    check(line[:-1] + text.encode())


# Valid requests (the samples) with up to two fields replaced: most answers sit near the
# boundary between accepted and rejected, where the range checks live.
VALID_LINES = [json.loads(encode_request(request)) for request in REQUESTS]
mutated_requests = st.builds(
    lambda base, changes, drop: {
        **{k: v for k, v in base.items() if k not in drop},
        **changes,
    },
    st.sampled_from(VALID_LINES),
    st.dictionaries(st.sampled_from(FIELD_NAMES), plausible_values, max_size=2),
    st.sets(st.sampled_from(FIELD_NAMES), max_size=1),
)


@FAST
@given(mutated_requests)
def test_mutated_valid_requests(fields: dict[str, Any]) -> None:
    check(json.dumps(fields).encode())


def test_mutations_reach_both_outcomes() -> None:
    """Guards the strategy above: it must produce accepted and rejected lines."""
    outcomes = {"accepted": 0, "rejected": 0}

    @settings(max_examples=200, deadline=None, database=None)
    @given(mutated_requests)
    def count(fields: dict[str, Any]) -> None:
        result = decode_request(json.dumps(fields).encode())
        outcomes["rejected" if isinstance(result, ProtocolError) else "accepted"] += 1

    count()
    assert outcomes["accepted"] >= 10 and outcomes["rejected"] >= 10, outcomes
