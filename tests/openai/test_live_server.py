"""End to end: the official `openai` client against a live `tokenpipe serve` subprocess on
the real default model (CPU, small context). Greedy decoding keeps outputs deterministic."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from supervisor.client import run_command

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_CONTEXT = 1024
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "serve.log"
        self.log = self.log_path.open("wb")
        env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENPIPE_THREADS": "2"}
        self.proc = subprocess.Popen(
            [
                *run_command(),
                "serve",
                "--port",
                str(self.port),
                "--max-context",
                str(MAX_CONTEXT),
                "--max-sessions",
                "4",
                "--api-key",
                API_KEY,
                # Small prefill chunks: a cancel lands between chunks, also during a prefill.
                "--worker-arg=--prefill-chunk=64",
                "--log-level",
                "warning",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )
        self.http = httpx.Client(
            base_url=self.base, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
        )

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited: {self.log_path.read_text()[-3000:]}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(self.log_path.read_text()[-3000:])

    def gauge(self, name: str) -> float | None:
        """A metric's value; None when the supervisor's stats did not answer in time."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(f"tokenpipe_{name} "):
                return float(line.split()[1])
        return None

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("serve"))
    try:
        live.wait_healthy()
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    # Closed before the server stops, so no idle keep-alive connection delays its shutdown.
    with openai.OpenAI(
        base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=300
    ) as api:
        yield api


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


QUESTION = [{"role": "user", "content": "Name three colors."}]


def test_non_streaming_and_streaming_agree_with_usage(
    client: openai.OpenAI, model_id: str, server: LiveServer
) -> None:
    whole = client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=6, temperature=0
    )
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert whole.usage is not None and whole.usage.completion_tokens <= 6
    assert whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    stream = client.chat.completions.create(
        model=model_id,
        messages=QUESTION,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and all(f is None for f in finishes[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The prompt counts BOS once: the template's literal <bos> was stripped.
    rendered = "<start_of_turn>user\nName three colors.<end_of_turn>\n<start_of_turn>model\n"
    counted = server.http.post("/tokenize", json={"prompt": rendered}).json()["count"]
    assert counted == whole.usage.prompt_tokens


def test_multibyte_text_integrity(client: openai.OpenAI, model_id: str, server: LiveServer) -> None:
    prompt = "日本の首都は東京です。中国の首都は"
    whole = client.completions.create(model=model_id, prompt=prompt, max_tokens=5, temperature=0)
    streamed = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=5, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in streamed if c.choices]
    text = whole.choices[0].text
    assert "".join(pieces) == text and text
    assert "\ufffd" not in text
    assert any(ord(ch) > 0x7F for ch in text)  # the model answers in CJK characters
    ids = server.http.post(
        "/tokenize", json={"prompt": "héllo 😀 東京", "add_special_tokens": False}
    ).json()["tokens"]
    assert server.http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == (
        "héllo 😀 東京"
    )


def test_session_reuse_shows_in_cached_tokens(client: openai.OpenAI, model_id: str) -> None:
    headers = {"x-session-affinity": "live-session-1"}
    first = client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=4, temperature=0, extra_headers=headers
    )
    assert first.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    follow = [
        *QUESTION,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Two more."},
    ]
    second = client.chat.completions.create(
        model=model_id, messages=follow, max_tokens=2, temperature=0, extra_headers=headers
    )
    assert second.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Everything the session holds is reused: the first prompt and the spliced reply.
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert cached < second.usage.prompt_tokens


def test_stop_strings(client: openai.OpenAI, model_id: str) -> None:
    prompt = "1, 2, 3, 4, 5,"
    free = client.completions.create(model=model_id, prompt=prompt, max_tokens=5, temperature=0)
    text = free.choices[0].text
    stop = text.strip()[2:4] if len(text.strip()) >= 4 else text.strip()[-1:]
    cut = text.index(stop)
    stopped = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=5, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"


def error_code(call: Any) -> tuple[int, str, str]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict), body
    return info.value.status_code, body["code"], body["message"]


def test_errors_and_their_codes(client: openai.OpenAI, model_id: str, server: LiveServer) -> None:
    chat = client.chat.completions.create
    assert error_code(lambda: chat(model="no-such-model", messages=QUESTION))[:2] == (
        404,
        "model_not_found",
    )
    assert error_code(lambda: chat(model=model_id, messages=QUESTION, n=2))[:2] == (
        400,
        "unsupported_parameter",
    )
    assert error_code(lambda: chat(model=model_id, messages=QUESTION, temperature=9))[:2] == (
        400,
        "invalid_value",
    )
    assert error_code(lambda: chat(model=model_id, messages=QUESTION, presence_penalty=1))[:2] == (
        400,
        "unsupported_parameter",
    )
    long = [{"role": "user", "content": "apple " * 1500}]
    status, code, message = error_code(lambda: chat(model=model_id, messages=long, max_tokens=1))
    assert (status, code) == (400, "context_length_exceeded")
    assert "exceeds the available context size" in message and str(MAX_CONTEXT) in message
    assert any(int(n) > MAX_CONTEXT for n in _numbers(message))
    unauthorized = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        unauthorized.models.list()


def _numbers(text: str) -> list[str]:
    import re

    return re.findall(r"\d+", text)


def test_disconnect_cancels_in_the_worker_while_others_are_served(
    client: openai.OpenAI, model_id: str, server: LiveServer
) -> None:
    body = {
        "model": model_id,
        "messages": QUESTION,
        "max_tokens": 400,
        "temperature": 0.8,
        "stream": True,
    }
    first_chunk = threading.Event()
    closed_at: list[float] = []
    chunk_times: list[float] = []

    def abandon() -> None:
        with httpx.Client(
            base_url=server.base, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        chunk_times.append(time.monotonic())
                    if len(chunk_times) == 3:
                        first_chunk.set()
                    if len(chunk_times) >= 6:
                        break
            closed_at.append(time.monotonic())

    thread = threading.Thread(target=abandon)
    thread.start()
    assert first_chunk.wait(300)
    # Another client is served while the abandoned one is still generating.
    other = client.chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=2, temperature=0
    )
    assert other.choices[0].finish_reason in ("length", "stop")
    thread.join(300)
    assert closed_at
    # One decode step on this machine (shared CPUs make it slow): the worker may finish the
    # step it is in and the stats query waits for its loop too.
    gaps = sorted(b - a for a, b in zip(chunk_times[1:], chunk_times[2:], strict=False))
    step = gaps[len(gaps) // 2]
    stopped_after = None
    while time.monotonic() - closed_at[0] < 30:
        if server.gauge("active_requests") == 0:
            stopped_after = time.monotonic() - closed_at[0]
            break
        time.sleep(0.05)
    assert stopped_after is not None
    assert stopped_after < max(1.0, 3 * step), (stopped_after, step)
    assert server.gauge("cancelled_requests_total") >= 1


def test_disconnect_during_prefill_cancels(model_id: str, server: LiveServer) -> None:
    # What one 64-token prefill chunk costs on this machine right now (shared CPUs vary).
    started = time.monotonic()
    warm = server.http.post(
        "/v1/completions",
        json={"model": model_id, "prompt": "plum " * 60, "max_tokens": 1, "temperature": 0},
    )
    assert warm.status_code == 200
    chunk_s = time.monotonic() - started
    cancelled_before = server.gauge("cancelled_requests_total")
    assert cancelled_before is not None
    long = {
        "model": model_id,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "pear " * 900}],
    }
    with httpx.Client(
        base_url=server.base,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=min(1.0, chunk_s),
    ) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=long)  # gives up during the prefill
    closed = time.monotonic()
    assert server.gauge("cancelled_requests_total") == cancelled_before + 1
    stopped_after = None
    while time.monotonic() - closed < 120:
        if server.gauge("active_requests") == 0:
            stopped_after = time.monotonic() - closed
            break
        time.sleep(0.05)
    # ~900 prompt tokens are 15 chunks of 64: a cancel honoured between chunks stops the
    # worker within a chunk or two (plus the stats query, which waits for the loop too), long
    # before the prefill could finish.
    assert stopped_after is not None and stopped_after < 1.0 + 4 * chunk_s, (stopped_after, chunk_s)


def test_hostile_bodies_on_the_real_model(server: LiveServer) -> None:
    """Issue 23's probes on the real default model: each a 4xx JSON answer within seconds,
    the queue back to empty, and generation still served."""
    probes = [
        ("/v1/completions", {"prompt": "a " * 550_000}, 400),
        ("/tokenize", {"prompt": "a " * 550_000}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 200_000}, 400),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}],
                    },
                    {"role": "user", "content": "Hi"},
                ]
            },
            400,
        ),
    ]
    for path, body, status in probes:
        started = time.monotonic()
        response = server.http.post(path, json=body)
        assert response.status_code == status, response.text[:300]
        assert response.json()["error"]["code"]
        assert time.monotonic() - started < 10
    for name in ("active_requests", "queue_depth"):
        assert server.gauge(name) == 0
    response = server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 200, response.text
