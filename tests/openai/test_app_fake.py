"""The ASGI app against a small fake of the supervisor client API (one piece, in process)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from protocol import DoneEvent, ErrorEvent, Event, TokenEvent
from supervisor.openai.app import Server, ServerConfig, create_app

pytestmark = pytest.mark.anyio

GEMMA_INFO = {
    "model": "/cache/gemma-3-270m-q4_k_m.gguf",
    "architecture": "Gemma3ForCausalLM",
    "context_length": 64,
    "bos_id": 2,
    "prefix_ids": [2],
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "chat_template": None,
}
MARKERS = {"<|tool_call>": 50, "<tool_call|>": 51, "<|channel>": 52, "<channel|>": 53}


class TokenpipeError(RuntimeError):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class FakeClient:
    """Answers each generate with the next script: a list of token texts (or (text, ids)
    pairs), optionally ending in an ErrorEvent; `delay` seconds between tokens."""

    def __init__(self, info: dict[str, Any] | None = None) -> None:
        self.info_dict = dict(info or GEMMA_INFO)
        self.scripts: list[list[Any]] = []
        self.requests: list[dict[str, Any]] = []
        self.opened: list[str] = []
        self.needs_open: set[str] = set()
        self.cancelled = 0
        self.active = 0
        self.delay = 0.0
        self.reused = 0

    async def info(self) -> dict[str, Any]:
        return self.info_dict

    async def stats(self) -> dict[str, Any]:
        return {
            "active_requests": self.active,
            "queued_requests": 0,
            "sessions": 1,
            "workers": [{"state": "ready", "restarts": 2, "queue_depth": self.active}],
        }

    async def tokenize(self, text: str, add_prefix: bool = False) -> list[int]:
        if text in MARKERS and self.info_dict["architecture"] == "gemma4":
            return [MARKERS[text]]
        return ([2] if add_prefix else []) + [ord(c) for c in text]

    async def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    async def open_session(self, session_id: str) -> None:
        self.opened.append(session_id)
        self.needs_open.discard(session_id)

    async def close_session(self, session_id: str) -> None:
        if session_id == "missing":
            raise TokenpipeError("unknown_session")

    async def reset_session(self, session_id: str) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Event]:
        self.requests.append(request)
        if request.get("session_id") in self.needs_open:
            yield ErrorEvent(error="open it first", code="unknown_session")
            return
        script = self.scripts.pop(0) if self.scripts else ["Hello", " world"]
        self.active += 1
        finished = False
        generated: list[int] = []
        try:
            for item in script:
                if isinstance(item, ErrorEvent):
                    finished = True
                    yield item
                    return
                if self.delay:
                    await asyncio.sleep(self.delay)
                text, ids = item if isinstance(item, tuple) else (item, [ord(c) for c in item])
                generated += ids
                yield TokenEvent(token=text, token_ids=ids if request["return_token_ids"] else None)
            finished = True
            yield DoneEvent(
                prompt_tokens=10,
                completion_tokens=len(generated),
                finish_reason="stop",
                reused_prompt_tokens=self.reused,
                prefilled_prompt_tokens=10 - self.reused,
                session_reset_reason="new",
                prefill_ms=1,
                decode_ms=1,
                total_ms=2,
                prefill_tok_s=1,
                decode_tok_s=1,
                generated_token_ids=generated,
            )
        finally:
            self.active -= 1
            if not finished:
                self.cancelled += 1


def sse_payloads(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def make(fake: FakeClient, **config: Any) -> tuple[Server, httpx.AsyncClient]:
    async def factory() -> FakeClient:
        return fake

    server = Server(ServerConfig(**config), factory)
    app = create_app(server)
    await server.start()
    await server.wait_ready()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
    return server, http


CHAT = {"model": "gemma-3-270m-q4_k_m", "messages": [{"role": "user", "content": "Hi"}]}


async def test_chat_non_streaming_and_request_mapping() -> None:
    fake = FakeClient()
    fake.reused = 4
    _, http = await make(fake)
    body = {
        **CHAT,
        "temperature": 0,
        "seed": 3,
        "max_tokens": 5,
        "stop": ["x"],
        "session_id": "conv-1",
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion" and data["model"] == "gemma-3-270m-q4_k_m"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 11,
        "total_tokens": 21,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    sent = fake.requests[-1]
    assert sent["prompt_segments"] == [
        {"text": "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"}
    ]
    assert sent["add_prefix"] is True and sent["session_id"] == "conv-1"
    assert (sent["temperature"], sent["seed"], sent["max_new_tokens"], sent["stop"]) == (
        0.0,
        4,
        5,
        ["x"],
    )


async def test_chat_streaming_chunks_and_usage() -> None:
    fake = FakeClient()
    fake.scripts = [["Hé", "llo", "", " ✓"]]
    _, http = await make(fake)
    response = await http.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Héllo ✓"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    assert len({c["id"] for c in chunks}) == 1


async def test_tool_calls_streaming_and_not_agree() -> None:
    output = [
        "Checking.\n<tool",
        '_call>{"name": "get_weather", "arguments": ',
        '{"city": "Oslo"}}',
        "</tool_call>",
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    fake = FakeClient()
    fake.scripts = [list(output), list(output)]
    _, http = await make(fake)
    whole = (await http.post("/v1/chat/completions", json={**CHAT, "tools": tools})).json()
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Checking."
    assert message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    streamed = sse_payloads(
        (
            await http.post("/v1/chat/completions", json={**CHAT, "tools": tools, "stream": True})
        ).text
    )[:-1]
    deltas = [c["choices"][0]["delta"] for c in streamed]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_gemma4_markup_tokens_are_recovered_from_ids() -> None:
    fake = FakeClient({**GEMMA_INFO, "architecture": "gemma4"})
    fake.scripts = [
        [
            ("", [52]),
            ("thought\nhmm", [1, 2]),
            ("", [53]),
            ("Hi", [3]),
            ("", [50]),
            ('call:f{a:<|"|>b<|"|>}', [4]),
            ("", [51]),
        ]
    ]
    _, http = await make(fake)
    tools = [{"type": "function", "function": {"name": "f"}}]
    data = (await http.post("/v1/chat/completions", json={**CHAT, "tools": tools})).json()
    message = data["choices"][0]["message"]
    assert message["content"] == "Hi" and message["reasoning_content"] == "hmm"
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": "b"}'}
    assert fake.requests[-1]["return_token_ids"] is True
    assert fake.requests[-1]["prompt_segments"][0]["text"].startswith("<|turn>user\nHi")


async def test_assistant_turn_is_spliced_as_its_ids_next_time() -> None:
    fake = FakeClient()
    fake.scripts = [[("Yes", [901, 902])], ["ok"], ["ok"]]
    _, http = await make(fake)
    await http.post("/v1/chat/completions", json=CHAT, headers={"x-session-affinity": "pi-1"})
    follow = {
        **CHAT,
        "messages": [
            *CHAT["messages"],
            {"role": "assistant", "content": "Yes"},
            {"role": "user", "content": "More"},
        ],
    }
    await http.post("/v1/chat/completions", json=follow, headers={"x-session-affinity": "pi-1"})
    segments = fake.requests[-1]["prompt_segments"]
    assert segments[1] == {"ids": [901, 902]}
    assert fake.requests[-1]["session_id"] == "pi-1"
    edited = json.loads(json.dumps(follow))
    edited["messages"][1]["content"] = "Yes!"
    await http.post("/v1/chat/completions", json=edited, headers={"x-session-affinity": "pi-1"})
    assert all("ids" not in s for s in fake.requests[-1]["prompt_segments"])


async def test_workers_without_named_sessions_serve_session_requests_without_one() -> None:
    """--max-sessions 1 leaves no named session: a request naming one runs as a plain
    request (200, its prompt whole) instead of a 429 that no eviction can clear."""
    fake = FakeClient()
    fake.ready_info = {"max_named_sessions": 0}  # type: ignore[attr-defined]
    server, http = await make(fake)
    for _ in range(2):
        response = await http.post(
            "/v1/chat/completions", json=CHAT, headers={"x-session-affinity": "pi-1"}
        )
        assert response.status_code == 200
        assert "session_id" not in fake.requests[-1]
    assert fake.opened == [] and not server.open_sessions


class FullClient(FakeClient):
    """A worker whose every named slot is busy: a request naming a session is refused."""

    async def open_session(self, session_id: str) -> None:
        raise TokenpipeError("capacity_exhausted")

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Event]:
        if request.get("session_id"):
            self.requests.append(request)
            yield ErrorEvent(error="all 1 named session slots are taken", code="capacity_exhausted")
            return
        async for event in super().generate(request):
            yield event


@pytest.mark.parametrize("needs_open", [False, True])
async def test_no_free_named_session_serves_the_request_without_one(needs_open: bool) -> None:
    """Every named slot busy (nothing idle to close): the request runs without its session,
    its prompt whole, instead of a 429 (the body holds the whole conversation)."""
    fake = FullClient()
    if needs_open:
        fake.needs_open = {"pi-2"}
        fake.generate = FakeClient.generate.__get__(fake)  # type: ignore[method-assign]
    server, http = await make(fake)
    response = await http.post(
        "/v1/chat/completions", json=CHAT, headers={"x-session-affinity": "pi-2"}
    )
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello world"
    assert fake.requests[0].get("session_id") == "pi-2"
    assert "session_id" not in fake.requests[-1]
    # no worker has pi-2 open: not a session for a later eviction to close
    assert "pi-2" not in server.open_sessions


class OneSlotClient(FakeClient):
    """A worker with one named slot: generate needs its session open, open is refused while
    another session holds the slot, close frees it (and is recorded)."""

    def __init__(self) -> None:
        super().__init__()
        self.worker_open: set[str] = set()
        self.closed: list[str] = []

    async def open_session(self, session_id: str) -> None:
        if self.worker_open - {session_id}:
            raise TokenpipeError("capacity_exhausted")
        self.worker_open.add(session_id)
        self.opened.append(session_id)

    async def close_session(self, session_id: str) -> None:
        self.closed.append(session_id)
        self.worker_open.discard(session_id)

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Event]:
        if request.get("session_id") not in (None, *self.worker_open):
            self.requests.append(request)
            yield ErrorEvent(error="open it first", code="unknown_session")
            return
        async for event in super().generate(request):
            yield event


@pytest.mark.parametrize("stream", [False, True])
async def test_a_session_generating_on_completions_is_not_closed_for_room(stream: bool) -> None:
    """/v1/completions holds its session until its last token, as chat does: a chat turn that
    needs room meanwhile runs without a session instead of closing the one in use."""
    fake = OneSlotClient()
    fake.delay = 0.1
    fake.scripts = [["a"] * 6]
    server, http = await make(fake)
    body = {"model": CHAT["model"], "prompt": "Hi", "session_id": "a", "stream": stream}
    first = asyncio.ensure_future(http.post("/v1/completions", json=body))
    while not fake.active or not any(r.get("session_id") == "a" for r in fake.requests[1:]):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.25)  # past the first token: start_generation has returned
    second = await http.post("/v1/chat/completions", json=CHAT, headers={"x-session-affinity": "b"})
    assert second.status_code == 200 and "session_id" not in fake.requests[-1]
    assert (await first).status_code == 200
    assert fake.closed == [] and fake.worker_open == {"a"}
    assert list(server.open_sessions) == ["a"]


async def test_unknown_session_is_opened_and_retried() -> None:
    fake = FakeClient()
    fake.needs_open = {"s9"}
    _, http = await make(fake)
    response = await http.post("/v1/chat/completions", json={**CHAT, "session_id": "s9"})
    assert response.status_code == 200 and fake.opened == ["s9"]
    assert len(fake.requests) == 2


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({**CHAT, "model": "gpt-4o"}, 404, "model_not_found"),
        ({**CHAT, "n": 3}, 400, "unsupported_parameter"),
        ({**CHAT, "temperature": -1}, 400, "invalid_value"),
        ({"model": CHAT["model"]}, 400, "invalid_value"),
    ],
)
async def test_request_errors(body: dict, status: int, code: str) -> None:
    _, http = await make(FakeClient())
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


async def test_context_overflow_message_has_both_numbers() -> None:
    fake = FakeClient()
    fake.scripts = [[ErrorEvent(error="too long", code="context_length_exceeded")]]
    _, http = await make(fake)
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    prompt_len = 1 + len("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert f"({prompt_len} tokens)" in error["message"] and "(64 tokens)" in error["message"]
    assert "exceeds the available context size" in error["message"]


async def test_error_mid_stream_is_an_event_then_done() -> None:
    fake = FakeClient()
    fake.scripts = [["partial", ErrorEvent(error="worker died", code="worker_lost")]]
    _, http = await make(fake)
    payloads = sse_payloads(
        (await http.post("/v1/chat/completions", json={**CHAT, "stream": True})).text
    )
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["error"]["code"] == "worker_lost"
    assert payloads[1]["choices"][0]["delta"] == {"content": "partial"}


async def test_api_key_body_limit_and_session_id_checks() -> None:
    _, http = await make(FakeClient(), api_key="s3cret", max_body_bytes=1000)
    assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (await http.get("/v1/models", headers=wrong)).status_code == 401
    good = {"Authorization": "Bearer s3cret"}
    models = (await http.get("/v1/models", headers=good)).json()
    assert models["data"][0]["id"] == "gemma-3-270m-q4_k_m"
    assert (await http.get("/health")).status_code == 200  # health needs no key
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    response = await http.post("/v1/chat/completions", json=big, headers=good)
    assert response.status_code == 413
    response = await http.post(
        "/v1/chat/completions", json=CHAT, headers={**good, "x-session-affinity": "bad\x7f"}
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_value"


async def test_health_is_503_while_loading() -> None:
    gate = asyncio.Event()

    async def factory() -> FakeClient:
        await gate.wait()
        return FakeClient()

    server = Server(ServerConfig(), factory)
    app = create_app(server)
    await server.start()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
    assert (await http.get("/health")).status_code == 503
    loading = await http.post("/v1/chat/completions", json=CHAT)
    assert loading.status_code == 503 and loading.json()["error"]["code"] == "model_loading"
    gate.set()
    await server.wait_ready()
    assert (await http.get("/health")).json() == {"status": "ok", "workers": 1}


async def test_completions_tokenize_sessions_and_metrics() -> None:
    fake = FakeClient()
    _, http = await make(fake)
    data = (await http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 3})).json()
    assert data["object"] == "text_completion" and data["choices"][0]["text"] == "Hello world"
    assert fake.requests[-1]["prompt_segments"] == [{"text": "Once"}]
    assert fake.requests[-1]["max_new_tokens"] == 3
    await http.post("/v1/completions", json={"prompt": [5, 6]})
    assert fake.requests[-1]["prompt_segments"] == [{"ids": [5, 6]}]
    assert fake.requests[-1]["add_prefix"] is False
    tokens = (await http.post("/tokenize", json={"prompt": "ab"})).json()
    assert tokens["tokens"] == [2, 97, 98] and tokens["count"] == 3
    assert (await http.post("/detokenize", json={"tokens": [97, 98]})).json()["prompt"] == "ab"
    assert (await http.post("/v1/sessions/s1/reset")).json()["reset"] is True
    assert (await http.delete("/v1/sessions/s1")).json()["deleted"] is True
    assert (await http.delete("/v1/sessions/missing")).status_code == 404
    text = (await http.get("/metrics")).text
    assert 'tokenpipe_requests_total{endpoint="completions",status="200"} 2' in text
    assert "tokenpipe_completion_tokens_total 22" in text
    assert "tokenpipe_worker_restarts_total 2" in text
    assert 'tokenpipe_time_to_first_token_seconds_bucket{le="+Inf"} 2' in text


async def test_cancelled_when_the_handler_task_is_cancelled() -> None:
    """Cancelling the request task (what a disconnect does) closes the worker request."""
    fake = FakeClient()
    fake.delay = 0.05
    fake.scripts = [["x"] * 100]
    _, http = await make(fake)
    task = asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT))
    await asyncio.sleep(0.3)
    assert fake.active == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    assert fake.active == 0 and fake.cancelled == 1


async def test_a_pi_shaped_request_is_accepted() -> None:
    """What pi's openai-completions provider sends (affinity headers, store, tools, parts)."""
    fake = FakeClient()
    _, http = await make(fake)
    body = {
        "model": "gemma-3-270m-q4_k_m",
        "messages": [
            {"role": "system", "content": "You are pi."},
            {"role": "user", "content": [{"type": "text", "text": "list files"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "a.txt"}],
            },
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "store": False,
        "max_tokens": 8,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "description": "run",
                    "parameters": {"type": "object"},
                    "strict": False,
                },
            }
        ],
    }
    headers = {
        "session_id": "pi-abc",
        "x-client-request-id": "pi-abc",
        "x-session-affinity": "pi-abc",
    }
    response = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    assert sse_payloads(response.text)[-1] == "[DONE]"
    sent = fake.requests[-1]
    assert sent["session_id"] == "pi-abc"
    text = sent["prompt_segments"][0]["text"]
    assert '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>' in text
    assert "<tool_response>\na.txt\n</tool_response>" in text


def test_pi_models_json_from_info() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "pi" / "make_models_json.py"
    spec = importlib.util.spec_from_file_location("make_models_json", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    document = module.pi_models_json(
        {"context_length": 32768, "context": 8192}, base_url="http://h/v1", model_id="m"
    )
    provider = document["providers"]["tokenpipe"]
    assert provider["api"] == "openai-completions"
    assert provider["compat"]["sendSessionAffinityHeaders"] is True
    assert provider["models"][0]["contextWindow"] == 8192
    assert provider["models"][0]["maxTokens"] == 2048  # a quarter of the window
    shipped = json.loads((path.parent / "models.json").read_text())
    assert shipped["providers"]["tokenpipe"]["compat"] == provider["compat"]
