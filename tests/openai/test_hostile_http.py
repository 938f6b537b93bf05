"""The probes of issue 23 against `tokenpipe serve` on real HTTP (fake worker): every request
answered once with a 4xx JSON body, soon; `/health` answering meanwhile; nothing left active
or queued; slow clients and idle connections closed; browsers kept out."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.openai.hostile_server import HostileServer

JSON = {"Content-Type": "application/json"}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[HostileServer]:
    # a render budget above the default 2 s: the probes below must be answered by their own
    # checks (prompt too long, bad values), not by the time budget, also on a busy 2-core box
    # (200k messages rendered in 0.02-0.9 s idle, past 2 s with two other test runs beside it)
    server = HostileServer(
        header_timeout=1.0, max_connections=40, body_timeout_s=1.0, render_budget_s=4.0
    ).start()
    yield server
    server.stop()


def _deep(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


PROBES: dict[str, tuple[str, bytes, int, str]] = {
    # name: (path, body, status, code)
    "1.1 MB prompt": (
        "/v1/completions",
        json.dumps({"prompt": "a " * 550_000}).encode(),
        400,
        "context_length_exceeded",
    ),
    "1.1 MB tokenize": (
        "/tokenize",
        json.dumps({"prompt": "a " * 550_000}).encode(),
        400,
        "context_length_exceeded",
    ),
    "200k messages": (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}] * 200_000}).encode(),
        400,
        "context_length_exceeded",
    ),
    "40k tools": (
        "/v1/chat/completions",
        json.dumps(
            {
                "messages": HI,
                "tools": [
                    {"type": "function", "function": {"name": f"t{i}"}} for i in range(40_000)
                ],
            }
        ).encode(),
        400,
        "context_length_exceeded",
    ),
    "tools nested 1,000 deep": (
        "/v1/chat/completions",
        (
            '{"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", '
            '"function": {"name": "f", "parameters": ' + _deep(1000) + "}}]}"
        ).encode(),
        400,
        "invalid_value",
    ),
    "arguments of [ x 5000": (
        "/v1/chat/completions",
        json.dumps(
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}],
                    },
                    *HI,
                ]
            }
        ).encode(),
        400,
        "invalid_value",
    ),
}


def _health_during(server: HostileServer, action: Callable[[], Any]) -> tuple[Any, float]:
    """`action()`'s result and the slowest `/health` answer while it ran."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.base, timeout=30) as http:
            while not stop.is_set():
                started = time.perf_counter()
                assert http.get("/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = action()
    finally:
        stop.set()
        poller.join()
    return result, max(latencies, default=0.0)


@pytest.mark.parametrize("name", list(PROBES))
def test_probe_answered_at_once(server: HostileServer, name: str) -> None:
    path, body, status, code = PROBES[name]

    def post() -> tuple[httpx.Response, float]:
        started = time.perf_counter()
        response = httpx.post(server.base + path, content=body, headers=JSON, timeout=30)
        return response, time.perf_counter() - started

    (response, elapsed), slowest_health = _health_during(server, post)
    assert response.status_code == status, response.text[:300]
    assert response.json()["error"]["code"] == code
    assert elapsed < 5, elapsed  # 0.02-0.9 s measured; the render budget is 2 s
    assert slowest_health < 1.0, slowest_health  # < 60 ms measured on an idle 2-core VM
    server.wait_idle()


def test_many_long_prompts_leak_nothing(server: HostileServer) -> None:
    """More over-long prompts than the queue holds: each answered, and the server still
    generates afterwards (they used to keep their queue slots forever)."""
    body = json.dumps({"prompt": "a " * 550_000}).encode()
    for _ in range(20):
        response = httpx.post(server.base + "/v1/completions", content=body, headers=JSON)
        assert response.status_code == 400
    server.wait_idle()
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert httpx.get(server.base + "/health").json()["status"] == "ok"


def test_twelve_thousand_spliced_turns(server: HostileServer) -> None:
    first = httpx.post(
        server.base + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=30
    )
    answer = first.json()["choices"][0]["message"]["content"]
    turns = [{"role": "assistant", "content": answer}, *HI] * 6_000
    started = time.perf_counter()
    response, slowest_health = _health_during(
        server,
        lambda: httpx.post(
            server.base + "/v1/chat/completions",
            json={"messages": [*HI, *turns], "max_tokens": 2},
            timeout=30,
        ),
    )
    assert response.status_code in (200, 400), response.text[:300]
    assert time.perf_counter() - started < 5
    assert slowest_health < 1.0
    server.wait_idle()


def _connect(server: HostileServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_slowloris_connections_are_closed(server: HostileServer) -> None:
    """30 clients writing their headers a byte at a time are closed after the header
    timeout (1 s here), while a normal client is served."""
    socks = [_connect(server) for _ in range(30)]
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    started = time.monotonic()
    for index in range(8):
        for sock in socks:
            try:
                sock.send(request[index : index + 1])
            except OSError:
                pass
        time.sleep(0.1)
    assert httpx.get(server.base + "/health", timeout=5).status_code == 200
    assert all(_closed(sock, within=5) for sock in socks)
    assert time.monotonic() - started < 8
    for sock in socks:
        sock.close()


def test_idle_connection_is_closed(server: HostileServer) -> None:
    with _connect(server) as sock:
        assert _closed(sock, within=5)


def test_slow_body_times_out(server: HostileServer) -> None:
    with _connect(server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"pro'
        )
        sock.settimeout(10)
        head = sock.recv(200)
    assert head.split(b" ")[1] == b"408", head
    server.wait_idle()


def test_connection_cap(server: HostileServer) -> None:
    socks = [_connect(server) for _ in range(45)]
    time.sleep(0.2)
    closed = sum(_closed(sock, within=0.2) for sock in socks)
    assert closed >= 5, closed  # beyond 40 open connections, closed at once
    for sock in socks:
        sock.close()
    time.sleep(0.2)
    assert httpx.get(server.base + "/health", timeout=5).status_code == 200


def test_simple_cross_origin_post_is_refused(server: HostileServer) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    port = server.port
    for headers in (
        {"Content-Type": "text/plain", "Origin": "http://evil.example"},
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/json", "Origin": "http://evil.example"},
        {"Content-Type": "application/json", "Host": f"evil.example:{port}"},
        {"Content-Type": "text/plain", "Host": f"evil.example:{port}", "Origin": "null"},
    ):
        response = httpx.post(server.base + "/v1/completions", content=body, headers=headers)
        assert response.status_code in (403, 415), (headers, response.text)
        assert response.json()["error"]["code"] in (
            "forbidden_host",
            "forbidden_origin",
            "unsupported_media_type",
        )
    reset = httpx.post(
        server.base + "/v1/sessions/victim/reset",
        headers={"Origin": "http://evil.example", "Host": f"evil.example:{port}"},
    )
    assert reset.status_code == 403
    assert httpx.get(f"http://localhost:{port}/health").status_code == 200
