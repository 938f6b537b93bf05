"""What every route shares: JSON responses, reading a JSON body under the size limit, and the
endpoint wrapper (API key, errors as the OpenAI envelope, request metrics)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .disconnect import ClientGone
from .errors import APIError, from_worker_error, invalid_value
from .params import TOO_DEEP
from .state import Server

log = logging.getLogger("tokenpipe.serve")

UNAUTHENTICATED_PATHS = ("/health", "/metrics")

Handler = Callable[[Server, Request], Awaitable[Response]]


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def error_response(error: APIError) -> Response:
    return json_response(error.body(), error.status)


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` (declared or streamed), and
    with 408 when it has not fully arrived within `timeout_s`."""
    try:
        return await asyncio.wait_for(_read_body(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408, "request_timeout", f"the request body did not arrive within {timeout_s:g} s"
        ) from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, "request_too_large", f"the request body exceeds {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, "request_too_large", f"the request body exceeds {limit} bytes")
    return bytes(body)


def authorize(server: Server, request: Request) -> None:
    api_key = server.config.api_key
    if api_key is None or request.url.path in UNAUTHENTICATED_PATHS:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    ):
        raise APIError(401, "invalid_api_key", "Incorrect or missing API key")


def endpoint(
    server: Server, name: str, handler: Handler
) -> Callable[[Request], Awaitable[Response]]:
    """`handler` as a starlette endpoint: authorized, every failure a JSON error, counted."""

    async def wrapped(request: Request) -> Response:
        try:
            authorize(server, request)
            response = await handler(server, request)
        except APIError as error:
            response = error_response(error)
        except ClientGone:
            server.metrics.cancelled += 1
            response = Response(status_code=499)
        except RecursionError:
            response = error_response(invalid_value(TOO_DEEP))
        except Exception as exc:  # never leak a traceback as a non-JSON 500
            code = getattr(exc, "code", None)  # a client TokenpipeError carries its code
            if isinstance(code, str):
                response = error_response(
                    from_worker_error(code, getattr(exc, "message", str(exc)))
                )
            else:
                log.exception("internal error in %s", name)  # the text stays in the log
                response = error_response(
                    APIError(500, "internal_error", "internal error; see the server log")
                )
        server.metrics.count_request(name, response.status_code)
        return response

    return wrapped


def count_cancel(server: Server) -> None:
    server.metrics.cancelled += 1
