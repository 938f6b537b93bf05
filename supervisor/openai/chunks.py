"""OpenAI response bodies and SSE chunks, built from parsed output (pure)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from protocol import TokenLogprob

from .tool_parsers import Piece, ToolCall

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def tool_call_body(call: ToolCall, index: int, call_id: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass
class TurnAccumulator:
    """Everything a turn produced, in order; streaming and non-streaming both fill one, so the
    final message is the same whichever way it was delivered."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, piece: Piece) -> dict[str, Any] | None:
        """Record `piece`; return its streaming delta (None for nothing to send)."""
        if piece.kind == "content" and piece.text:
            self.content.append(piece.text)
            return {"content": piece.text}
        if piece.kind == "reasoning" and piece.text:
            self.reasoning.append(piece.text)
            return {"reasoning_content": piece.text}
        if piece.kind == "tool_call" and piece.call is not None:
            body = tool_call_body(
                piece.call, len(self.tool_calls), new_id("call").replace("-", "_")
            )
            self.tool_calls.append(body)
            return {"tool_calls": [body]}
        return None

    @property
    def content_text(self) -> str | None:
        text = "".join(self.content)
        return text if text or not self.tool_calls else None

    def message(self) -> dict[str, Any]:
        """The assistant message of a non-streaming response."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content_text}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [
                {key: value for key, value in call.items() if key != "index"}
                for call in self.tool_calls
            ]
        return message

    def finish_reason(self, worker_reason: str) -> str:
        if self.tool_calls and worker_reason == "stop":
            return "tool_calls"
        return "length" if worker_reason == "length" else "stop"


@dataclass(frozen=True)
class ResponseHeader:
    """The fields every chunk and body of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def chat_chunk(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
            ],
        }

    def usage_chunk(self, obj: str, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }

    def chat_body(
        self,
        message: dict[str, Any],
        finish_reason: str,
        usage: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason,
                    "logprobs": logprobs,
                }
            ],
            "usage": usage,
        }

    def text_chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
            ],
        }

    def text_body(
        self,
        text: str,
        finish_reason: str,
        usage: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.text_chunk(text, finish_reason, logprobs)
        body["usage"] = usage
        return body


# ----------------------------------------------------------------------------- logprobs


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal"}`."""
    content = []
    for entry in entries:
        item = _token_entry(entry.token, entry.logprob)
        item["top_logprobs"] = [_token_entry(t.token, t.logprob) for t in entry.top or ()]
        content.append(item)
    return {"content": content, "refusal": None}


def text_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Completions' `logprobs`: parallel lists, `text_offset` counted from `offset` (the
    characters of the text before these tokens)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {t.token: t.logprob for t in e.top} if e.top is not None else None for e in entries
        ],
        "text_offset": offsets,
    }
