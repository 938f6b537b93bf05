"""`GET /health` (200 only when a generate could be served now) and `GET /metrics` (Prometheus)."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import APIError
from ..http import endpoint, json_response
from ..metrics import CONTENT_TYPE
from ..state import Server


async def health(server: Server, request: Request) -> Response:
    try:
        client, _ = server.ready()
    except APIError as error:
        return json_response({"status": error.code, "message": error.message}, 503)
    try:
        stats = await asyncio.wait_for(client.stats(), 10)
    except Exception as exc:
        message = "no stats answer in 10 s" if isinstance(exc, asyncio.TimeoutError) else None
        message = message or getattr(exc, "code", None) or "the supervisor did not answer"
        return json_response({"status": "unavailable", "message": message}, 503)
    workers = stats.get("workers")
    ready = [w for w in workers if w.get("state") == "ready"] if isinstance(workers, list) else []
    live = len(ready) if isinstance(workers, list) else 1
    if live == 0:
        return json_response({"status": "no_live_worker", "workers": 0}, 503)
    max_queue = server.config.max_queue
    if max_queue is not None and ready and all(w.get("queue_depth", 0) >= max_queue for w in ready):
        # Every generate would be refused `overloaded` now: not healthy, though alive.
        return json_response({"status": "overloaded", "workers": live}, 503)
    return json_response({"status": "ok", "workers": live})


async def metrics(server: Server, request: Request) -> Response:
    gauges: dict[str, float] = {}
    if server.client is not None:
        with contextlib.suppress(Exception):
            stats = await asyncio.wait_for(server.client.stats(), 10)
            workers = stats.get("workers") or []
            gauges = {
                "active_requests": stats.get("active_requests", 0),
                "queued_requests": stats.get("queued_requests", 0),
                "queue_depth": sum(w.get("queue_depth", 0) for w in workers),
                "live_workers": sum(1 for w in workers if w.get("state") == "ready"),
                "worker_restarts_total": sum(w.get("restarts", 0) for w in workers),
                "sessions": stats.get("sessions", 0),
            }
    gauges["model_ready"] = 1 if server.model is not None else 0
    return Response(server.metrics.render(gauges), media_type=CONTENT_TYPE)


def routes(server: Server) -> list[Route]:
    return [
        Route("/health", endpoint(server, "health", health), methods=["GET"]),
        Route("/metrics", endpoint(server, "metrics", metrics), methods=["GET"]),
    ]
