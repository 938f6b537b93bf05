"""Text out: UTF-8 assembly across tokens and stop strings (pure, no torch, no I/O).

A token adds raw bytes to the stream (`tokenizer.token_bytes`); a character may span
tokens, so bytes are decoded incrementally and only complete characters come out. Text
that could be the beginning of a stop string is held back until it is known not to be;
a stop string ends the stream and is trimmed together with everything after it.
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TextOut:
    """What one push released: `text` to emit now (maybe ""), and whether a stop matched."""

    text: str
    stopped: bool = False


def held_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string
    (the reference `StopMatcher.depth` is tested against; quadratic, not used per token)."""
    best = 0
    for stop in stops:
        upper = min(len(stop) - 1, len(text))
        for n in range(upper, best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest stop string occurrence in `text`, or -1 (the reference for
    `StopMatcher.feed`)."""
    best = -1
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


class StopMatcher:
    """Aho-Corasick automaton over the stop strings, fed the text one character at a time.

    Invariants after feeding text T: `depth` is the length of the longest suffix of T that is
    a prefix of some stop string (`held_suffix_len`, when no stop occurred); `_longest[s]` is
    the length of the longest stop string that is a suffix of state s's string (0: none).
    Each character costs O(1) amortized, whatever the number and length of the stop strings;
    building costs O(total characters of the stop strings).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._fail: list[int] = [0]
        self._depth: list[int] = [0]
        self._longest: list[int] = [0]
        for stop in stops:
            state = 0
            for char in stop:
                child = self._goto[state].get(char)
                if child is None:
                    child = len(self._goto)
                    self._goto[state][char] = child
                    self._goto.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[state] + 1)
                    self._longest.append(0)
                state = child
            self._longest[state] = len(stop)
        order = deque(self._goto[0].values())  # breadth first: a failure link is shallower
        while order:
            state = order.popleft()
            for char, child in self._goto[state].items():
                order.append(child)
                if state:
                    self._fail[child] = self._next(self._fail[state], char)
                self._longest[child] = max(self._longest[child], self._longest[self._fail[child]])
        self.state = 0

    @property
    def depth(self) -> int:
        return self._depth[self.state]

    def _next(self, state: int, char: str) -> int:
        goto, fail = self._goto, self._fail
        while state and char not in goto[state]:
            state = fail[state]
        return goto[state].get(char, 0)

    def feed(self, text: str) -> int | None:
        """Advance over `text`. Returns where the earliest-starting stop string that ends
        inside `text` starts, relative to `text` (negative: inside what was fed before), or
        None. The automaton's state is then past `text` (discard it after a match)."""
        earliest: int | None = None
        state, longest = self.state, self._longest
        for index, char in enumerate(text):
            state = self._next(state, char)
            if longest[state]:
                start = index + 1 - longest[state]
                if earliest is None or start < earliest:
                    earliest = start
        self.state = state
        return earliest


@dataclass
class TextStream:
    """Turns token bytes into emit-safe text for one request.

    Invariant: the concatenation of every emitted `text` never contains any part of a
    matched stop string, and every emitted piece is complete UTF-8. The text held back is
    exactly the longest suffix that could still begin a stop string; a push costs O(its own
    characters + what it releases), not O(what is held).
    """

    stops: tuple[str, ...] = ()
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    _held: deque[str] = field(default_factory=deque)  # pieces, oldest first
    _held_len: int = 0
    _matcher: StopMatcher | None = None
    _stopped: bool = False

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)
        self._matcher = StopMatcher(self.stops) if self.stops else None

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
        matcher = self._matcher
        if matcher is None:
            return TextOut(new_text)
        start = matcher.feed(new_text) if new_text else None
        if new_text:
            self._held.append(new_text)
            self._held_len += len(new_text)
        if start is not None:  # counted from the start of the held text
            text = "".join(self._held)[: self._held_len - len(new_text) + start]
            self._held.clear()
            self._held_len = 0
            self._stopped = True
            return TextOut(text, True)
        hold = 0 if final else matcher.depth
        return TextOut(self._take(self._held_len - hold))

    def _take(self, count: int) -> str:
        """Remove and return the first `count` held characters."""
        pieces: list[str] = []
        while count > 0:
            piece = self._held[0]
            if len(piece) <= count:
                pieces.append(self._held.popleft())
            else:
                pieces.append(piece[:count])
                self._held[0] = piece[count:]
            taken = len(pieces[-1])
            count -= taken
            self._held_len -= taken
        return "".join(pieces)
