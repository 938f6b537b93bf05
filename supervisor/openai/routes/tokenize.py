"""`POST /tokenize` (a prompt, or messages rendered by the chat template) and `POST /detokenize`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import APIError, invalid_value
from ..http import endpoint, json_response, read_json
from ..params import normalize_messages
from ..state import Server
from ..templates import ChatTemplateError


async def tokenize(server: Server, request: Request) -> Response:
    body = await read_json(request, server.config.max_body_bytes)
    client, model = server.ready()
    if not isinstance(body, dict):
        raise invalid_value("the request body must be a JSON object")
    add_prefix = body.get("add_special_tokens", body.get("add_prefix", True))
    if not isinstance(add_prefix, bool):
        raise invalid_value("'add_special_tokens' must be a boolean")
    if "messages" in body:
        try:
            text = model.template.render(
                normalize_messages(body["messages"]), tools=body.get("tools")
            )
        except ChatTemplateError as exc:
            raise APIError(400, "template_error", str(exc)) from exc
    else:
        prompt = body.get("prompt", body.get("text"))
        if not isinstance(prompt, str):
            raise invalid_value("'prompt' must be a string", "prompt")
        text = prompt
    tokens = await client.tokenize(text, add_prefix=add_prefix)
    return json_response(
        {"tokens": tokens, "count": len(tokens), "max_model_len": model.context_length}
    )


async def detokenize(server: Server, request: Request) -> Response:
    body = await read_json(request, server.config.max_body_bytes)
    client, _ = server.ready()
    tokens = body.get("tokens", body.get("ids")) if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise invalid_value("'tokens' must be a list of token ids", "tokens")
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
