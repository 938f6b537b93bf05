"""`POST /v1/sessions/{id}/reset` and `DELETE /v1/sessions/{id}`: a named session's KV and
its remembered turns."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import APIError
from ..http import endpoint, json_response
from ..params import validate_session_id
from ..state import Server


async def session_reset(server: Server, request: Request) -> Response:
    client, _ = server.ready()
    session = validate_session_id(request.path_params["session_id"])
    server.turns.forget(session)
    try:
        await client.reset_session(session)
    except Exception as exc:
        if getattr(exc, "code", "") != "unknown_session":
            raise
    return json_response({"id": session, "object": "session", "reset": True})


async def session_delete(server: Server, request: Request) -> Response:
    client, _ = server.ready()
    session = validate_session_id(request.path_params["session_id"])
    server.turns.forget(session)
    server.open_sessions.pop(session, None)
    try:
        await client.close_session(session)
    except Exception as exc:
        if getattr(exc, "code", "") != "unknown_session":
            raise
        raise APIError(404, "unknown_session", f"no open session {session!r}") from exc
    return json_response({"id": session, "object": "session.deleted", "deleted": True})


def routes(server: Server) -> list[Route]:
    return [
        Route(
            "/v1/sessions/{session_id:path}/reset",
            endpoint(server, "session_reset", session_reset),
            methods=["POST"],
        ),
        Route(
            "/v1/sessions/{session_id:path}",
            endpoint(server, "session_delete", session_delete),
            methods=["DELETE"],
        ),
    ]
