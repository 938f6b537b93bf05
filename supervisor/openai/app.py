"""The ASGI app of `tokenpipe serve`: OpenAI routes over the supervisor client API.

`Server` (state.py) owns the client, the model's template and tool format, the remembered
assistant turns and the metrics; the route modules under `routes/` read it. Every generation
runs as `client.generate(...)` inside a task that also watches the HTTP connection: when the
client goes away the generator is closed, which cancels the request in the worker at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .browser import BrowserGuard
from .errors import error_body
from .routes import chat, completions, health_metrics, models, sessions, tokenize
from .state import GenerateClient, ModelState, Server, ServerConfig

__all__ = ["GenerateClient", "ModelState", "Server", "ServerConfig", "create_app"]


async def _not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    code = "not_found" if status == 404 else "method_not_allowed"
    return JSONResponse(
        error_body(f"{request.method} {request.url.path}: {code}", "invalid_request_error", code),
        status_code=status,
    )


def create_app(server: Server) -> Starlette:
    """The Starlette app; its lifespan starts and stops `server`."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    routes = [
        *chat.routes(server),
        *completions.routes(server),
        *models.routes(server),
        *health_metrics.routes(server),
        *tokenize.routes(server),
        *sessions.routes(server),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_found}
    )
    config = server.config
    app.add_middleware(
        BrowserGuard,
        guard=config.api_key is None,
        bind_host=config.bind_host,
        allow_origins=config.allow_origins,
    )
    return app
