"""Splitting a client's byte stream into request lines, with the size cap enforced as bytes
arrive (`tokenpipe run`'s stdin and `--listen` connections).

Invariants: buffering is linear in the line's size (chunks are kept in a list and joined once,
when the newline comes); at most `max_line_bytes + 2` bytes of a line are ever held (the limit,
then "\\r\\n"); a longer line is reported once, as soon as it passes the cap, as a `TooLong`
holding its first `PEEK_BYTES` (to read its id), and the rest of it is dropped unread.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.peek import PEEK_BYTES


@dataclass(frozen=True)
class TooLong:
    """A line over the limit: its first bytes; the rest is being dropped."""

    prefix: bytes


class LineSplitter:
    def __init__(self, max_line_bytes: int) -> None:
        self._cap = max_line_bytes + 2  # decode_request checks the exact limit below this
        self._chunks: list[bytes] = []
        self._held = 0  # bytes in _chunks
        self._dropping = False  # inside a line already reported as TooLong

    def feed(self, data: bytes) -> list[bytes | TooLong]:
        """The complete lines (without their newline) and too-long reports in `data`."""
        out: list[bytes | TooLong] = []
        start = 0
        while start < len(data):
            newline = data.find(b"\n", start)
            end = len(data) if newline < 0 else newline
            if self._dropping:
                pass
            elif self._held + end - start > self._cap:
                out.append(TooLong(self._prefix(data[start:end])))
                self._chunks, self._held, self._dropping = [], 0, True
            elif newline >= 0:
                piece = data[start:end]
                out.append(b"".join([*self._chunks, piece]) if self._chunks else piece)
                self._chunks, self._held = [], 0
            else:
                self._chunks.append(data[start:end])
                self._held += end - start
            if newline < 0:
                break
            self._dropping = False
            start = newline + 1
        return out

    def finish(self) -> bytes | None:
        """End of the stream: the last line if it had no newline (and was not too long)."""
        rest = b"".join(self._chunks)
        self._chunks, self._held = [], 0
        return None if self._dropping or not rest else rest

    def _prefix(self, tail: bytes) -> bytes:
        kept = b"".join(self._chunks)[:PEEK_BYTES]
        return kept + tail[: PEEK_BYTES - len(kept)]
