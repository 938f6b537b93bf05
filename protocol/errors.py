"""The stable error codes of the wire protocol.

Every `error` line carries one of these in its `code` field. Codes never change meaning and
are never removed; new ones may be added, so clients must treat an unknown code like
`internal_error`. `ERROR_CODES` maps each code to its one-line meaning (docs/protocol.md is
written from it).
"""

from __future__ import annotations

from typing import Final


class ErrorCode:
    """String constants for the `code` field of an `error` event."""

    # The line itself (codec).
    INVALID_JSON: Final = "invalid_json"
    INVALID_UTF8: Final = "invalid_utf8"
    INVALID_REQUEST: Final = "invalid_request"
    UNKNOWN_OP: Final = "unknown_op"
    LINE_TOO_LONG: Final = "line_too_long"
    # Sessions and ids (worker, supervisor).
    CAPACITY_EXHAUSTED: Final = "capacity_exhausted"
    UNSUPPORTED_SESSION: Final = "unsupported_session"
    UNKNOWN_SESSION: Final = "unknown_session"
    SESSION_BUSY: Final = "session_busy"
    SESSION_POISONED: Final = "session_poisoned"
    DUPLICATE_ID: Final = "duplicate_id"
    UNKNOWN_ID: Final = "unknown_id"
    # The prompt (worker).
    CONTEXT_LENGTH_EXCEEDED: Final = "context_length_exceeded"
    EMPTY_PROMPT: Final = "empty_prompt"
    INVALID_TOKEN_ID: Final = "invalid_token_id"
    TEMPLATE_ERROR: Final = "template_error"
    UNSATISFIABLE_CONSTRAINT: Final = "unsatisfiable_constraint"
    # The process (worker, supervisor).
    OVERLOADED: Final = "overloaded"
    WORKER_LOST: Final = "worker_lost"
    OUT_OF_MEMORY: Final = "out_of_memory"
    INTERNAL_ERROR: Final = "internal_error"
    SHUTTING_DOWN: Final = "shutting_down"


# `capacity_exhausted`'s message where there is nothing to close: a worker with one slot keeps it
# for requests without a session_id (the worker and the supervisor's router both send it).
NO_NAMED_SESSIONS: Final = (
    "no named sessions here: --max-sessions 1 keeps each worker's one slot for requests "
    "without a session_id; start it with --max-sessions 2 or more"
)


# code -> one-line meaning, in the order docs/protocol.md lists them.
ERROR_CODES: Final[dict[str, str]] = {
    ErrorCode.INVALID_JSON: "The line is not one valid JSON value (NaN and Infinity are not JSON).",
    ErrorCode.INVALID_UTF8: "The line is not valid UTF-8.",
    ErrorCode.INVALID_REQUEST: (
        "The JSON is valid but the request is not: a missing, unknown or wrong-typed field, "
        "or a value out of range; the message names the field."
    ),
    ErrorCode.UNKNOWN_OP: "The `op` field names no operation this protocol knows.",
    ErrorCode.LINE_TOO_LONG: "The line is longer than the receiver's limit (1 MiB by default).",
    ErrorCode.CAPACITY_EXHAUSTED: (
        "Every session slot is taken; close a named session or retry later."
    ),
    ErrorCode.UNSUPPORTED_SESSION: (
        "The session operation is not supported here (e.g. naming the scratch session)."
    ),
    ErrorCode.UNKNOWN_SESSION: (
        "Reserved: `close` and `reset` of a session that is not open succeed (idempotent)."
    ),
    ErrorCode.SESSION_BUSY: "Reserved: current workers queue a busy session's requests instead.",
    ErrorCode.SESSION_POISONED: (
        "An earlier failure left the session's cache unusable; send `reset` first."
    ),
    ErrorCode.DUPLICATE_ID: "A request with this `id` is still in flight.",
    ErrorCode.UNKNOWN_ID: "`cancel` named an `id` that is unknown or already finished.",
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (
        "The prompt (plus the session's kept tokens) does not fit the context length."
    ),
    ErrorCode.EMPTY_PROMPT: "The prompt encodes to zero tokens.",
    ErrorCode.INVALID_TOKEN_ID: "A token id is not below the model's vocabulary size.",
    ErrorCode.TEMPLATE_ERROR: (
        "`messages` could not be rendered: no chat template, or the template raised."
    ),
    ErrorCode.UNSATISFIABLE_CONSTRAINT: (
        "The structured-output constraint compiles, but no output can satisfy it; the message "
        "says why. Nothing was generated or changed."
    ),
    ErrorCode.OVERLOADED: "The request queue is full; retry later.",
    ErrorCode.WORKER_LOST: (
        "The worker serving the request died after part of its output was sent; the request "
        "was not completed (one with no output sent yet is run again, once)."
    ),
    ErrorCode.OUT_OF_MEMORY: "The device ran out of memory serving the request.",
    ErrorCode.INTERNAL_ERROR: "An unexpected failure inside the server; the message says more.",
    ErrorCode.SHUTTING_DOWN: "The process is shutting down and accepts no new requests.",
}
