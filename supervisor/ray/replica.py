"""One Ray Serve replica: a tokenpipe supervisor (and its workers) in the replica's process,
with `tokenpipe serve`'s OpenAI app over it.

Callers reach it, all by the session rules of `router.SessionAffinityRouter`:
- directly (the default data path; endpoints.py): the OpenAI app on the replica's own HTTP
  port (the HTTP front end, http_front.py), and `generate`, `session_op`, `call`, `cancel` on
  its JSONL port (the JSONL front end, front.py); both ports are published in the metadata;
- through Serve (`ray up --via-serve`): `__call__(request)`, an HTTP request from Serve's
  proxy (the deployment is the HTTP ingress; ingress.py), and `asgi(scope, body)`, one HTTP
  request forwarded by another replica that got a request for a session it does not hold;
- `ready_info`, through Serve: the ready line (front ends, tests).

A named session this replica has not seen (its holder died, or the ring moved it here) is
opened on first use; when the caller mirrors ids for it, they are prefilled first (`resident`),
so the conversation resumes warm on its new replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from protocol import ErrorCode, ErrorEvent
from supervisor.client import AsyncClient, TokenpipeError
from supervisor.config import session_root
from supervisor.core import SupervisorConfig
from supervisor.mirror import rebuild_request
from supervisor.openai.app import Server, ServerConfig, create_app
from supervisor.openai.cli import turns_dir
from supervisor.openai.sessions import TurnStore
from supervisor.openai.turn_files import TurnFiles
from supervisor.session_dirs import split_session_dir

from .affinity import http_session_key, session_digest
from .asgi_bridge import Message, run_asgi
from .endpoints import NEED_RESIDENT, JsonlPort, error_event, serve_http
from .ingress import LocalResponse, forward, read_body, routed_session

log = logging.getLogger("tokenpipe.ray")

__all__ = ["NEED_RESIDENT", "TokenpipeReplica", "error_event", "replica_config"]

DRAIN_S = 25.0  # direct requests in flight at shutdown (Serve's graceful timeout is 30 s)


def replica_config(supervisor: SupervisorConfig, rank: int | None, tag: str) -> SupervisorConfig:
    """The replica's supervisor: with --session-dir, a directory of its own per rank
    (`<root>/rank-<r>`; Ray gives a replacement its predecessor's rank, so it finds the
    sessions its predecessor saved), which its supervisor splits per worker."""
    root = session_root(supervisor)
    if root is None:
        return supervisor
    _, worker_args = split_session_dir(supervisor.worker_args)
    mine = Path(root) / (f"rank-{rank}" if rank is not None else f"replica-{tag}")
    return replace(supervisor, session_dir=str(mine), worker_args=worker_args)


class TokenpipeReplica:
    """The Serve deployment class (options are set in app.py)."""

    async def __init__(
        self, supervisor: SupervisorConfig, server: ServerConfig, direct_http: bool = False
    ) -> None:
        """`direct_http`: also serve the OpenAI app on an HTTP port of its own (for the
        direct HTTP front end); the JSONL port is always open."""
        import ray
        from ray import serve

        context = serve.get_replica_context()
        self._rank = int(context.rank.rank) if context.rank is not None else None
        self._tag = context.replica_id.unique_id
        supervisor = replica_config(supervisor, self._rank, self._tag)

        async def start_client() -> AsyncClient:
            return await AsyncClient.in_process(supervisor)

        turns = TurnStore()
        if supervisor.session_dir is not None:
            files = TurnFiles(turns_dir(supervisor.session_dir), turns.max_turns)
            turns = TurnStore(files=files)
        self._server = Server(server, start_client, turns=turns)
        await self._server.start()
        await self._server.wait_ready()
        if self._server.load_error is not None:
            raise RuntimeError(f"tokenpipe replica failed to start: {self._server.load_error}")
        client = self._server.client
        assert isinstance(client, AsyncClient)
        self._client = client
        self._app = create_app(self._server)  # its lifespan is not run: the server is started
        # named sessions opened here by protocol callers, or restored from --session-dir
        restored = client.ready_info.get("restored_sessions") or []
        self._sessions: set[str] = set(restored)
        self._replicas: Any = None  # a streaming handle on this deployment, for forwarding
        self._forwarded = 0  # HTTP requests sent on to the replica of their session
        self._saved = [session_digest(s) for s in restored]
        # the direct data path: the front ends connect here (published in the metadata)
        host = ray.util.get_node_ip_address()
        self._secret = secrets.token_hex(16)
        self._jsonl = JsonlPort(self, self._secret)
        await self._jsonl.start(host)
        self._stop_http: Any = None
        self._http = ""
        if direct_http:
            self._stop_http, self._http = await serve_http(self._app, host, self._secret)
        log.info(
            "tokenpipe replica %s (rank %s) ready on jsonl %s http %s, %d session(s) restored",
            self._tag,
            self._rank,
            self._jsonl.address,
            self._http or "-",
            len(restored),
        )

    # -- what Ray Serve asks

    def record_replica_metadata(self) -> dict[str, Any]:
        """Read once, when the replica is up: its ring name, the sessions its --session-dir
        held (the router sends those here), its direct endpoints ("host:port") and the
        secret they want."""
        return {
            "rank": self._rank,
            "pid": os.getpid(),
            "sessions": self._saved,
            "jsonl": self._jsonl.address,
            "http": self._http,
            "secret": self._secret,
        }

    async def __del__(self) -> None:
        """Scaled down or redeployed: Serve stopped routing here; the direct front ends drop
        this replica when the controller's list reaches them. Finish what they sent (uvicorn
        waits for its requests), then stop the supervisor."""
        draining = [self._jsonl.drain(DRAIN_S)]
        if self._stop_http is not None:
            draining.append(self._stop_http(DRAIN_S))
        await asyncio.gather(*draining)
        await self._server.stop()

    # -- HTTP

    async def __call__(self, request: Request) -> Response:
        """An OpenAI request from Serve's proxy (this deployment is the HTTP ingress): run
        here, or forwarded to the replica of the session it names (ingress.py)."""
        body = await read_body(request, self._server.config.max_body_bytes)
        if isinstance(body, Response):
            return body
        session = http_session_key(request.headers, body)
        if session and session != routed_session():
            self._forwarded += 1
            if self._replicas is None:
                from .app import replica_handle

                self._replicas = replica_handle().options(stream=True)
            return await forward(self._replicas, request.scope, body, session)
        return LocalResponse(self._app, body)

    async def asgi(
        self, scope: dict[str, Any], body: bytes, session_key: str | None = None
    ) -> AsyncIterator[list[Message]]:
        async for messages in run_asgi(self._app, scope, body):
            yield messages

    # -- protocol requests (the JSONL front end)

    async def ready_info(self, session_key: str | None = None) -> dict[str, Any]:
        """The supervisor's ready line and which replica this is (`session_key`: the router
        picks the replica holding that session)."""
        return {
            **self._client.ready_info,
            "replica": self._tag,
            "rank": self._rank,
            "pid": os.getpid(),
            "http_forwarded": self._forwarded,
        }

    async def generate(
        self,
        request: dict[str, Any],
        session_key: str | None = None,
        mirrored: int = 0,
        resident: list[int] | None = None,
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The request's events as dicts, in batches (every event already in: one stream
        item each, not one per token). `mirrored`: how many resident ids the caller holds
        for the session; `resident`: those ids, sent after this replica asked for them."""
        session = request.get("session_id")
        if session and session not in self._sessions:
            if mirrored and resident is None:
                yield [{"event": NEED_RESIDENT, "replica": self._tag}]
                return
            problem = await self._adopt(session, resident)
            if problem is not None:
                yield [{**problem, "id": request.get("id")}]
                return
        async with contextlib.aclosing(self._client.generate_batches(request)) as batches:
            async for batch in batches:
                yield batch

    async def _adopt(self, session: str, resident: list[int] | None) -> dict[str, Any] | None:
        """Open `session` here and prefill its mirrored ids; an error event if it cannot."""
        try:
            await self._client.open_session(session)
        except TokenpipeError as exc:
            return error_event(exc.code, exc.message, session_id=session)
        self._sessions.add(session)
        if resident:
            async for event in self._client.generate(rebuild_request(session, resident)):
                if isinstance(event, ErrorEvent):
                    log.warning("rebuilding session %r failed: %s", session, event)
        return None

    async def cancel(self, request_id: str, session_key: str | None = None) -> None:
        """Cancel a request of this replica (its stream ends with a cancelled `done`)."""
        await self._client.cancel(request_id)

    async def session_op(self, request: dict[str, Any], session_key: str) -> dict[str, Any]:
        """`open`, `close` or `reset` of a named session."""
        session = str(request.get("session_id"))
        try:
            answer = await self._client.request(request)
        except TokenpipeError as exc:
            return error_event(exc.code, exc.message, op=request.get("op"), session_id=session)
        if request.get("op") == "close":
            self._sessions.discard(session)
        else:
            self._sessions.add(session)
        return answer

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """A single-answer request (`info`, `stats`, `tokenize`, `detokenize`, `ping`)."""
        try:
            return await self._client.request(request)
        except TokenpipeError as exc:
            return error_event(exc.code, exc.message, op=request.get("op"))
        except Exception as exc:  # the caller gets a protocol line, never a Ray traceback
            return error_event(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
