"""Every message of the wire protocol, one msgspec Struct each.

Requests are a tagged union on `op` (`Request`); a line with no `op` is a `generate` (the
ExecuTorch llm_server worker form). Events are a tagged union on `event` (`Event`). Both
omit fields that hold their default value, except the keys a seed client reads, which are
always written (they are required fields, or `Literal[True]` flags whose default comes from
a factory, which `omit_defaults` never drops).

Decode and encode through `protocol.codec`: it owns the typed decoders, the range checks
(`validate_request`), and the hook that turns `prompt_segments` items into `TextSegment` /
`IdsSegment`. Rule for changes: new fields go at the end with a default; a field's type
never changes. Structs marked `gc=False` hold only strings, numbers and lists of them, so
they can never be part of a reference cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import msgspec

RequestId = str | int
"""A request's `id`: a string or an integer in the signed 64-bit range."""

FinishReason = Literal["stop", "length", "cancelled"]
SessionResetReason = Literal["new", "exact_prefix", "mismatch", "dirty", "equal", "truncated"]


def _true() -> Literal[True]:
    return True


# --------------------------------------------------------------------------- prompt segments


class PromptSegment:
    """One item of `GenerateRequest.prompt_segments`: a `TextSegment` or an `IdsSegment`.

    On the wire an item is `{"text": str}` or `{"ids": [int, ...]}` with no tag; the codec's
    decode hook picks the class from the key.
    """

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class TextSegment(PromptSegment):
    """Text to encode with the tokenizer (no prefix of its own): `{"text": "..."}`."""

    text: str


@dataclass(frozen=True, slots=True)
class IdsSegment(PromptSegment):
    """Token ids fed as they are: `{"ids": [1, 2, 3]}`. Each id is >= 0."""

    ids: list[int]


# --------------------------------------------------------------------------------- requests


class _RequestBase(
    msgspec.Struct,
    tag_field="op",
    kw_only=True,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Fields every request has."""

    id: RequestId | None = None
    """Echoed on every line that answers this request. Requests with ids may be in flight
    together; requests without one are answered in order, one at a time."""


class GenerateRequest(_RequestBase, tag="generate", kw_only=True, gc=False):
    """Generate text: `{"op": "generate", "prompt": "Hello", "max_new_tokens": 32}`.

    Exactly one of `prompt`, `prompt_segments`, `messages`. Answered by zero or more
    `token` events, then exactly one `done` or `error`. A line without `op` is this request.
    """

    op: ClassVar[str] = "generate"

    prompt: str | None = None
    """Plain text, encoded after the tokenizer's prefix (BOS) unless `add_prefix` is false."""
    prompt_segments: list[PromptSegment] | None = None
    """Text and token-id pieces, concatenated in order (after the prefix)."""
    messages: list[dict[str, Any]] | None = None
    """Chat messages (`{"role": ..., "content": ...}`), rendered with the model's template."""
    max_new_tokens: int = -1
    """Tokens to generate at most; -1 fills the context, 0 only prefills."""
    temperature: float = 0.0
    """0 samples greedily."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]; 1 is off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 is off."""
    min_p: float = 0.0
    """Drop tokens below min_p times the top probability, in [0, 1]; 0 is off."""
    seed: int = 0
    """Sampling seed, >= 0; 0 leaves it unset (a fresh random seed)."""
    stop: list[str] = []
    """Stop strings (non-empty); output ends before the first one and never contains it."""
    stop_token_ids: list[int] = []
    """Extra token ids that end the turn like EOS (not emitted, not fed)."""
    session_id: str | None = None
    """A named session opened with `open`; absent or "" is the scratch session."""
    add_prefix: bool = True
    """Prepend the tokenizer's prefix ids (BOS) to the prompt."""
    return_token_ids: bool = False
    """Add `token_ids` to every `token` event."""
    return_resident: bool = False
    """Add `resident_keep` / `resident_append` to `done` (the session's new resident ids are
    `old[:resident_keep] + resident_append`)."""
    tools: list[dict[str, Any]] | None = None
    """Tool definitions passed to the chat template (with `messages`)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (with `messages`)."""
    add_generation_prompt: bool = True
    """End the rendered chat with the assistant's turn header (with `messages`)."""
    json_schema: dict[str, Any] | None = None
    """Constrain the output to JSON valid against this JSON Schema (llguidance's supported
    subset; compact: no whitespace between tokens). At most one of `json_schema`,
    `json_object`, `regex`, `grammar`."""
    json_object: bool = False
    """Constrain the output to one JSON object (any keys)."""
    regex: str | None = None
    """Constrain the output to a full match of this regular expression (Rust regex syntax)."""
    grammar: str | None = None
    """Constrain the output to this grammar: Lark (llguidance's dialect) or GBNF."""
    return_logprobs: bool = False
    """Add `logprobs` to every `token` event: each token's log-probability under the
    temperature-scaled distribution it was sampled from (before top-k/top-p/min-p and the
    grammar mask)."""
    top_logprobs: int = 0
    """With `return_logprobs`: also the this many most likely tokens per position, 0 to 20."""


class OpenRequest(_RequestBase, tag="open", kw_only=True, gc=False):
    """Open a named session: `{"op": "open", "session_id": "s1"}`; answered by `opened`."""

    op: ClassVar[str] = "open"

    session_id: str
    """1 to 256 printable ASCII characters."""


class CloseRequest(_RequestBase, tag="close", kw_only=True, gc=False):
    """Close a named session and free its slot; answered by `closed`."""

    op: ClassVar[str] = "close"

    session_id: str


class ResetRequest(_RequestBase, tag="reset", kw_only=True, gc=False):
    """Empty a named session's cache (it stays open); answered by `reset`."""

    op: ClassVar[str] = "reset"

    session_id: str


class CancelRequest(_RequestBase, tag="cancel", kw_only=True, gc=False):
    """Cancel the in-flight request whose `id` this is: `{"op": "cancel", "id": 7}`.

    No line of its own on success: the cancelled generate ends with `done` and
    `finish_reason: "cancelled"`. An unknown or finished id answers `error` with code
    `unknown_id`, `op: "cancel"` and this `id`.
    """

    op: ClassVar[str] = "cancel"

    id: RequestId
    """The id of the request to cancel (required here)."""


class PingRequest(_RequestBase, tag="ping", kw_only=True, gc=False):
    """Liveness check; answered by `pong`."""

    op: ClassVar[str] = "ping"


class InfoRequest(_RequestBase, tag="info", kw_only=True, gc=False):
    """Ask for the model's metadata; answered by an `info` event."""

    op: ClassVar[str] = "info"


class StatsRequest(_RequestBase, tag="stats", kw_only=True, gc=False):
    """Ask for load and memory figures; answered by a `stats` event."""

    op: ClassVar[str] = "stats"


class TokenizeRequest(_RequestBase, tag="tokenize", kw_only=True, gc=False):
    """Encode text to token ids; answered by a `tokens` event."""

    op: ClassVar[str] = "tokenize"

    text: str
    add_prefix: bool = False
    """Prepend the tokenizer's prefix ids (BOS)."""


class DetokenizeRequest(_RequestBase, tag="detokenize", kw_only=True, gc=False):
    """Decode token ids to text; answered by a `text` event."""

    op: ClassVar[str] = "detokenize"

    ids: list[int]


class ShutdownRequest(_RequestBase, tag="shutdown", kw_only=True, gc=False):
    """Stop accepting requests, finish those in flight, exit 0 (like EOF on stdin)."""

    op: ClassVar[str] = "shutdown"


Request = (
    GenerateRequest
    | OpenRequest
    | CloseRequest
    | ResetRequest
    | CancelRequest
    | PingRequest
    | InfoRequest
    | StatsRequest
    | TokenizeRequest
    | DetokenizeRequest
    | ShutdownRequest
)

REQUEST_TYPES: dict[str, type[Request]] = {
    cls.op: cls
    for cls in (
        GenerateRequest,
        OpenRequest,
        CloseRequest,
        ResetRequest,
        CancelRequest,
        PingRequest,
        InfoRequest,
        StatsRequest,
        TokenizeRequest,
        DetokenizeRequest,
        ShutdownRequest,
    )
}
"""op -> request class."""


# ----------------------------------------------------------------------------------- events


class _EventBase(
    msgspec.Struct,
    tag_field="event",
    kw_only=True,
    omit_defaults=True,
):
    """Fields every event has. Unknown fields are ignored when decoding (forward compatible)."""

    id: RequestId | None = None
    """The `id` of the request this line answers, when it had one."""


class ReadyEvent(_EventBase, tag="ready", kw_only=True):
    """First line a worker (or supervisor) writes:
    `{"ready": true, "max_sessions": 8, "max_named_sessions": 7}`."""

    event: ClassVar[str] = "ready"

    ready: Literal[True] = msgspec.field(default_factory=_true)
    max_sessions: int
    """Sessions that can hold a cache at once, the scratch session included."""
    max_named_sessions: int
    """Sessions that `open` can create (max_sessions - 1 on a seed worker)."""
    model: str | None = None
    architecture: str | None = None
    context_length: int | None = None
    device: str | None = None
    workers: int | None = None
    """Worker processes behind a supervisor."""
    protocol_version: int | None = None
    max_line_bytes: int | None = None
    """Longest request line accepted, in bytes (the newline not counted)."""
    max_resident: int | None = None
    """Sessions whose cache is on the device at once (a worker writes it); the others of
    `max_sessions` wait in host memory or on disk. Equal to `max_sessions` without tiers."""
    restored_sessions: list[str] | None = None
    """Named sessions open at start because `--session-dir` held them (their caches on
    disk); a supervisor lists those of all its workers and routes each to its holder."""


class TopLogprob(msgspec.Struct, kw_only=True, gc=False):
    """One of the most likely tokens at a position: its id, text and log-probability."""

    id: int
    token: str
    """The token's bytes as text (invalid UTF-8, e.g. half a character, as U+FFFD)."""
    logprob: float


class TokenLogprob(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A generated token's log-probability, and the `top_logprobs` most likely tokens at its
    position (most likely first) when the request asked for them."""

    id: int
    token: str
    """The token's bytes as text (invalid UTF-8 as U+FFFD)."""
    logprob: float
    top: list[TopLogprob] | None = None


class TokenEvent(_EventBase, tag="token", kw_only=True, gc=False):
    """Generated text: `{"token": "Hello"}`. Always complete UTF-8; never part of a stop
    string. May stand for several tokens (or none, when only ids are reported)."""

    event: ClassVar[str] = "token"

    token: str
    token_ids: list[int] | None = None
    """The ids behind this text, when the request set `return_token_ids`."""
    logprobs: list[TokenLogprob] | None = None
    """One entry per token behind this text, when the request set `return_logprobs`."""


class DoneEvent(_EventBase, tag="done", kw_only=True, gc=False):
    """The terminal line of a successful (or cancelled) generate. Every seed key is always
    present; `generated_token_ids` is omitted when a stop string trimmed the output."""

    event: ClassVar[str] = "done"

    done: Literal[True] = msgspec.field(default_factory=_true)
    prompt_tokens: int
    """Tokens in the prompt as fed (prefix included)."""
    completion_tokens: int
    finish_reason: FinishReason
    reused_prompt_tokens: int
    """Prompt tokens found in the session's cache and kept."""
    prefilled_prompt_tokens: int
    """Prompt tokens computed for this request."""
    session_reset_reason: SessionResetReason
    prefill_ms: float
    decode_ms: float
    total_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    generated_token_ids: list[int] | None = None
    session_id: str | None = None
    resident_keep: int | None = None
    """With `return_resident`: how many of the old resident ids the session kept."""
    resident_append: list[int] | None = None
    """With `return_resident`: the ids appended after those kept."""
    matched_stop: str | None = None
    """The stop string that ended the output, when one did."""


class ErrorEvent(_EventBase, tag="error", kw_only=True, gc=False):
    """A failed request (terminal for it): `{"error": "top_p: ...", "code": "invalid_request"}`.
    The process keeps serving."""

    event: ClassVar[str] = "error"

    error: str
    """A human-readable message."""
    code: str
    """One of `protocol.errors.ErrorCode`."""
    op: str | None = None
    session_id: str | None = None


class OpenedEvent(_EventBase, tag="opened", kw_only=True, gc=False):
    """Answer to `open`: `{"opened": true, "session_id": "s1"}`."""

    event: ClassVar[str] = "opened"

    opened: Literal[True] = msgspec.field(default_factory=_true)
    session_id: str


class ClosedEvent(_EventBase, tag="closed", kw_only=True, gc=False):
    """Answer to `close`: `{"closed": true, "session_id": "s1"}`."""

    event: ClassVar[str] = "closed"

    closed: Literal[True] = msgspec.field(default_factory=_true)
    session_id: str


class ResetEvent(_EventBase, tag="reset", kw_only=True, gc=False):
    """Answer to `reset`: `{"reset": true, "session_id": "s1"}`."""

    event: ClassVar[str] = "reset"

    reset: Literal[True] = msgspec.field(default_factory=_true)
    session_id: str


class PongEvent(_EventBase, tag="pong", kw_only=True, gc=False):
    """Answer to `ping`: `{"pong": true}`."""

    event: ClassVar[str] = "pong"

    pong: Literal[True] = msgspec.field(default_factory=_true)


class InfoEvent(_EventBase, tag="info", kw_only=True):
    """Answer to `info`: `{"info": {"model": ..., "context_length": ..., ...}}`."""

    event: ClassVar[str] = "info"

    info: dict[str, Any]


class StatsEvent(_EventBase, tag="stats", kw_only=True):
    """Answer to `stats`: `{"stats": {"active_requests": ..., ...}}`."""

    event: ClassVar[str] = "stats"

    stats: dict[str, Any]


class TokensEvent(_EventBase, tag="tokens", kw_only=True, gc=False):
    """Answer to `tokenize`: `{"tokens": [2, 9259]}`."""

    event: ClassVar[str] = "tokens"

    tokens: list[int]


class TextEvent(_EventBase, tag="text", kw_only=True, gc=False):
    """Answer to `detokenize`: `{"text": "Hello"}`."""

    event: ClassVar[str] = "text"

    text: str


Event = (
    ReadyEvent
    | TokenEvent
    | DoneEvent
    | ErrorEvent
    | OpenedEvent
    | ClosedEvent
    | ResetEvent
    | PongEvent
    | InfoEvent
    | StatsEvent
    | TokensEvent
    | TextEvent
)

EVENT_TYPES: dict[str, type[Event]] = {
    cls.event: cls
    for cls in (
        ReadyEvent,
        TokenEvent,
        DoneEvent,
        ErrorEvent,
        OpenedEvent,
        ClosedEvent,
        ResetEvent,
        PongEvent,
        InfoEvent,
        StatsEvent,
        TokensEvent,
        TextEvent,
    )
}
"""event tag -> event class. Each event's payload key is named like its tag."""
