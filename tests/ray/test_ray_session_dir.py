"""Ray replicas with --session-dir (issues 16 and 19) on Ray's local cluster, the default model,
one CPU worker per replica, driven through `tokenpipe run --ray`:

- each replica saves its sessions under DIR/rank-R (its own worker directories below);
- the application is deleted and deployed again with one replica more: every session goes
  back to the replica whose directory holds it, although the ring now maps some of them to
  the new replica (the router reads the restored sessions from replica metadata), and its
  first turn reuses the saved cache, through a new front end with no mirrored ids.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ray.test_ray_replicas import (
    Conversation,
    Front,
    holder,
    ray_processes,
    run_turn,
    start_local_cluster,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

from ray import serve  # noqa: E402  (test_ray_replicas skipped the module without Ray)

from supervisor.core import SupervisorConfig  # noqa: E402
from supervisor.openai.app import ServerConfig  # noqa: E402
from supervisor.ray.app import APP_NAME, Deployment, deploy  # noqa: E402
from supervisor.ray.ring import HashRing  # noqa: E402

SESSIONS = [f"saved-{i}" for i in range(6)]


def spec(replicas: int, session_dir: Path) -> Deployment:
    return Deployment(
        replicas=replicas,
        supervisor=SupervisorConfig(
            workers=1, max_context=1024, max_sessions=8, session_dir=str(session_dir)
        ),
        server=ServerConfig(),
        http=False,
        health_check_period_s=1.0,
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    import psutil

    before = {p.pid for p in ray_processes()}
    address = start_local_cluster(num_cpus=3)
    import ray

    try:
        yield address
    finally:
        started = [p for p in ray_processes() if p.pid not in before]
        serve.shutdown()
        ray.shutdown()
        _, alive = psutil.wait_procs(started, timeout=20)
        for process in alive:
            process.kill()


def saved(root: Path) -> dict[str, int]:
    return {d.name: len(list(d.glob("worker-*/*.tpsession"))) for d in root.glob("rank-*")}


def test_sessions_return_warm_to_the_replica_that_saved_them(cluster: str, tmp_path: Path) -> None:
    root = tmp_path / "sessions"
    deploy(spec(2, root))
    conversations = [Conversation(s) for s in SESSIONS]
    front = Front(cluster)
    try:
        for _ in range(2):
            run_turn(front, conversations)
        before = {s: holder(s)[0] for s in SESSIONS}
    finally:
        front.close()
    assert set(before.values()) == {0, 1}, before
    expected = {f"rank-{r}": sum(1 for v in before.values() if v == r) for r in (0, 1)}
    deadline = time.monotonic() + 60
    while saved(root) != expected and time.monotonic() < deadline:
        time.sleep(0.5)  # each worker saves its sessions once idle
    assert saved(root) == expected

    serve.delete(APP_NAME)
    deploy(spec(3, root))
    ring = HashRing(["rank-0", "rank-1", "rank-2"])
    moved_by_ring = [s for s in SESSIONS if ring.owner(s) != f"rank-{before[s]}"]
    assert moved_by_ring, "the third replica takes none of these sessions on the ring"
    assert {s: holder(s)[0] for s in SESSIONS} == before
    front = Front(cluster)  # a new front end: no mirrored ids, only the saved caches
    try:
        for conversation, done in zip(conversations, run_turn(front, conversations), strict=True):
            # (prompts are shorter than a prefix-cache block: reuse is the saved session's)
            assert done["reused_prompt_tokens"] > 0, (conversation.session, done)
    finally:
        front.close()
