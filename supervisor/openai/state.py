"""The server's state: the supervisor client, the model's template and tool format, the
remembered assistant turns, the open sessions and the metrics (`Server`), and one generation
in flight (`Generation`).

The client is started in the background so `/health` answers 503 while the model loads.
Every generation runs as `client.generate(...)`; leaving it early cancels the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.requests import Request

from protocol import DoneEvent, ErrorEvent, Event, TokenEvent

from . import chunks as ch
from .disconnect import race_disconnect
from .errors import APIError, from_worker_error
from .metrics import Metrics
from .params import SamplingParams
from .prepare import Preparer, generate_request
from .sessions import PromptSegmentDict, TurnStore, turn_fingerprint
from .templates import ChatTemplate, builtin_template, model_family
from .tool_parsers import FORMATS, REASONING_MARKERS, default_tool_format

log = logging.getLogger("tokenpipe.serve")

MAX_BODY_BYTES = 8 << 20
RECOUNT_CHARS = 64 << 10
"""Prompts up to this many characters of text get their token count in an overflow error."""

T = TypeVar("T")


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
    render_budget_s: float = 2.0  # time to parse, render and splice one request
    body_timeout_s: float = 30.0  # time for a request body to arrive
    max_queue: int | None = None  # the supervisor's per-worker queue: /health says when full
    allow_origins: tuple[str, ...] = ()  # browser origins allowed to call (CORS)
    bind_host: str = "127.0.0.1"  # the address served: a Host header may name it

    def __post_init__(self) -> None:
        if self.tool_parser is not None and self.tool_parser not in FORMATS:
            raise ValueError(f"tool parser must be one of {sorted(FORMATS)}")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        if self.render_budget_s <= 0:
            raise ValueError("render_budget_s must be positive")


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
    markers += FORMATS[tool_format].inner
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


@dataclass
class Generation:
    """One generate request in flight: its events (set by `Server.start_generation`), with
    TTFT/ITL timing and usage."""

    started: float
    metrics: Metrics
    # the named session it runs in: None without one, or once it fell back to none
    session: str | None = None
    last_token_at: float | None = None
    done: DoneEvent | None = None
    events: AsyncIterator[Event] = field(init=False)

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
    named_sessions: bool = True  # False: the workers hold none (--max-sessions 1)
    preparer: Preparer | None = None
    _loader: asyncio.Task[None] | None = None

    # -- lifecycle

    async def start(self) -> None:
        self.preparer = Preparer(self.config.render_budget_s)
        self._loader = asyncio.ensure_future(self._load())

    async def prepare(self, job: Callable[..., T], *args: Any) -> T:
        """`job(*args)` off the event loop under the render budget (see prepare.py)."""
        if self.preparer is None:
            raise APIError(503, "model_loading", "the server is starting")
        return await self.preparer.run(job, *args)

    async def _load(self) -> None:
        try:
            client = await self.client_factory()
            self.client = client
            ready_info = getattr(client, "ready_info", None) or {}
            for session in reversed(ready_info.get("restored_sessions") or ()):
                self.open_sessions.setdefault(session, 0)  # --session-dir's, oldest first
            if ready_info.get("max_named_sessions") == 0:
                self.named_sessions = False
                log.warning(
                    "the workers hold no named sessions (--max-sessions 1 keeps each one's slot "
                    "for requests without a session): requests that name a session run without "
                    "one, their prompts prefilled whole each turn; --max-sessions 2 or more "
                    "keeps sessions warm"
                )
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
        if self.preparer is not None:
            self.preparer.close()

    def ready(self) -> tuple[GenerateClient, ModelState]:
        if self.client is None or self.model is None:
            message = self.load_error or "the model is still loading"
            raise APIError(
                503, "model_loading" if self.load_error is None else "load_failed", message
            )
        return self.client, self.model

    # -- sessions

    async def _events(
        self, request: dict[str, Any], generation: Generation
    ) -> AsyncIterator[Event]:
        """`client.generate`, opening the named session on first use and making room (by
        closing the least recently used idle session this server opened) when full. Where no
        named session can be had (every one busy, or the workers hold none) the request runs
        without one: its prompt is whole, so only the cache reuse is lost, not the request;
        `generation.session` then says None, so the route does not hold (and a later eviction
        does not pick) a session that no worker has open."""
        client, _ = self.ready()
        session = generation.session
        if session is None:
            request = _sessionless(request)
        for attempt in range(4):
            retry = False
            async with _closing(client.generate(dict(request))) as events:
                first = True
                async for event in events:
                    if first and isinstance(event, ErrorEvent) and session:
                        placed: bool | None = None  # None: not a placement error
                        if event.code == "unknown_session" and attempt < 2:
                            placed = await self._open(session)
                        elif event.code == "capacity_exhausted":
                            placed = attempt < 2 and await self._evict(session)
                        if placed is not None:
                            retry = True
                            if not placed:  # no named session to be had: run without one
                                log.info("no named session for %r: served without", session)
                                self._unplaced(session)
                                request, session = _sessionless(request), None
                                generation.session = None
                            break
                    first = False
                    yield event
            if not retry:
                return

    async def _open(self, session: str) -> bool:
        """Open `session` (True), making room if full; False where no room can be made."""
        client, _ = self.ready()
        for _ in range(2):
            try:
                await client.open_session(session)
                return True
            except Exception as exc:
                code = getattr(exc, "code", "")
                if code == "capacity_exhausted" and await self._evict(session):
                    continue
                if code == "capacity_exhausted":
                    return False
                if code == "":
                    raise
                return True  # e.g. already open: generate will tell
        return False

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

    def _unplaced(self, session: str) -> None:
        """Forget `session` as one this server has open (`using` counted the request that
        found no room for it), unless another request holds it too."""
        if self.open_sessions.get(session) == 1:
            del self.open_sessions[session]

    @contextlib.contextmanager
    def using(self, session: str | None) -> Any:
        session = session if self.named_sessions else None
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
        if sum(len(s.get("text", "")) for s in segments) > RECOUNT_CHARS:
            # Recounting would tokenize the whole text again and decode every id on the
            # event loop (250 ms for 1 MB); the worker's own message says enough.
            return APIError(400, "context_length_exceeded", message, param="messages")
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
        return generate_request(segments, sampling, session, add_prefix, bool(model.marker_ids))

    async def start_generation(
        self, request: dict[str, Any], http: Request
    ) -> tuple[Generation, Event | None]:
        """Send the request and wait for its first event (raises `ClientGone` on disconnect
        and `APIError` when the worker refuses it before any output)."""
        session = request.get("session_id") if self.named_sessions else None
        generation = Generation(time.monotonic(), self.metrics, session=session)
        generation.events = self._events(request, generation)
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


def _sessionless(request: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in request.items() if k != "session_id"}
