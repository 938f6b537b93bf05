"""The ASGI app of `tokenpipe serve`: OpenAI routes over the supervisor client API.

One `Server` owns the client (started in the background so `/health` answers 503 while the
model loads), the model's chat template and tool format, the remembered assistant turns
and the metrics. Every generation runs as `client.generate(...)` inside a task that also
watches the HTTP connection: when the client goes away the generator is closed, which
cancels the request in the worker at once, whether it is prefilling or decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from protocol import DoneEvent, ErrorEvent, Event, TokenEvent

from . import chunks as ch
from .errors import APIError, error_body, from_worker_error, invalid_value
from .metrics import CONTENT_TYPE, Metrics
from .params import (
    SamplingParams,
    check_model,
    normalize_messages,
    parse_chat,
    parse_completion,
    validate_session_id,
)
from .sessions import (
    PromptSegmentDict,
    TurnStore,
    render_prompt,
    session_from_request,
    spliceable_turns,
    turn_fingerprint,
)
from .templates import ChatTemplate, ChatTemplateError, builtin_template, model_family
from .tool_parsers import (
    FORMATS,
    REASONING_MARKERS,
    OutputParser,
    Piece,
    default_tool_format,
    tool_schemas,
)

log = logging.getLogger("tokenpipe.serve")

MAX_BODY_BYTES = 8 << 20
UNAUTHENTICATED_PATHS = ("/health", "/metrics")


class GenerateClient(Protocol):
    """The part of `supervisor.client.AsyncClient` the server uses."""

    def generate(self, request: dict[str, Any]) -> AsyncIterator[Event]: ...
    async def info(self) -> dict[str, Any]: ...
    async def stats(self) -> dict[str, Any]: ...
    async def tokenize(self, text: str, add_prefix: bool = False) -> list[int]: ...
    async def detokenize(self, ids: list[int]) -> str: ...
    async def open_session(self, session_id: str) -> None: ...
    async def close_session(self, session_id: str) -> None: ...
    async def reset_session(self, session_id: str) -> None: ...
    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class ServerConfig:
    """What `tokenpipe serve` adds on top of the supervisor's own flags."""

    model_id: str | None = None
    api_key: str | None = None
    chat_template: str | None = None  # template source overriding the model's
    tool_parser: str | None = None  # gemma4 | hermes | qwen; default: the model family's
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.tool_parser is not None and self.tool_parser not in FORMATS:
            raise ValueError(f"tool parser must be one of {sorted(FORMATS)}")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")


@dataclass(frozen=True)
class ModelState:
    """What the server derives once from the model's `info`."""

    model_id: str
    context_length: int
    template: ChatTemplate
    tool_format: str
    reasoning: tuple[str, str, str] | None
    marker_ids: dict[int, str]  # special-token id -> markup text, re-inserted into the stream
    info: dict[str, Any]


def model_id_from_info(info: dict[str, Any]) -> str:
    name = str(info.get("model") or "tokenpipe")
    base = os.path.basename(name.rstrip("/")) or name
    return base.removesuffix(".gguf")


async def load_model_state(client: GenerateClient, config: ServerConfig) -> ModelState:
    info = await client.info()
    family = model_family(str(info.get("architecture") or info.get("model_type") or ""))
    source = config.chat_template or info.get("chat_template") or builtin_template(family)
    prefix_ids = info.get("prefix_ids") or []
    bos_id = info.get("bos_id")
    template = ChatTemplate(
        source=source,
        bos_token=info.get("bos_token"),
        eos_token=info.get("eos_token"),
        strip_bos=bool(prefix_ids) and (bos_id is None or bos_id in prefix_ids),
    )
    tool_format = config.tool_parser or default_tool_format(family)
    reasoning = REASONING_MARKERS.get(family)
    markers = [m for pair in FORMATS[tool_format].markers for m in pair]
    if reasoning is not None:
        markers += [reasoning[0], reasoning[1]]
    marker_ids: dict[int, str] = {}
    for marker in markers:
        ids = await client.tokenize(marker)
        if len(ids) == 1:
            marker_ids[ids[0]] = marker
    return ModelState(
        model_id=config.model_id or model_id_from_info(info),
        context_length=int(info.get("context_length") or 0),
        template=template,
        tool_format=tool_format,
        reasoning=reasoning,
        marker_ids=marker_ids,
        info=info,
    )


def event_text(event: TokenEvent, marker_ids: dict[int, str]) -> str:
    """The event's text with markup tokens the worker renders as nothing put back in.

    A token event's text is complete UTF-8 and may stand for several ids; a markup token
    (e.g. Gemma 4's `<|tool_call>`) that contributed no text is appended after the text,
    which is exact whenever markup arrives in an event of its own or last in one."""
    text = event.token
    for token_id in event.token_ids or ():
        marker = marker_ids.get(token_id)
        if marker is not None and marker not in text:
            text += marker
    return text


# ------------------------------------------------------------------------- disconnects


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


T = TypeVar("T")


async def race_disconnect(awaitable: Awaitable[T], receive: Receive) -> T:
    """Await `awaitable` unless the HTTP client disconnects first (then cancel it and raise
    `ClientGone`)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


class EventStreamResponse(Response):
    """`text/event-stream` whose producer is cancelled the moment the client disconnects
    (starlette's StreamingResponse only notices at the next write on ASGI 2.4)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        self.body_iterator = body
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if producer in done:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            with contextlib.suppress(OSError):
                producer.result()
            return
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await producer
        with contextlib.suppress(Exception):
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        self.on_disconnect()


# ------------------------------------------------------------------------------ server


@dataclass
class Generation:
    """One generate request in flight: its events, with TTFT/ITL timing and usage."""

    events: AsyncIterator[Event]
    started: float
    metrics: Metrics
    last_token_at: float | None = None
    done: DoneEvent | None = None

    async def next_event(self) -> Event | None:
        try:
            event = await self.events.__anext__()
        except StopAsyncIteration:
            return None
        if isinstance(event, TokenEvent):
            now = time.monotonic()
            if self.last_token_at is None:
                self.metrics.ttft.observe(now - self.started)
            else:
                self.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
        elif isinstance(event, DoneEvent):
            self.done = event
            self.metrics.count_tokens(
                event.prompt_tokens, event.completion_tokens, event.reused_prompt_tokens
            )
        return event

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.events.aclose()  # type: ignore[attr-defined]


def usage_of(done: DoneEvent) -> dict[str, Any]:
    return ch.usage_body(done.prompt_tokens, done.completion_tokens, done.reused_prompt_tokens)


@dataclass
class Server:
    """The app's state. `client_factory` starts the supervisor (or a fake in unit tests)."""

    config: ServerConfig
    client_factory: Callable[[], Awaitable[GenerateClient]]
    client: GenerateClient | None = None
    model: ModelState | None = None
    load_error: str | None = None
    turns: TurnStore = field(default_factory=TurnStore)
    metrics: Metrics = field(default_factory=Metrics)
    open_sessions: OrderedDict[str, int] = field(default_factory=OrderedDict)  # id -> users
    _loader: asyncio.Task[None] | None = None

    # -- lifecycle

    async def start(self) -> None:
        self._loader = asyncio.ensure_future(self._load())

    async def _load(self) -> None:
        try:
            client = await self.client_factory()
            self.client = client
            self.model = await load_model_state(client, self.config)
            log.info("serving %s (context %d)", self.model.model_id, self.model.context_length)
        except Exception as exc:  # reported by /health and every request
            log.exception("tokenpipe serve: the model failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"

    async def wait_ready(self) -> None:
        if self._loader is not None:
            await self._loader

    async def stop(self) -> None:
        if self._loader is not None and not self._loader.done():
            self._loader.cancel()
            with contextlib.suppress(BaseException):
                await self._loader
        if self.client is not None:
            await self.client.aclose()

    def ready(self) -> tuple[GenerateClient, ModelState]:
        if self.client is None or self.model is None:
            message = self.load_error or "the model is still loading"
            raise APIError(
                503, "model_loading" if self.load_error is None else "load_failed", message
            )
        return self.client, self.model

    # -- sessions

    async def _events(self, request: dict[str, Any]) -> AsyncIterator[Event]:
        """`client.generate`, opening the named session on first use and making room (by
        closing the least recently used idle session this server opened) when full."""
        client, _ = self.ready()
        session = request.get("session_id")
        for attempt in range(3):
            retry = False
            async with _closing(client.generate(dict(request))) as events:
                first = True
                async for event in events:
                    if first and isinstance(event, ErrorEvent) and session and attempt < 2:
                        if event.code == "unknown_session":
                            await self._open(session)
                            retry = True
                            break
                        if event.code == "capacity_exhausted" and await self._evict(session):
                            retry = True
                            break
                    first = False
                    yield event
            if not retry:
                return

    async def _open(self, session: str) -> None:
        client, _ = self.ready()
        for _ in range(2):
            try:
                await client.open_session(session)
                return
            except Exception as exc:
                code = getattr(exc, "code", "")
                if code == "capacity_exhausted" and await self._evict(session):
                    continue
                if code in ("", "capacity_exhausted"):
                    raise
                return  # e.g. already open: generate will tell

    async def _evict(self, keep: str) -> bool:
        client, _ = self.ready()
        for victim, users in list(self.open_sessions.items()):
            if victim != keep and users == 0:
                del self.open_sessions[victim]
                self.turns.forget(victim)
                with contextlib.suppress(Exception):
                    await client.close_session(victim)
                log.info("closed idle session %r to make room", victim)
                return True
        return False

    @contextlib.contextmanager
    def _using(self, session: str | None) -> Any:
        if session:
            self.open_sessions[session] = self.open_sessions.get(session, 0) + 1
            self.open_sessions.move_to_end(session)
        try:
            yield
        finally:
            if session and session in self.open_sessions:
                self.open_sessions[session] -= 1

    # -- prompts

    async def _overflow_error(self, segments: list[PromptSegmentDict], message: str) -> APIError:
        client, model = self.ready()
        count = 0
        try:
            for index, segment in enumerate(segments):
                if "ids" in segment:
                    count += len(segment["ids"])
                else:
                    count += len(await client.tokenize(segment["text"], add_prefix=index == 0))
        except Exception:
            return APIError(400, "context_length_exceeded", message)
        return APIError(
            400,
            "context_length_exceeded",
            f"The prompt ({count} tokens) exceeds the available context size "
            f"({model.context_length} tokens).",
            param="messages",
        )

    def generate_request(
        self,
        segments: list[PromptSegmentDict],
        sampling: SamplingParams,
        session: str | None,
        add_prefix: bool = True,
    ) -> dict[str, Any]:
        _, model = self.ready()
        request: dict[str, Any] = {
            "prompt_segments": segments,
            "add_prefix": add_prefix,
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "seed": sampling.seed,
            "stop": list(sampling.stop),
            "return_token_ids": bool(model.marker_ids),
        }
        if session:
            request["session_id"] = session
        return request

    async def start_generation(
        self, request: dict[str, Any], http: Request
    ) -> tuple[Generation, Event | None]:
        """Send the request and wait for its first event (raises `ClientGone` on disconnect
        and `APIError` when the worker refuses it before any output)."""
        generation = Generation(self._events(request), time.monotonic(), self.metrics)
        try:
            first = await race_disconnect(generation.next_event(), http.receive)
        except BaseException:
            await generation.aclose()
            raise
        if isinstance(first, ErrorEvent):
            await generation.aclose()
            if first.code == "context_length_exceeded":
                raise await self._overflow_error(request["prompt_segments"], first.error)
            raise from_worker_error(first.code, first.error)
        return generation, first

    def remember_turn(
        self, session: str | None, turn: ch.TurnAccumulator, done: DoneEvent | None
    ) -> None:
        if done is None or done.generated_token_ids is None or done.finish_reason == "cancelled":
            return
        message = turn.message()
        fingerprint = turn_fingerprint(message.get("content"), message.get("tool_calls"))
        self.turns.remember(session or "", fingerprint, done.generated_token_ids)


# ------------------------------------------------------------------------------ routes


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error_response(error: APIError) -> Response:
    return _json(error.body(), error.status)


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, "request_too_large", f"the request body exceeds {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, "request_too_large", f"the request body exceeds {limit} bytes")
    try:
        return orjson.loads(bytes(body))
    except orjson.JSONDecodeError as exc:
        raise invalid_value(f"the request body is not valid JSON: {exc}") from exc


def create_app(server: Server) -> Starlette:
    """The Starlette app; its lifespan starts and stops `server`."""
    config = server.config
    api_key = config.api_key.encode() if config.api_key else None

    def authorize(request: Request) -> None:
        if api_key is None or request.url.path in UNAUTHENTICATED_PATHS:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key):
            raise APIError(401, "invalid_api_key", "Incorrect or missing API key")

    def endpoint(
        name: str, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                authorize(request)
                response = await handler(request)
            except APIError as error:
                response = _error_response(error)
            except ClientGone:
                server.metrics.cancelled += 1
                response = Response(status_code=499)
            except Exception as exc:  # never leak a traceback as a non-JSON 500
                code = getattr(exc, "code", None)  # a client TokenpipeError carries its code
                if isinstance(code, str):
                    response = _error_response(
                        from_worker_error(code, getattr(exc, "message", str(exc)))
                    )
                else:
                    log.exception("internal error in %s", name)
                    response = _error_response(APIError(500, "internal_error", str(exc)))
            server.metrics.count_request(name, response.status_code)
            return response

        return wrapped

    # -- chat

    async def chat(request: Request) -> Response:
        params = parse_chat(await _read_json(request, config.max_body_bytes))
        _, model = server.ready()
        check_model(params.model, model.model_id)
        session = session_from_request(params.session_id, request.headers)
        try:
            rendered = render_prompt(
                model.template,
                params.messages,
                tools=params.tools,
                template_kwargs=params.template_kwargs,
                turn_ids=spliceable_turns(server.turns, session or "", params.messages),
            )
        except ChatTemplateError as exc:
            raise APIError(400, "template_error", str(exc)) from exc
        generate = server.generate_request(rendered.segments, params.sampling, session)
        parser = OutputParser(
            FORMATS[model.tool_format] if params.parse_tools else None,
            tool_schemas(params.tools),
            model.reasoning,
        )
        header = ch.ResponseHeader(ch.new_id("chatcmpl"), model.model_id)
        with server._using(session):
            generation, first = await server.start_generation(generate, request)
        if params.stream:
            return EventStreamResponse(
                chat_stream(generation, first, parser, header, params.include_usage, session),
                on_disconnect=lambda: _count_cancel(server),
            )
        return await race_disconnect(
            chat_whole(generation, first, parser, header, session), request.receive
        )

    async def collect(
        generation: Generation,
        first: Event | None,
        parser: OutputParser,
        model_markers: dict[int, str],
    ) -> AsyncIterator[tuple[list[Piece], ErrorEvent | None]]:
        """Parsed pieces per event; the last item carries the error, if one ended it."""
        event = first
        while event is not None:
            if isinstance(event, TokenEvent):
                yield parser.feed(event_text(event, model_markers)), None
            elif isinstance(event, ErrorEvent):
                yield parser.finish(), event
                return
            elif isinstance(event, DoneEvent):
                yield parser.finish(), None
                return
            event = await generation.next_event()
        yield parser.finish(), None

    async def chat_whole(
        generation: Generation,
        first: Event | None,
        parser: OutputParser,
        header: ch.ResponseHeader,
        session: str | None,
    ) -> Response:
        _, model = server.ready()
        turn = ch.TurnAccumulator()
        try:
            with server._using(session):
                async for pieces, error in collect(generation, first, parser, model.marker_ids):
                    for piece in pieces:
                        turn.add(piece)
                    if error is not None:
                        raise from_worker_error(error.code, error.error)
        finally:
            await generation.aclose()
        done = generation.done
        if done is None:
            raise APIError(500, "internal_error", "the generation ended without a result")
        server.remember_turn(session, turn, done)
        return _json(
            header.chat_body(turn.message(), turn.finish_reason(done.finish_reason), usage_of(done))
        )

    async def chat_stream(
        generation: Generation,
        first: Event | None,
        parser: OutputParser,
        header: ch.ResponseHeader,
        include_usage: bool,
        session: str | None,
    ) -> AsyncIterator[bytes]:
        _, model = server.ready()
        turn = ch.TurnAccumulator()
        try:
            with server._using(session):
                yield ch.sse(header.chat_chunk({"role": "assistant", "content": ""}))
                async for pieces, error in collect(generation, first, parser, model.marker_ids):
                    for piece in pieces:
                        delta = turn.add(piece)
                        if delta is not None:
                            yield ch.sse(header.chat_chunk(delta))
                    if error is not None:
                        api_error = from_worker_error(error.code, error.error)
                        yield ch.sse(api_error.body())
                        yield ch.SSE_DONE
                        return
                done = generation.done
                if done is None:
                    yield ch.sse(
                        error_body(
                            "the generation ended without a result",
                            "server_error",
                            "internal_error",
                        )
                    )
                    yield ch.SSE_DONE
                    return
                server.remember_turn(session, turn, done)
                yield ch.sse(header.chat_chunk({}, turn.finish_reason(done.finish_reason)))
                if include_usage:
                    yield ch.sse(header.usage_chunk("chat.completion.chunk", usage_of(done)))
                yield ch.SSE_DONE
        finally:
            await generation.aclose()

    # -- text completions

    async def completions(request: Request) -> Response:
        params = parse_completion(await _read_json(request, config.max_body_bytes))
        _, model = server.ready()
        check_model(params.model, model.model_id)
        session = session_from_request(params.session_id, request.headers)
        if isinstance(params.prompt, str):
            segments: list[PromptSegmentDict] = [{"text": params.prompt}]
            add_prefix = True
        else:
            segments, add_prefix = [{"ids": list(params.prompt)}], False
        generate = server.generate_request(segments, params.sampling, session, add_prefix)
        generate["return_token_ids"] = False
        header = ch.ResponseHeader(ch.new_id("cmpl"), model.model_id)
        with server._using(session):
            generation, first = await server.start_generation(generate, request)
        if params.stream:
            return EventStreamResponse(
                text_stream(generation, first, header, params.include_usage),
                on_disconnect=lambda: _count_cancel(server),
            )
        return await race_disconnect(text_whole(generation, first, header), request.receive)

    async def text_whole(
        generation: Generation, first: Event | None, header: ch.ResponseHeader
    ) -> Response:
        parts: list[str] = []
        event = first
        try:
            while event is not None:
                if isinstance(event, TokenEvent):
                    parts.append(event.token)
                elif isinstance(event, ErrorEvent):
                    raise from_worker_error(event.code, event.error)
                elif isinstance(event, DoneEvent):
                    break
                event = await generation.next_event()
        finally:
            await generation.aclose()
        done = generation.done
        if done is None:
            raise APIError(500, "internal_error", "the generation ended without a result")
        reason = "length" if done.finish_reason == "length" else "stop"
        return _json(header.text_body("".join(parts), reason, usage_of(done)))

    async def text_stream(
        generation: Generation,
        first: Event | None,
        header: ch.ResponseHeader,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        event = first
        try:
            while event is not None:
                if isinstance(event, TokenEvent):
                    if event.token:
                        yield ch.sse(header.text_chunk(event.token))
                elif isinstance(event, ErrorEvent):
                    yield ch.sse(from_worker_error(event.code, event.error).body())
                    yield ch.SSE_DONE
                    return
                elif isinstance(event, DoneEvent):
                    reason = "length" if event.finish_reason == "length" else "stop"
                    yield ch.sse(header.text_chunk("", reason))
                    if include_usage:
                        yield ch.sse(header.usage_chunk("text_completion", usage_of(event)))
                    yield ch.SSE_DONE
                    return
                event = await generation.next_event()
            yield ch.sse(
                error_body(
                    "the generation ended without a result", "server_error", "internal_error"
                )
            )
            yield ch.SSE_DONE
        finally:
            await generation.aclose()

    # -- the rest

    async def models(request: Request) -> Response:
        _, model = server.ready()
        return _json(
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

    async def health(request: Request) -> Response:
        try:
            client, _ = server.ready()
        except APIError as error:
            return _json({"status": error.code, "message": error.message}, 503)
        try:
            stats = await asyncio.wait_for(client.stats(), 10)
        except Exception as exc:
            return _json({"status": "unavailable", "message": str(exc)}, 503)
        workers = stats.get("workers")
        live = (
            sum(1 for w in workers if w.get("state") == "ready") if isinstance(workers, list) else 1
        )
        if live == 0:
            return _json({"status": "no_live_worker", "workers": 0}, 503)
        return _json({"status": "ok", "workers": live})

    async def metrics(request: Request) -> Response:
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

    async def tokenize(request: Request) -> Response:
        body = await _read_json(request, config.max_body_bytes)
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
        return _json(
            {"tokens": tokens, "count": len(tokens), "max_model_len": model.context_length}
        )

    async def detokenize(request: Request) -> Response:
        body = await _read_json(request, config.max_body_bytes)
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
        return _json({"prompt": text})

    async def session_reset(request: Request) -> Response:
        client, _ = server.ready()
        session = validate_session_id(request.path_params["session_id"])
        server.turns.forget(session)
        try:
            await client.reset_session(session)
        except Exception as exc:
            if getattr(exc, "code", "") != "unknown_session":
                raise
        return _json({"id": session, "object": "session", "reset": True})

    async def session_delete(request: Request) -> Response:
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
        return _json({"id": session, "object": "session.deleted", "deleted": True})

    routes = [
        Route("/v1/chat/completions", endpoint("chat", chat), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", completions), methods=["POST"]),
        Route("/v1/models", endpoint("models", models), methods=["GET"]),
        Route("/health", endpoint("health", health), methods=["GET"]),
        Route("/metrics", endpoint("metrics", metrics), methods=["GET"]),
        Route("/tokenize", endpoint("tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", endpoint("detokenize", detokenize), methods=["POST"]),
        Route(
            "/v1/sessions/{session_id:path}/reset",
            endpoint("session_reset", session_reset),
            methods=["POST"],
        ),
        Route(
            "/v1/sessions/{session_id:path}",
            endpoint("session_delete", session_delete),
            methods=["DELETE"],
        ),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        code = "not_found" if status == 404 else "method_not_allowed"
        return JSONResponse(
            error_body(
                f"{request.method} {request.url.path}: {code}", "invalid_request_error", code
            ),
            status_code=status,
        )

    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found}
    )


@contextlib.asynccontextmanager
async def _closing(events: AsyncIterator[Event]) -> AsyncIterator[AsyncIterator[Event]]:
    """Close the client's generator on exit: leaving it early cancels the request now, not
    whenever the garbage collector finalizes it."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _count_cancel(server: Server) -> None:
    server.metrics.cancelled += 1
