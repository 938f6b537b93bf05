"""From a request body to what is sent to the supervisor, off the event loop, under a budget.

Parsing, validation, chat-template rendering, turn splicing and tool schemas are linear in the
body (the built-in templates never build text by repeated concatenation, splicing scans the
text once) and run in a small thread pool (`Preparer`), so the event loop keeps answering
streams and `/health` while a big request is prepared. Each job has a time budget: the template
sandbox checks the thread's deadline at every call, item and attribute access, and the job
answers 400 `request_too_complex` when it runs out. A rendered prompt is also cut short as soon
as it could not fit in one protocol line to the worker (1 MiB): that request answers 400
`context_length_exceeded` at once instead of being sent.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import orjson

from protocol import MAX_LINE_BYTES

from .errors import APIError, invalid_value
from .forced_calls import forced_call_grammar
from .params import (
    TOO_DEEP,
    CompletionParams,
    SamplingParams,
    check_model,
    check_nesting,
    normalize_messages,
    parse_chat,
    parse_completion,
)
from .sessions import (
    PromptSegmentDict,
    TurnStore,
    render_prompt,
    session_from_request,
    spliceable_turns,
)
from .templates import (
    ChatTemplate,
    ChatTemplateError,
    RenderBudgetExceeded,
    RenderTooLong,
    check_deadline,
    render_deadline,
)
from .tool_parsers import ToolSchemas, tool_schemas

LINE_MARGIN = 4096
"""Bytes kept free in a worker line for what the supervisor adds (id, `op`, defaults)."""
LINE_LIMIT = MAX_LINE_BYTES - LINE_MARGIN
GRACE_S = 1.0
"""How long past its budget a job may run before its request is answered anyway."""

T = TypeVar("T")


def too_complex(budget_s: float) -> APIError:
    return APIError(
        400,
        "request_too_complex",
        f"preparing the prompt took longer than the server's budget of {budget_s:g} s",
    )


def too_long(what: str = "messages") -> APIError:
    return APIError(
        400,
        "context_length_exceeded",
        f"The prompt is too long: its request to the worker would exceed {MAX_LINE_BYTES} bytes.",
        param=what,
    )


JOB_SWITCH_INTERVAL_S = 0.0005
# Under a steady stream of overlapping jobs the collector would stay off for good: a young
# collection (cheap: only objects allocated since the last one) runs at a job's end once the
# collector has been off this long, so cyclic garbage cannot pile up without bound.
GC_OFF_AT_MOST_S = 5.0


class _JobMode:
    """While any job runs: the cyclic garbage collector off, and a short GIL switch interval.
    A job allocates millions of short-lived (acyclic) objects; a full collection they
    trigger holds the GIL, so the event loop, for 50-100 ms (reference counting frees them
    anyway). And each time the event loop waits for I/O, the job takes the GIL for up to the
    switch interval (5 ms by default), which a request's dozen loop turns add up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._was_enabled = False
        self._interval = sys.getswitchinterval()
        self._off_since = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._running == 0:
                self._was_enabled = gc.isenabled()
                self._interval = sys.getswitchinterval()
                gc.disable()
                sys.setswitchinterval(min(self._interval, JOB_SWITCH_INTERVAL_S))
                self._off_since = time.monotonic()
            self._running += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                sys.setswitchinterval(self._interval)
                if self._was_enabled:
                    gc.enable()
            elif self._was_enabled and time.monotonic() - self._off_since > GC_OFF_AT_MOST_S:
                gc.collect(1)
                self._off_since = time.monotonic()


_JOB_MODE = _JobMode()


class Preparer:
    """A small thread pool that runs preparation jobs with a time budget each (a thread, not
    a process: in `_JobMode` the event loop waits at most one short GIL switch interval, or
    one C call such as parsing an 8 MiB body (65 ms at worst), for a job; RELIABILITY.md)."""

    def __init__(self, budget_s: float, threads: int = 2) -> None:
        self.budget_s = budget_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenpipe-prepare")

    async def run(self, job: Callable[..., T], *args: Any) -> T:
        """`job(*args)` in the pool; its deadline starts when a thread picks it up."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._call, job, args)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.budget_s * 4 + GRACE_S)
        except asyncio.TimeoutError:  # queued behind other jobs, or stuck in one C call
            raise too_complex(self.budget_s) from None

    def _call(self, job: Callable[..., T], args: tuple[Any, ...]) -> T:
        render_deadline(time.monotonic() + self.budget_s)
        try:
            with _JOB_MODE:
                return job(*args)
        except RenderBudgetExceeded:
            raise too_complex(self.budget_s) from None
        except RecursionError:
            raise invalid_value(TOO_DEEP) from None
        finally:
            render_deadline(None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------ jobs


def parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid_value(f"the request body is not valid JSON: {exc}") from exc


def check_line(request: Mapping[str, Any], what: str = "messages") -> None:
    """`too_long` when `request` would not fit in one protocol line to the worker."""
    if len(orjson.dumps(request)) > LINE_LIMIT:
        raise too_long(what)


def generate_request(
    segments: list[PromptSegmentDict],
    sampling: SamplingParams,
    session: str | None,
    add_prefix: bool,
    return_token_ids: bool,
) -> dict[str, Any]:
    """The generate request (wire form) for a prompt and its sampling parameters."""
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
        "return_token_ids": return_token_ids,
    }
    if sampling.json_schema is not None:
        request["json_schema"] = sampling.json_schema
    if sampling.json_object:
        request["json_object"] = True
    if sampling.grammar is not None:
        request["grammar"] = sampling.grammar
    if sampling.logprobs:
        request["return_logprobs"] = True
        request["top_logprobs"] = sampling.top_logprobs
    if session:
        request["session_id"] = session
    return request


@dataclass(frozen=True)
class PreparedChat:
    """What the chat route needs from a body; the parsed body itself stays in the thread
    (freeing or collecting millions of objects on the event loop would stall it)."""

    request: dict[str, Any]
    tool_schemas: ToolSchemas
    session: str | None
    stream: bool
    include_usage: bool
    parse_tools: bool


def prepare_chat(
    body: bytes,
    headers: Mapping[str, str],
    template: ChatTemplate,
    model_id: str,
    turns: TurnStore,
    return_token_ids: bool,
    tool_format: str = "hermes",
    marker_ids: Mapping[int, str] | None = None,
) -> PreparedChat:
    """Parse, render and splice a chat body into a generate request."""
    params = parse_chat(parse_json(body))
    sampling = params.sampling
    if params.forced_tools and params.tools:
        if sampling.json_schema is not None or sampling.json_object:
            raise invalid_value(
                "'response_format' and a forced 'tool_choice' cannot be combined", "tool_choice"
            )
        grammar = forced_call_grammar(params.tools, params.forced_tools, tool_format, marker_ids)
        sampling = replace(sampling, grammar=grammar)
    check_model(params.model, model_id)
    session = session_from_request(params.session_id, headers)
    check_deadline()
    try:
        rendered = render_prompt(
            template,
            params.messages,
            tools=params.tools,
            template_kwargs=params.template_kwargs,
            turn_ids=spliceable_turns(turns, session or "", params.messages),
            max_chars=LINE_LIMIT,
        )
    except RenderTooLong:
        raise too_long() from None
    except ChatTemplateError as exc:
        raise APIError(400, "template_error", str(exc)) from exc
    request = generate_request(rendered.segments, sampling, session, True, return_token_ids)
    check_line(request)
    check_deadline()
    return PreparedChat(
        request,
        tool_schemas(params.tools),
        session,
        params.stream,
        params.include_usage,
        params.parse_tools,
    )


def prepare_completion(body: bytes) -> tuple[CompletionParams, list[PromptSegmentDict], bool]:
    """The validated parameters and the prompt as segments (text, or ids without prefix)."""
    params = parse_completion(parse_json(body))
    if isinstance(params.prompt, str):
        segments: list[PromptSegmentDict] = [{"text": params.prompt}]
        check_line({"prompt_segments": segments}, "prompt")
        return params, segments, True
    segments = [{"ids": list(params.prompt)}]
    check_line({"prompt_segments": segments}, "prompt")
    return params, segments, False


def prepare_tokenize(body: bytes, template: ChatTemplate) -> tuple[str, bool]:
    """The text to tokenize (a prompt, or messages rendered) and whether to add the prefix."""
    data = parse_json(body)
    if not isinstance(data, dict):
        raise invalid_value("the request body must be a JSON object")
    check_nesting(data)
    add_prefix = data.get("add_special_tokens", data.get("add_prefix", True))
    if not isinstance(add_prefix, bool):
        raise invalid_value("'add_special_tokens' must be a boolean")
    if "messages" in data:
        tools = data.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise invalid_value("'tools' must be a list", "tools")
        try:
            text = template.render(
                normalize_messages(data["messages"]), tools=tools, max_chars=LINE_LIMIT
            )
        except RenderTooLong:
            raise too_long() from None
        except ChatTemplateError as exc:
            raise APIError(400, "template_error", str(exc)) from exc
    else:
        prompt = data.get("prompt", data.get("text"))
        if not isinstance(prompt, str):
            raise invalid_value("'prompt' must be a string", "prompt")
        text = prompt
    check_line({"op": "tokenize", "text": text}, "prompt")
    return text, add_prefix


def prepare_detokenize(body: bytes) -> list[int]:
    data = parse_json(body)
    tokens = data.get("tokens", data.get("ids")) if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in tokens
    ):
        raise invalid_value("'tokens' must be a list of token ids", "tokens")
    check_line({"op": "detokenize", "ids": tokens}, "tokens")
    return tokens
