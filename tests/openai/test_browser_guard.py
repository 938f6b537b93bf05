"""BrowserGuard: Host, Origin and content type without an API key; CORS for --allow-origin."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from supervisor.openai.app import Server, ServerConfig, create_app
from supervisor.openai.browser import host_allowed, is_json
from tests.openai.test_app_fake import FakeClient

pytestmark = pytest.mark.anyio

BODY = {"prompt": "hi", "max_tokens": 1}


async def make(base_url: str = "http://127.0.0.1:8000", **config: Any) -> httpx.AsyncClient:
    fake = FakeClient()

    async def factory() -> FakeClient:
        return fake

    server = Server(ServerConfig(**config), factory)
    app = create_app(server)
    await server.start()
    await server.wait_ready()
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url)


def test_host_allowed() -> None:
    for host in (
        "localhost",
        "LOCALHOST:8000",
        "a.localhost",
        "127.0.0.1:1",
        "127.9.9.9",
        "[::1]:80",
    ):
        assert host_allowed(host, "127.0.0.1"), host
    for host in ("evil.example", "evil.example:8000", "10.0.0.1", "localhost.evil.example", ""):
        assert not host_allowed(host, "127.0.0.1"), host
    assert host_allowed("box.lan:8000", "box.lan")
    assert host_allowed("10.0.0.1:8000", "0.0.0.0") and not host_allowed("box.lan", "0.0.0.0")
    assert host_allowed("[fe80::1]", "::") and host_allowed("10.0.0.1", "10.0.0.1")


def test_is_json() -> None:
    assert is_json("application/json") and is_json("Application/JSON; charset=utf-8")
    assert is_json("application/vnd.api+json")
    assert not is_json("text/plain") and not is_json("") and not is_json("multipart/form-data")


async def test_refusals_without_api_key() -> None:
    http = await make()
    ok = await http.post("/v1/completions", json=BODY)
    assert ok.status_code == 200
    plain = await http.post(
        "/v1/completions", content=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"}
    )
    assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
    form = await http.post(
        "/v1/sessions/s/reset",
        content=b"a=b",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert form.status_code == 415
    assert (await http.post("/v1/sessions/s/reset")).status_code == 200  # no body: fine
    evil = await http.post("/v1/completions", json=BODY, headers={"Origin": "http://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "forbidden_origin"
    same = await http.post(
        "/v1/completions", json=BODY, headers={"Origin": "http://127.0.0.1:8000"}
    )
    assert same.status_code == 200
    rebound = await http.get("/v1/models", headers={"Host": "evil.example:8000"})
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "forbidden_host"


async def test_api_key_turns_the_guard_off() -> None:
    http = await make(base_url="http://evil.example", api_key="k")
    response = await http.post(
        "/v1/completions",
        content=b'{"prompt": "hi", "max_tokens": 1}',
        headers={
            "Authorization": "Bearer k",
            "Origin": "http://evil.example",
            "Content-Type": "text/plain",
        },
    )
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers


async def test_allowed_origin_gets_cors() -> None:
    origin = "http://localhost:5173"
    http = await make(allow_origins=(origin,))
    preflight = await http.options(
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "content-type" in preflight.headers["access-control-allow-headers"]
    response = await http.post("/v1/completions", json=BODY, headers={"Origin": origin})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == origin
    other = await http.post(
        "/v1/completions", json=BODY, headers={"Origin": "http://other.example"}
    )
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
