"""`tokenpipe run --tensor-parallel 2` on the CPU: one logical worker made of two gloo ranks.

A killed rank (the follower, not the process the supervisor started) takes its group down:
the request in flight ends in exactly one `worker_lost`, the supervisor restarts the group,
and the next request (in the same named session, rebuilt from the mirror) is served with the
tokens the group gave before."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from tiny_models import byte_level_tokenizer_json, tiny_config

from supervisor.pool import group_devices
from tests.supervisor.conftest import JsonlProcess, terminal

VOCAB = 263


def test_gpus_go_to_groups_in_order() -> None:
    gpus = [str(i) for i in range(8)]
    assert group_devices(gpus, 2) == ["0,1", "2,3", "4,5", "6,7"]
    assert group_devices(gpus, 4) == ["0,1,2,3", "4,5,6,7"]
    assert group_devices(gpus, 1) == gpus
    assert group_devices([None, None], 2) == [None, None]  # CPU groups start their own ranks
    with pytest.raises(ValueError, match="whole groups"):
        group_devices(["0", "1", "2"], 2)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JsonlProcess]:
    model = Path(tmp_path_factory.mktemp("tp-run"))
    config = tiny_config("llama", VOCAB, bos_token_id=260, eos_token_id=262)
    (model / "config.json").write_text(json.dumps(config))
    (model / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    proc = JsonlProcess.run(
        "--workers", "1", "--tensor-parallel", "2", "--model", str(model), "--random-weights",
        "--threads", "1", "--max-context", "256", "--max-sessions", "3",
    )  # fmt: skip
    ready = proc.read(timeout=120)
    assert ready is not None and ready["event"] == "ready", b"".join(proc.stderr)[-3000:]
    assert ready["workers"] == 1
    yield proc
    if proc.proc.poll() is None:
        proc.kill()


def _ask(proc: JsonlProcess, request: dict[str, Any]) -> dict[str, Any]:
    proc.send(request)
    events = proc.read_until(lambda e: terminal(e) and e.get("id") == request["id"], timeout=60)
    return events[-1]


def _stats(proc: JsonlProcess) -> dict[str, Any]:
    worker: dict[str, Any] = _ask(proc, {"op": "stats", "id": f"s{time.monotonic()}"})["stats"][
        "workers"
    ][0]
    return worker


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_rank_is_one_worker_lost_and_a_restarted_group(group: JsonlProcess) -> None:
    turn = {"prompt": "hello world", "max_new_tokens": 6, "session_id": "s"}
    before = _ask(group, {**turn, "id": "t1"})
    assert before["event"] == "done" and before["completion_tokens"] > 0
    rank0 = _stats(group)["pid"]
    followers = psutil.Process(rank0).children()
    assert len(followers) == 1  # rank 1, started by rank 0

    group.send({"prompt": "hello", "max_new_tokens": 240, "session_id": "s", "id": "doomed"})
    first = group.read(timeout=60)
    assert first is not None and first.get("id") == "doomed"
    followers[0].kill()
    events = group.read_until(lambda e: terminal(e) and e.get("id") == "doomed", timeout=60)
    lost = [e for e in events if e.get("id") == "doomed" and terminal(e)]
    assert [e.get("code") for e in lost] == ["worker_lost"], lost
    assert not psutil.pid_exists(rank0) or psutil.Process(rank0).status() == "zombie"

    again = _ask(group, {**turn, "id": "t2"})  # served by the restarted group
    assert again["event"] == "done", again
    assert again["generated_token_ids"] == before["generated_token_ids"]
    worker = _stats(group)
    assert worker["restarts"] == 1 and worker["pid"] != rank0
    assert len(psutil.Process(worker["pid"]).children()) == 1
    pong = _ask(group, {"op": "ping", "id": "p"})  # nothing more came for the lost request
    assert pong["event"] == "pong"
