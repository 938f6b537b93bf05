"""`POST /v1/chat/completions`: render the conversation, generate, parse tool calls and
thinking out of the text, stream or answer whole; remember the turn for splicing."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from protocol import DoneEvent, ErrorEvent, Event, TokenEvent, TokenLogprob

from .. import chunks as ch
from ..disconnect import EventStreamResponse, race_disconnect
from ..errors import APIError, error_body, from_worker_error
from ..http import count_cancel, endpoint, json_response, read_body
from ..prepare import prepare_chat
from ..state import Generation, Server, event_text, usage_of
from ..tool_parsers import FORMATS, OutputParser, Piece


async def chat(server: Server, request: Request) -> Response:
    body = await read_body(request, server.config.max_body_bytes, server.config.body_timeout_s)
    _, model = server.ready()
    prepared = await server.prepare(
        prepare_chat,
        body,
        request.headers,
        model.template,
        model.model_id,
        server.turns,
        bool(model.marker_ids),
        model.tool_format,
        model.marker_ids,
    )
    generate, session = prepared.request, prepared.session
    parser = OutputParser(
        FORMATS[model.tool_format] if prepared.parse_tools else None,
        prepared.tool_schemas,
        model.reasoning,
    )
    header = ch.ResponseHeader(ch.new_id("chatcmpl"), model.model_id)
    logprobs = bool(generate.get("return_logprobs"))
    with server.using(session):
        generation, first = await server.start_generation(generate, request)
    if prepared.stream:
        return EventStreamResponse(
            chat_stream(
                server, generation, first, parser, header, prepared.include_usage, session,
                logprobs,
            ),
            on_disconnect=lambda: count_cancel(server),
        )  # fmt: skip
    return await race_disconnect(
        chat_whole(server, generation, first, parser, header, session, logprobs), request.receive
    )


async def collect(
    generation: Generation,
    first: Event | None,
    parser: OutputParser,
    model_markers: dict[int, str],
) -> AsyncIterator[tuple[list[Piece], ErrorEvent | None, list[TokenLogprob]]]:
    """Parsed pieces (and the event's token logprobs) per event; the last item carries the
    error, if one ended it."""
    event = first
    while event is not None:
        if isinstance(event, TokenEvent):
            yield parser.feed(event_text(event, model_markers)), None, event.logprobs or []
        elif isinstance(event, ErrorEvent):
            yield parser.finish(), event, []
            return
        elif isinstance(event, DoneEvent):
            yield parser.finish(), None, []
            return
        event = await generation.next_event()
    yield parser.finish(), None, []


async def chat_whole(
    server: Server,
    generation: Generation,
    first: Event | None,
    parser: OutputParser,
    header: ch.ResponseHeader,
    session: str | None,
    logprobs: bool = False,
) -> Response:
    _, model = server.ready()
    turn = ch.TurnAccumulator()
    entries: list[TokenLogprob] = []
    try:
        with server.using(generation.session):
            async for pieces, error, lps in collect(generation, first, parser, model.marker_ids):
                entries.extend(lps)
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
    return json_response(
        header.chat_body(
            turn.message(),
            turn.finish_reason(done.finish_reason),
            usage_of(done),
            ch.chat_logprobs(entries) if logprobs else None,
        )
    )


async def chat_stream(
    server: Server,
    generation: Generation,
    first: Event | None,
    parser: OutputParser,
    header: ch.ResponseHeader,
    include_usage: bool,
    session: str | None,
    logprobs: bool = False,
) -> AsyncIterator[bytes]:
    _, model = server.ready()
    turn = ch.TurnAccumulator()
    held: list[TokenLogprob] = []  # tokens whose text the parser has not sent yet
    try:
        with server.using(generation.session):
            yield ch.sse(header.chat_chunk({"role": "assistant", "content": ""}))
            async for pieces, error, lps in collect(generation, first, parser, model.marker_ids):
                held.extend(lps)
                for piece in pieces:
                    delta = turn.add(piece)
                    if delta is not None:
                        chunk_lps = ch.chat_logprobs(held) if logprobs and held else None
                        held = [] if chunk_lps is not None else held
                        yield ch.sse(header.chat_chunk(delta, logprobs=chunk_lps))
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
            tail_lps = ch.chat_logprobs(held) if logprobs and held else None
            yield ch.sse(header.chat_chunk({}, turn.finish_reason(done.finish_reason), tail_lps))
            if include_usage:
                yield ch.sse(header.usage_chunk("chat.completion.chunk", usage_of(done)))
            yield ch.SSE_DONE
    finally:
        await generation.aclose()


def routes(server: Server) -> list[Route]:
    return [Route("/v1/chat/completions", endpoint(server, "chat", chat), methods=["POST"])]
