"""Text out: UTF-8 assembly across tokens and stop strings (pure, no torch, no I/O).

A token adds raw bytes to the stream (`tokenizer.token_bytes`); a character may span
tokens, so bytes are decoded incrementally and only complete characters come out. Text
that could be the beginning of a stop string is held back until it is known not to be;
a stop string ends the stream and is trimmed together with everything after it.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TextOut:
    """What one push released: `text` to emit now (maybe ""), and whether a stop matched."""

    text: str
    stopped: bool = False


def held_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        upper = min(len(stop) - 1, len(text))
        for n in range(upper, best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest stop string occurrence in `text`, or -1."""
    best = -1
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


@dataclass
class TextStream:
    """Turns token bytes into emit-safe text for one request.

    Invariant: the concatenation of every emitted `text` never contains any part of a
    matched stop string, and every emitted piece is complete UTF-8.
    """

    stops: tuple[str, ...] = ()
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    _held: str = ""
    _stopped: bool = False

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, data: bytes) -> TextOut:
        """Add one token's bytes; return the text that is safe to emit now."""
        if self._stopped:
            return TextOut("", True)
        return self._release(self._decoder.decode(data, final=False), final=False)

    def finish(self) -> TextOut:
        """End of the stream: release everything still held (a stop may still match)."""
        if self._stopped:
            return TextOut("", True)
        return self._release(self._decoder.decode(b"", final=True), final=True)

    def _release(self, new_text: str, final: bool) -> TextOut:
        text = self._held + new_text
        if self.stops:
            at = find_stop(text, self.stops)
            if at >= 0:
                self._held = ""
                self._stopped = True
                return TextOut(text[:at], True)
        hold = 0 if final else held_suffix_len(text, self.stops)
        self._held = text[len(text) - hold :]
        return TextOut(text[: len(text) - hold])
