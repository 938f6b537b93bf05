"""`tokenpipe serve` under hostile HTTP: the API key on every route, body and header limits,
loopback bind by default, and streaming clients that disconnect mid-stream (tiny model)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.reliability.helpers import CHILD_ENV, REPO, TOKENPIPE, write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "s3cret-key"
MAX_BODY = 64 * 1024


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.base = f"http://127.0.0.1:{port}"
        self.port = port


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("log") / "serve.err", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *TOKENPIPE,
            "serve",
            "--port",
            str(port),
            "--model",
            str(model),
            "--workers",
            "1",
            "--max-sessions",
            "6",
            "--api-key",
            KEY,
            "--max-body-bytes",
            str(MAX_BODY),
            "--worker-arg=--threads=1",
        ],  # no --host: the default bind is under test
        stdout=subprocess.DEVNULL,
        stderr=log,
        cwd=REPO,
        env={**os.environ, **CHILD_ENV},
    )
    server = Server(proc, port)
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{server.base}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
        time.sleep(0.5)
    yield server
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the workers run as children of the server"
    proc.terminate()
    # uvicorn re-raises SIGTERM after its graceful shutdown, so -15 is a clean exit too.
    assert proc.wait(120) in (0, -15)
    log.close()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"workers left behind: {alive}"


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [104]}),
    ("POST", "/v1/sessions/s1/reset", None),
    ("DELETE", "/v1/sessions/s1", None),
]


def test_binds_loopback_by_default(server: Server) -> None:
    listening = [
        c
        for c in psutil.Process(server.proc.pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
    ]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), listening


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_api_key_required_on_every_route(
    server: Server, method: str, path: str, body: object
) -> None:
    url = server.base + path
    for headers in (
        {},
        _auth("wrong"),
        _auth(KEY + "x"),
        _auth(KEY[:-1]),
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"X-Api-Key": KEY},
    ):
        response = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (headers, response.status_code, response.text)
        assert KEY not in response.text
    response = httpx.request(method, url, json=body, headers=_auth(), timeout=120)
    assert response.status_code != 401, response.text


def test_unauthenticated_paths_leak_nothing(server: Server) -> None:
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    metrics = httpx.get(server.base + "/metrics", timeout=10).text
    assert KEY not in metrics


def test_body_size_limit(server: Server) -> None:
    big = json.dumps({"prompt": "a" * (MAX_BODY * 2), "max_tokens": 1})
    response = httpx.post(
        server.base + "/v1/completions",
        content=big,
        timeout=30,
        headers={**_auth(), "Content-Type": "application/json"},
    )
    assert response.status_code == 413, response.text

    def chunks() -> Iterator[bytes]:  # no content-length: the limit holds while streaming
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 * 4):
            yield b"a" * 1024
        yield b'", "max_tokens": 1}'

    response = httpx.post(
        server.base + "/v1/completions",
        content=chunks(),
        timeout=30,
        headers={**_auth(), "Content-Type": "application/json"},
    )
    assert response.status_code == 413, response.text
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000000\r\n\r\n{}"
        )
        head = sock.recv(100)  # answered from the declared length, without reading a TB
    assert head.split(b" ")[1] == b"413", head


def _send_then_read(port: int, request: bytes) -> bytes:
    """Send an oversized request and read the answer's head; the server may answer and close
    before it has all of it (then the send breaks: the answer, if any, is still read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(request)
        except (ConnectionResetError, BrokenPipeError):
            pass
        try:
            return sock.recv(100)
        except (ConnectionResetError, BrokenPipeError):
            return b""


def test_header_size_limit(server: Server) -> None:
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n"
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(20_000))
    for request in (big, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"):
        head = _send_then_read(server.port, request)
        assert head == b"" or head.split(b" ")[1] in (b"400", b"413", b"431"), head
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


def test_streaming_clients_with_disconnects(server: Server) -> None:
    """20 concurrent streams, every third dropped after its first chunk: the others end with
    one final chunk and [DONE]; afterwards nothing is in flight and every slot is free."""
    import asyncio

    async def client(http: httpx.AsyncClient, index: int) -> str:
        body = {"prompt": f"client {index}", "max_tokens": 12, "temperature": 0, "stream": True}
        finals, chunks = 0, 0
        async with http.stream(
            "POST", server.base + "/v1/completions", json=body, headers=_auth()
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "done" if finals == 1 else f"finals={finals}"
                chunk = json.loads(line[6:])
                chunks += 1
                finals += sum(1 for c in chunk["choices"] if c.get("finish_reason"))
                if index % 3 == 0 and chunks == 1:
                    return "dropped"
        return "no [DONE]"

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(client(http, i) for i in range(20)))

    outcomes = asyncio.run(run())
    assert outcomes.count("dropped") == 7 and outcomes.count("done") == 13, outcomes
    deadline = time.monotonic() + 60
    while True:
        metrics = httpx.get(server.base + "/metrics", timeout=10).text
        gauges = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith(
                (
                    "tokenpipe_active_requests ",
                    "tokenpipe_queue_depth ",
                    "tokenpipe_queued_requests ",
                )
            )
        }
        if len(gauges) == 3 and not any(gauges.values()):
            break
        assert time.monotonic() < deadline, gauges
        time.sleep(0.5)
    assert "tokenpipe_cancelled_requests_total" in metrics
    cancelled = [
        line
        for line in metrics.splitlines()
        if line.startswith("tokenpipe_cancelled_requests_total")
    ]
    assert float(cancelled[0].split()[-1]) >= 1, cancelled
