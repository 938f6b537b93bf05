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
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .params import validate_session_id
from .templates import ChatTemplate, strip_leading_bos

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
        except ValueError:
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

    Bounded twice: at most `max_sessions` session keys (least recently used dropped) and
    `max_turns` turns per session. The scratch session has the key "".
    """

    max_sessions: int = 1024
    max_turns: int = 64
    _turns: OrderedDict[str, OrderedDict[str, tuple[int, ...]]] = field(default_factory=OrderedDict)

    def remember(self, session: str, fingerprint: str, ids: list[int]) -> None:
        turns = self._turns.setdefault(session, OrderedDict())
        self._turns.move_to_end(session)
        turns[fingerprint] = tuple(ids)
        turns.move_to_end(fingerprint)
        while len(turns) > self.max_turns:
            turns.popitem(last=False)
        while len(self._turns) > self.max_sessions:
            self._turns.popitem(last=False)

    def lookup(self, session: str, fingerprint: str) -> tuple[int, ...] | None:
        turns = self._turns.get(session)
        if turns is None:
            return None
        self._turns.move_to_end(session)
        return turns.get(fingerprint)

    def forget(self, session: str) -> None:
        self._turns.pop(session, None)


def _sentinel(index: int) -> str:
    # Private-use code points: never produced by clients in practice, never trimmed by jinja.
    return f"\ue000tokenpipe-turn-{index}\ue001"


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
) -> RenderedPrompt:
    """Render `messages`, replacing the assistant messages at the indices of `turn_ids` by
    those exact ids. A turn the template does not render exactly once as a plain content
    slot (it dropped or duplicated it) is rendered as text instead."""
    pending = dict(turn_ids)
    while True:
        patched = [
            {"role": "assistant", "content": _sentinel(i)} if i in pending else message
            for i, message in enumerate(messages)
        ]
        text = template.render_raw(patched, tools=tools, template_kwargs=template_kwargs)
        broken = [i for i in pending if text.count(_sentinel(i)) != 1]
        if not broken:
            break
        for i in broken:
            del pending[i]
    if template.strip_bos:
        text = strip_leading_bos(text, template.bos_token)
    segments: list[PromptSegmentDict] = []
    # Sentinels appear in message order because templates render messages in order; sort by
    # position anyway so a reordering template still splits correctly.
    order = sorted(pending, key=lambda i: text.index(_sentinel(i)))
    rest = text
    for i in order:
        before, rest = rest.split(_sentinel(i), 1)
        if before:
            segments.append({"text": before})
        segments.append({"ids": list(pending[i])})
    if rest or not segments:
        segments.append({"text": rest})
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
