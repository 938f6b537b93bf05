"""`tokenpipe serve`'s app on real HTTP (uvicorn with the serve CLI's protocol guards, in a
thread of the test process) over a supervisor that runs the fake worker: fast enough for
fuzzing, with every layer between the socket and the worker's pipe the real one."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import uvicorn

from supervisor.client import AsyncClient
from supervisor.openai.app import Server, ServerConfig, create_app
from supervisor.openai.connections import guarded_protocol
from tests.supervisor.conftest import fake_config

GAUGES = ("tokenpipe_active_requests", "tokenpipe_queued_requests", "tokenpipe_queue_depth")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class HostileServer:
    """Start with `start()`, stop with `stop()`; `base` is its URL."""

    def __init__(
        self, *, header_timeout: float = 2.0, max_connections: int = 64, **config: Any
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        supervisor_config = fake_config(1, max_queue=16)
        config.setdefault("max_queue", supervisor_config.max_queue)

        async def factory() -> AsyncClient:
            return await AsyncClient.in_process(supervisor_config)

        self.server = Server(ServerConfig(**config), factory)
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(
                create_app(self.server),
                host="127.0.0.1",
                port=self.port,
                log_level="error",
                http=guarded_protocol(header_timeout, max_connections),
                timeout_keep_alive=2,
                limit_concurrency=max_connections + 1,
            )
        )
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    def start(self) -> HostileServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the server did not become healthy")

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)

    def gauges(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in GAUGES:
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """The gauges once nothing is active or queued (fails after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            gauges = self.gauges()
            if len(gauges) == len(GAUGES) and not any(gauges.values()):
                return gauges
            assert time.monotonic() < deadline, gauges
            time.sleep(0.05)
