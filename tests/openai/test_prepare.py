"""Preparation off the event loop: the render budget, splicing in one pass, fixed messages for
deep nesting and internal errors, and `/health` when every queue is full."""

from __future__ import annotations

import time
from typing import Any

import pytest

from supervisor.openai.sessions import TurnStore, render_prompt, spliceable_turns, turn_fingerprint
from supervisor.openai.templates import GEMMA_TEMPLATE, ChatTemplate
from tests.openai.test_app_fake import CHAT, FakeClient, make

pytestmark = pytest.mark.anyio

SLOW_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
)


async def test_render_budget_answers_request_too_complex() -> None:
    _, http = await make(FakeClient(), chat_template=SLOW_TEMPLATE, render_budget_s=0.3)
    started = time.monotonic()
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert time.monotonic() - started < 3
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "request_too_complex"
    health = await http.get("/health")
    assert health.status_code == 200


def test_splicing_many_turns_is_one_pass() -> None:
    template = ChatTemplate(GEMMA_TEMPLATE, "<bos>", "<eos>")
    store = TurnStore()
    store.remember("s", turn_fingerprint("ok", None), [7, 8])
    messages: list[dict[str, Any]] = [
        m
        for _ in range(12_000)
        for m in ({"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"})
    ]
    started = time.monotonic()
    rendered = render_prompt(
        template,
        messages,
        tools=None,
        template_kwargs={},
        turn_ids=spliceable_turns(store, "s", messages),
    )
    # was minutes (one text scan per turn); ~1 s idle, 6 s beside two other test runs
    assert time.monotonic() - started < 15
    assert rendered.spliced_turns == 12_000
    assert rendered.segments[1] == {"ids": [7, 8]}
    assert rendered.segments[0] == {
        "text": "<start_of_turn>user\nq<end_of_turn>\n<start_of_turn>model\n"
    }


def test_a_client_sentinel_is_not_spliced() -> None:
    template = ChatTemplate(GEMMA_TEMPLATE, "<bos>", "<eos>")
    messages = [
        {"role": "user", "content": "\ue000tokenpipe-turn-1\ue001"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    rendered = render_prompt(template, messages, tools=None, template_kwargs={}, turn_ids={1: (5,)})
    assert rendered.spliced_turns == 0  # the sentinel appeared twice: rendered as text
    assert "\ue000tokenpipe-turn-1\ue001" in "".join(s.get("text", "") for s in rendered.segments)


async def test_internal_error_carries_no_exception_text() -> None:
    fake = FakeClient()

    async def broken(request: dict[str, Any]) -> Any:
        raise RuntimeError("secret internals /etc/passwd")
        yield  # pragma: no cover

    fake.generate = broken  # type: ignore[method-assign]
    _, http = await make(fake)
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    assert "secret" not in response.text and "passwd" not in response.text


async def test_health_says_overloaded_when_every_queue_is_full() -> None:
    fake = FakeClient()
    fake.active = 4
    _, http = await make(fake, max_queue=4)
    health = await http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "overloaded"
    fake.active = 3
    assert (await http.get("/health")).status_code == 200


def test_collector_runs_under_a_steady_stream_of_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlapping jobs keep the cyclic collector off, but never for longer than
    GC_OFF_AT_MOST_S: a young collection runs at a job's end past that."""
    import gc

    from supervisor.openai import prepare

    now = [100.0]
    collected: list[int] = []
    monkeypatch.setattr(prepare.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(prepare.gc, "collect", lambda generation=2: collected.append(generation))
    mode = prepare._JobMode()
    assert gc.isenabled()
    mode.__enter__()  # job A
    assert not gc.isenabled()
    mode.__enter__()  # job B overlaps A
    mode.__exit__()  # B ends early: nothing to do yet
    assert collected == []
    mode.__enter__()  # C overlaps A
    now[0] += prepare.GC_OFF_AT_MOST_S + 1
    mode.__exit__()  # C ends with the collector off too long: a young collection
    assert collected == [1] and not gc.isenabled()
    mode.__exit__()  # A ends: the collector is back
    assert gc.isenabled()
