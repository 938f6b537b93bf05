"""Pure tests of UTF-8 assembly and stop strings (worker/engine/text.py)."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.text import TextStream, find_stop, held_suffix_len


def _run(pieces: list[bytes], stops: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    stream = TextStream(stops)
    out: list[str] = []
    for piece in pieces:
        released = stream.push(piece)
        out.append(released.text)
        if released.stopped:
            return out, True
    tail = stream.finish()
    out.append(tail.text)
    return out, tail.stopped


def test_multibyte_split_across_tokens_arrives_whole() -> None:
    data = "é€😀".encode()
    pieces = [data[i : i + 1] for i in range(len(data))]
    out, stopped = _run(pieces)
    assert not stopped
    assert "".join(out) == "é€😀"
    for text in out:  # every emitted piece is whole characters
        text.encode("utf-8")
    assert out[0] == "" and out[1] == "é"


def test_invalid_bytes_become_replacement() -> None:
    out, _ = _run([b"a\xff", b"b"])
    assert "".join(out) == "a\ufffdb"


def test_stop_split_across_tokens_is_trimmed_and_not_leaked() -> None:
    out, stopped = _run([b"Hello ", b"EN", b"D", b" more"], stops=("END",))
    assert stopped
    assert "".join(out) == "Hello "
    assert all("E" not in piece for piece in out)


def test_partial_stop_prefix_released_when_it_diverges() -> None:
    out, stopped = _run([b"a EN", b"X"], stops=("END",))
    assert not stopped
    assert out == ["a ", "ENX", ""]


def test_held_text_released_at_finish() -> None:
    out, stopped = _run([b"abc E"], stops=("END",))
    assert not stopped
    assert out == ["abc ", "E"]


def test_earliest_stop_wins_and_rest_is_dropped() -> None:
    out, stopped = _run([b"xx STOP yy END"], stops=("END", "STOP"))
    assert stopped and "".join(out) == "xx "


def test_stop_inside_one_token() -> None:
    out, stopped = _run([b"abENDcd"], stops=("END",))
    assert stopped and out == ["ab"]


def test_multibyte_stop_string() -> None:
    data = "ok😀no".encode()
    out, stopped = _run([data[i : i + 1] for i in range(len(data))], stops=("😀",))
    assert stopped and "".join(out) == "ok"


def test_helpers() -> None:
    assert held_suffix_len("abc E", ["END"]) == 1
    assert held_suffix_len("abc EN", ["END", "NX"]) == 2
    assert held_suffix_len("abc", ["END"]) == 0
    assert find_stop("a END b STOP", ["STOP", "END"]) == 2
    assert find_stop("abc", ["x"]) == -1


def _reference(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, bool]:
    """The plain algorithm (find the earliest stop in held + new, hold the longest suffix that
    could begin one), what `TextStream` must equal."""
    held, out = "", []
    for piece in pieces:
        text = held + piece
        at = find_stop(text, stops)
        if at >= 0:
            out.append(text[:at])
            return "".join(out), True
        hold = held_suffix_len(text, stops)
        held = text[len(text) - hold :]
        out.append(text[: len(text) - hold])
    out.append(held)
    return "".join(out), False


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abcé", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abcé", min_size=1, max_size=5), max_size=4),
)
def test_stream_equals_the_plain_algorithm(pieces: list[str], stops: list[str]) -> None:
    stream = TextStream(tuple(stops))
    out: list[str] = []
    stopped = False
    for piece in pieces:
        released = stream.push(piece.encode())
        out.append(released.text)
        if released.stopped:
            stopped = True
            break
    if not stopped:
        tail = stream.finish()
        out.append(tail.text)
        stopped = tail.stopped
    assert ("".join(out), stopped) == _reference(pieces, tuple(stops))


def test_many_long_stops_cost_bounded_per_token() -> None:
    """1,000 stop strings of 1,000 characters that all share the generated text's prefix:
    each token costs O(its characters), not O(held characters x stops)."""
    stops = tuple("a" * 999 + chr(0x4E00 + i) for i in range(1000))
    started = time.perf_counter()
    stream = TextStream(stops)
    built = time.perf_counter() - started
    started = time.perf_counter()
    out = []
    for _ in range(3000):
        released = stream.push(b"a")
        assert not released.stopped
        out.append(released.text)
    pushed = time.perf_counter() - started
    assert "".join(out) == "a" * 2001 and stream.finish().text == "a" * 999
    assert built < 2.0 and pushed < 0.5, (built, pushed)
