"""Reading `id` and `op` from the first bytes of a request line that is too long to decode.

A line over the size limit is answered `line_too_long` without being decoded whole; when its
top-level `id` (and `op`) appear within its first `PEEK_BYTES`, the answer carries them, so a
client with several requests in flight knows which one was refused.

`peek_request_fields` walks the top level of one JSON object, skipping every other value
without decoding it. It never raises and never reads past `PEEK_BYTES`: its cost is bounded
whatever the line's length.
"""

from __future__ import annotations

from typing import Any

import msgspec

PEEK_BYTES = 1 << 16
"""How much of a too-long line is kept and searched for `id` and `op`."""

_WHITESPACE = b" \t\r\n"
_SCALAR_END = b",}] \t\r\n"
_DECODER = msgspec.json.Decoder()


class _Truncated(Exception):
    """The prefix ended (or stopped being JSON) before the walk did."""


def _skip_whitespace(data: bytes, at: int) -> int:
    while at < len(data) and data[at] in _WHITESPACE:
        at += 1
    if at >= len(data):
        raise _Truncated
    return at


def _string_end(data: bytes, at: int) -> int:
    """`data[at]` is an opening quote: the index just past the closing one."""
    search = at + 1
    while True:
        quote = data.find(b'"', search)
        if quote < 0:
            raise _Truncated
        backslashes = 0
        while data[quote - 1 - backslashes] == 0x5C:  # '\\'
            backslashes += 1
        if backslashes % 2 == 0:
            return quote + 1
        search = quote + 1


def _value_end(data: bytes, at: int) -> int:
    """`data[at]` starts a JSON value: the index just past it (containers walked by depth)."""
    first = data[at]
    if first == 0x22:  # '"'
        return _string_end(data, at)
    if first not in b"[{":
        end = at
        while end < len(data) and data[end] not in _SCALAR_END:
            end += 1
        if end >= len(data):
            raise _Truncated
        return end
    depth = 0
    while at < len(data):
        byte = data[at]
        if byte == 0x22:
            at = _string_end(data, at)
            continue
        if byte in b"[{":
            depth += 1
        elif byte in b"]}":
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1
    raise _Truncated


def peek_request_fields(line: bytes) -> tuple[Any, Any]:
    """`(id, op)` as found at the top level of the JSON object that `line` starts (only its
    first `PEEK_BYTES` are read); each is None when absent from that prefix or unreadable.
    The caller checks that they are valid before use."""
    data = line[:PEEK_BYTES]
    found: dict[bytes, Any] = {}
    try:
        at = _skip_whitespace(data, 0)
        if data[at] != 0x7B:  # '{'
            return None, None
        at += 1
        while len(found) < 2:
            at = _skip_whitespace(data, at)
            if data[at] != 0x22:
                break  # '}' or not JSON
            key_end = _string_end(data, at)
            key = data[at + 1 : key_end - 1]
            at = _skip_whitespace(data, key_end)
            if data[at] != 0x3A:  # ':'
                break
            at = _skip_whitespace(data, at + 1)
            value_end = _value_end(data, at)
            if key in (b"id", b"op") and key not in found:
                try:
                    found[key] = _DECODER.decode(data[at:value_end])
                except msgspec.DecodeError:
                    found[key] = None
            at = _skip_whitespace(data, value_end)
            if data[at] != 0x2C:  # ','
                break
            at += 1
    except (_Truncated, IndexError, RecursionError):
        pass
    return found.get(b"id"), found.get(b"op")
