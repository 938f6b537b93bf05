"""The supervisor's heartbeat against the fake worker (no model, fast): a SIGSTOPped worker is
killed after the timeout and restarted, its requests end once with `worker_lost`, a live one
is never killed, and pings are not counted as load."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from protocol import ErrorEvent, GenerateRequest, TokenEvent
from supervisor.client import AsyncClient
from tests.supervisor.conftest import fake_config

pytestmark = pytest.mark.timeout(120)


async def _collect(
    client: AsyncClient, first: asyncio.Event | None = None, **fields: Any
) -> list[Any]:
    """The request's events; ``first`` is set once one has come."""
    events = []
    async for event in client.generate(GenerateRequest(**fields)):
        events.append(event)
        if first is not None:
            first.set()
    return events


def test_stopped_worker_is_killed_and_restarted() -> None:
    async def main() -> None:
        config = fake_config(
            1, "--fake-token-delay", "0.05", heartbeat_timeout=1.0, heartbeat_interval=0.2
        )
        client = await AsyncClient.in_process(config, stderr_sink=lambda _: None)
        sup = client.supervisor
        assert sup is not None
        try:
            slot = sup.slots[0]
            assert slot.process is not None
            old_pid = slot.process.pid
            assert old_pid is not None
            # Idle and healthy for 3 timeouts: pings are answered, nothing is killed.
            await asyncio.sleep(3.0)
            assert slot.process is not None and slot.process.pid == old_pid
            assert sup.state.loads()[0].queued == 0
            first = asyncio.Event()  # a token out first: a request with none is sent again
            task = asyncio.ensure_future(
                _collect(client, first, prompt="hello", max_new_tokens=500)
            )
            await asyncio.wait_for(first.wait(), 30)
            os.kill(old_pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            events = await asyncio.wait_for(task, 30)
            assert isinstance(events[-1], ErrorEvent) and events[-1].code == "worker_lost"
            assert all(isinstance(e, TokenEvent) for e in events[:-1])
            assert time.monotonic() - stopped_at < 10
            for _ in range(100):
                if slot.process is not None and slot.process.pid != old_pid:
                    break
                await asyncio.sleep(0.1)
            assert slot.process is not None and slot.process.pid != old_pid
            events = await _collect(client, prompt="again", max_new_tokens=3)
            assert events[-1].done and events[-1].completion_tokens == 3
        finally:
            await client.aclose()

    asyncio.run(main())


def test_heartbeat_off() -> None:
    async def main() -> None:
        config = fake_config(1, heartbeat_timeout=0)
        client = await AsyncClient.in_process(config, stderr_sink=lambda _: None)
        try:
            assert client.supervisor is not None
            assert client.supervisor._heartbeat_task is None
        finally:
            await client.aclose()

    asyncio.run(main())
