"""Sessions: which worker session a request uses, and assistant-turn splicing (pure).

A turn the server generated is remembered as its exact token ids, keyed by a fingerprint of
what the client saw (content + tool calls). When the next request of that session sends the
turn back unchanged, the prompt carries those ids instead of re-encoding the text: the
re-encoded text could tokenize differently (and would lack a hidden thinking channel), which
would break the worker's longest-prefix reuse at that turn. An edited turn no longer matches
its fingerprint and is rendered as text.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .params import validate_session_id
from .templates import ChatTemplate
from .turn_files import TurnFiles

SESSION_HEADERS = ("x-session-affinity", "session_id", "x-tokenpipe-session-id")
"""Headers that name a session, after the body's `session_id` (first match wins)."""

PromptSegmentDict = dict[str, Any]
"""`{"text": str}` or `{"ids": [int, ...]}`, the wire form of a prompt segment."""


def session_from_request(body_session: str | None, headers: Mapping[str, str]) -> str | None:
    """The request's session id: the body's, else the first session header; validated."""
    if body_session is not None:
        return body_session
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value is not None:
            return validate_session_id(value, f"header {name}")
    return None


def _canonical_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
    return arguments


def turn_fingerprint(content: str | None, tool_calls: list[dict[str, Any]] | None) -> str:
    """A digest of an assistant turn as the client sees it. Tool-call ids and argument
    formatting (key order, spacing) do not count; the text and the calls do."""
    calls = [
        [
            call.get("function", {}).get("name"),
            _canonical_arguments(call.get("function", {}).get("arguments")),
        ]
        for call in tool_calls or ()
    ]
    payload = json.dumps([content or "", calls], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass
class TurnStore:
    """Remembered assistant turns: (session key, fingerprint) -> generated token ids.
    Thread-safe: the event loop remembers turns while a preparation thread looks them up.

    Bounded twice: at most `max_sessions` session keys (least recently used dropped) and
    `max_turns` turns per session. The scratch session has the key "".

    With `files` (`--session-dir`), named sessions' turns are also kept on disk
    (turn_files.py) and read back the first time a session is looked up, so a session the
    workers restored after a restart is spliced as before, and resumes warm.
    """

    max_sessions: int = 1024
    max_turns: int = 64
    files: TurnFiles | None = None
    _turns: OrderedDict[str, OrderedDict[str, tuple[int, ...]]] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def remember(self, session: str, fingerprint: str, ids: list[int]) -> None:
        if self.files is not None and session:
            self._load(session)
        with self._lock:
            self._remember(session, fingerprint, ids)
            current = list(self._turns[session].items())
        if self.files is not None and session:
            self.files.append(session, fingerprint, ids, current)

    def _load(self, session: str) -> None:
        """The session's saved turns into memory, the first time it is seen."""
        assert self.files is not None
        with self._lock:
            if session in self._turns:
                return
        saved = self.files.load(session)
        with self._lock:
            if session not in self._turns:
                self._turns[session] = OrderedDict(saved)
                while len(self._turns) > self.max_sessions:
                    self._turns.popitem(last=False)

    def _remember(self, session: str, fingerprint: str, ids: list[int]) -> None:
        turns = self._turns.setdefault(session, OrderedDict())
        self._turns.move_to_end(session)
        turns[fingerprint] = tuple(ids)
        turns.move_to_end(fingerprint)
        while len(turns) > self.max_turns:
            turns.popitem(last=False)
        while len(self._turns) > self.max_sessions:
            self._turns.popitem(last=False)

    def lookup(self, session: str, fingerprint: str) -> tuple[int, ...] | None:
        if self.files is not None and session:
            self._load(session)
        with self._lock:
            turns = self._turns.get(session)
            if turns is None:
                return None
            self._turns.move_to_end(session)
            return turns.get(fingerprint)

    def forget(self, session: str) -> None:
        with self._lock:
            self._turns.pop(session, None)
        if self.files is not None and session:
            self.files.delete(session)


def _sentinel(index: int) -> str:
    # Private-use code points: never produced by clients in practice, never trimmed by jinja.
    return f"\ue000tokenpipe-turn-{index}\ue001"


_SENTINEL = re.compile("\ue000tokenpipe-turn-([0-9]{1,9})\ue001")


@dataclass(frozen=True)
class RenderedPrompt:
    """The prompt as wire segments, and how many assistant turns were spliced as ids."""

    segments: list[PromptSegmentDict]
    spliced_turns: int

    def text_only(self) -> str | None:
        """The prompt text when no ids were spliced, else None."""
        if self.spliced_turns:
            return None
        return "".join(s["text"] for s in self.segments)


def render_prompt(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    turn_ids: Mapping[int, tuple[int, ...]],
    max_chars: int | None = None,
) -> RenderedPrompt:
    """Render `messages`, replacing the assistant messages at the indices of `turn_ids` by
    those exact ids. A turn the template does not render exactly once as a plain content
    slot (it dropped or duplicated it) is rendered as text instead."""
    pending = dict(turn_ids)
    # At most three renders, each scanned once: a turn the template dropped or duplicated is
    # rendered as text the second time; if that still leaves one broken, none is spliced.
    for attempt in range(3):
        if attempt == 2:
            pending = {}
        patched = [
            {"role": "assistant", "content": _sentinel(i)} if i in pending else message
            for i, message in enumerate(messages)
        ]
        text = template.render_raw(
            patched, tools=tools, template_kwargs=template_kwargs, max_chars=max_chars
        )
        found = [(int(m.group(1)), m.start(), m.end()) for m in _SENTINEL.finditer(text)]
        counts = Counter(index for index, _, _ in found)
        broken = [i for i in pending if counts[i] != 1]
        if not broken:
            break
        for i in broken:
            del pending[i]
    bos = template.bos_token if template.strip_bos else None
    skip = len(bos) if bos and text.startswith(bos) else 0
    segments: list[PromptSegmentDict] = []
    position = skip
    for index, start, end in found:  # in text order, whatever order the template used
        if index not in pending:
            continue
        if start > position:
            segments.append({"text": text[position:start]})
        segments.append({"ids": list(pending[index])})
        position = end
    if position < len(text) or not segments:
        segments.append({"text": text[position:]})
    return RenderedPrompt(segments, len(pending))


def spliceable_turns(
    store: TurnStore, session: str, messages: list[dict[str, Any]]
) -> dict[int, tuple[int, ...]]:
    """message index -> remembered ids, for every assistant message the server produced."""
    found: dict[int, tuple[int, ...]] = {}
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        ids = store.lookup(
            session, turn_fingerprint(message.get("content"), message.get("tool_calls"))
        )
        if ids:
            found[index] = ids
    return found
