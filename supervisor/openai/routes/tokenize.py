"""`POST /tokenize` (a prompt, or messages rendered by the chat template) and `POST /detokenize`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import invalid_value
from ..http import endpoint, json_response, read_body
from ..prepare import prepare_detokenize, prepare_tokenize
from ..state import Server


async def tokenize(server: Server, request: Request) -> Response:
    body = await read_body(request, server.config.max_body_bytes, server.config.body_timeout_s)
    client, model = server.ready()
    text, add_prefix = await server.prepare(prepare_tokenize, body, model.template)
    tokens = await client.tokenize(text, add_prefix=add_prefix)
    return json_response(
        {"tokens": tokens, "count": len(tokens), "max_model_len": model.context_length}
    )


async def detokenize(server: Server, request: Request) -> Response:
    body = await read_body(request, server.config.max_body_bytes, server.config.body_timeout_s)
    client, _ = server.ready()
    tokens = await server.prepare(prepare_detokenize, body)
    try:
        text = await client.detokenize(tokens)
    except Exception as exc:
        raise invalid_value(str(exc), "tokens") from exc
    return json_response({"prompt": text})


def routes(server: Server) -> list[Route]:
    return [
        Route("/tokenize", endpoint(server, "tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(server, "detokenize", detokenize), methods=["POST"]),
    ]
