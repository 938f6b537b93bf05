"""`GET /v1/models`: the one model this server serves."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..http import endpoint, json_response
from ..state import Server


async def models(server: Server, request: Request) -> Response:
    _, model = server.ready()
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": model.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tokenpipe",
                    "max_model_len": model.context_length,
                }
            ],
        }
    )


def routes(server: Server) -> list[Route]:
    return [Route("/v1/models", endpoint(server, "models", models), methods=["GET"])]
