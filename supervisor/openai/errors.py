"""The OpenAI error envelope: `{"error": {"message", "type", "code", "param"}}`."""

from __future__ import annotations

from typing import Any

# HTTP status -> OpenAI error `type`.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request failure that becomes an HTTP error response with the OpenAI envelope."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        return _TYPE_BY_STATUS.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.code, self.param)


def error_body(
    message: str, error_type: str, code: str, param: str | None = None
) -> dict[str, Any]:
    """The JSON body of an error response (also the payload of a mid-stream SSE error)."""
    return {"error": {"message": message, "type": error_type, "code": code, "param": param}}


def invalid_value(message: str, param: str | None = None) -> APIError:
    return APIError(400, "invalid_value", message, param=param)


def unsupported(message: str, param: str | None = None) -> APIError:
    return APIError(400, "unsupported_parameter", message, param=param)


# Worker/supervisor error code -> HTTP status for errors that end a request before any output.
WORKER_CODE_STATUS = {
    "context_length_exceeded": 400,
    "invalid_request": 400,
    "invalid_token_id": 400,
    "empty_prompt": 400,
    "template_error": 400,
    "unsatisfiable_constraint": 400,
    "capacity_exhausted": 429,
    "overloaded": 429,
    "session_busy": 409,
    "unknown_session": 404,
    "shutting_down": 503,
    "worker_lost": 503,
    "unavailable": 503,  # no worker is running (restarting, or failed to start)
    "out_of_memory": 503,
    "line_too_long": 400,
    "invalid_json": 400,
    "invalid_utf8": 400,
}


def from_worker_error(code: str, message: str) -> APIError:
    """An `APIError` for a worker `error` event that arrived before any output. A code
    without a client-side meaning is a 500 whose message names only the code (the worker's
    text, which may hold an exception's, stays in its log)."""
    status = WORKER_CODE_STATUS.get(code, 500)
    if status == 500:
        message = f"the request failed in the worker ({code})"
    return APIError(status, code, message)
