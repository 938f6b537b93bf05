"""`POST /v1/completions`: a text prompt (or token ids) in, text out, streamed or whole."""

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
from ..params import check_model
from ..prepare import prepare_completion
from ..sessions import session_from_request
from ..state import Generation, Server, usage_of


async def completions(server: Server, request: Request) -> Response:
    body = await read_body(request, server.config.max_body_bytes, server.config.body_timeout_s)
    params, segments, add_prefix = await server.prepare(prepare_completion, body)
    _, model = server.ready()
    check_model(params.model, model.model_id)
    session = session_from_request(params.session_id, request.headers)
    generate = server.generate_request(segments, params.sampling, session, add_prefix)
    generate["return_token_ids"] = False
    header = ch.ResponseHeader(ch.new_id("cmpl"), model.model_id)
    logprobs = params.sampling.logprobs
    with server.using(session):
        generation, first = await server.start_generation(generate, request)
    if params.stream:
        return EventStreamResponse(
            text_stream(server, generation, first, header, params.include_usage, logprobs),
            on_disconnect=lambda: count_cancel(server),
        )
    return await race_disconnect(
        text_whole(server, generation, first, header, logprobs), request.receive
    )


async def text_whole(
    server: Server,
    generation: Generation,
    first: Event | None,
    header: ch.ResponseHeader,
    logprobs: bool = False,
) -> Response:
    parts: list[str] = []
    entries: list[TokenLogprob] = []
    event = first
    try:
        with server.using(generation.session):  # not a session to close for room meanwhile
            while event is not None:
                if isinstance(event, TokenEvent):
                    parts.append(event.token)
                    entries.extend(event.logprobs or ())
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
    lps = ch.text_logprobs(entries) if logprobs else None
    return json_response(header.text_body("".join(parts), reason, usage_of(done), lps))


async def text_stream(
    server: Server,
    generation: Generation,
    first: Event | None,
    header: ch.ResponseHeader,
    include_usage: bool,
    logprobs: bool = False,
) -> AsyncIterator[bytes]:
    event = first
    offset = 0  # characters sent so far (the chunks' text_offset)
    try:
        with server.using(generation.session):  # not a session to close for room meanwhile
            while event is not None:
                if isinstance(event, TokenEvent):
                    if event.token or event.logprobs:
                        lps = ch.text_logprobs(event.logprobs or [], offset) if logprobs else None
                        offset += len(event.token)
                        yield ch.sse(header.text_chunk(event.token, logprobs=lps))
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
            error_body("the generation ended without a result", "server_error", "internal_error")
        )
        yield ch.SSE_DONE
    finally:
        await generation.aclose()


def routes(server: Server) -> list[Route]:
    return [
        Route("/v1/completions", endpoint(server, "completions", completions), methods=["POST"])
    ]
