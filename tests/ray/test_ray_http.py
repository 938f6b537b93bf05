"""The OpenAI API of `tokenpipe ray up` (Ray's local cluster, two replicas of one CPU worker,
the default model) with the official `openai` client. By default the HTTP front end passes
each request straight to its replica's own HTTP port (supervisor/ray/http_front.py):

- a session named by `x-session-affinity` or only in the body (`session_id`) goes to its
  replica, the one the JSONL router would pick for the same session (no replica forwards it):
  every turn after the first is warm;
- requests without a session are served by any replica;
- a replica killed mid-stream: the stream ends with one `worker_lost` chunk and `[DONE]`, and
  the session's next request is served.

`ray up --via-serve` (Serve's proxy, the replica deployment as the ingress; ingress.py) and
`--separate-ingress` are checked last, after a redeploy.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.ray.test_ray_replicas import holder, ray_processes, start_local_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

import openai  # noqa: E402
from ray import serve  # noqa: E402  (test_ray_replicas skipped the module without Ray)

from supervisor.core import SupervisorConfig  # noqa: E402
from supervisor.openai.app import ServerConfig  # noqa: E402
from supervisor.ray.app import Deployment, deploy  # noqa: E402
from supervisor.ray.ring import HashRing  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    import psutil
    import ray

    before = {p.pid for p in ray_processes()}
    start_local_cluster(num_cpus=2)
    port = free_port()
    try:
        deploy(
            Deployment(
                replicas=2,
                supervisor=SupervisorConfig(workers=1, max_context=1024, max_sessions=8),
                server=ServerConfig(),
            ),
            port=port,
        )
        with openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
        ) as api:
            yield api
    finally:
        started = [p for p in ray_processes() if p.pid not in before]
        serve.shutdown()
        ray.shutdown()
        _, alive = psutil.wait_procs(started, timeout=20)
        for process in alive:
            process.kill()


def chat(api: openai.OpenAI, messages: list[dict[str, Any]], **session: Any) -> Any:
    model = api.models.list().data[0].id
    return api.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, **session  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("how", ["header", "body"])
def test_sessions_resume_warm_on_their_replica(client: openai.OpenAI, how: str) -> None:
    ring = HashRing(["rank-0", "rank-1"])
    candidates = [f"http-{how}-{i}" for i in range(40)]
    sessions = [s for s in candidates if ring.owner(s) == "rank-0"][:2]
    sessions += [s for s in candidates if ring.owner(s) == "rank-1"][:2]
    ranks = {s: holder(s)[0] for s in sessions}
    assert set(ranks.values()) == {0, 1}, ranks
    forwarded_before = forwarded(sessions)
    for turn in range(2):
        for session in sessions:
            if how == "header":
                named: dict[str, Any] = {"extra_headers": {"x-session-affinity": session}}
            else:
                named = {"extra_body": {"session_id": session}}
            messages = [{"role": "user", "content": f"Name a colour for {session}."}]
            if turn:
                messages += [
                    {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": "Another one?"},
                ]
            answer = chat(client, messages, **named)
            if turn:
                assert answer.usage.prompt_tokens_details.cached_tokens > 0, (session, answer.usage)
    assert {s: holder(s)[0] for s in sessions} == ranks
    # the front end sent each request to its session's replica: none was forwarded
    assert forwarded(sessions) == forwarded_before


def forwarded(sessions: list[str]) -> int:
    """HTTP requests the two replicas forwarded so far (one session of each reaches it)."""
    from supervisor.ray.app import replica_handle

    by_rank = {holder(s)[0]: s for s in sessions}
    infos = [
        replica_handle().ready_info.remote(session_key=s).result(timeout_s=30)
        for s in by_rank.values()
    ]
    return sum(int(info["http_forwarded"]) for info in infos)


def test_requests_without_a_session(client: openai.OpenAI) -> None:
    for _ in range(3):
        answer = chat(client, [{"role": "user", "content": "Hello"}])
        assert answer.choices[0].message.content is not None


def test_direct_path_answers_a_lost_replica(client: openai.OpenAI) -> None:
    """The default HTTP front end: a replica killed mid-stream ends the event stream with one
    `worker_lost` error chunk and `[DONE]`; the session's next request is served."""
    kill_mid_stream(client, "victim")


def test_via_serve_forwards_body_sessions(client: openai.OpenAI) -> None:
    """`ray up --via-serve`: Serve's proxy routes by the header; a session named only in the
    body is forwarded by the replica that got it. Either way turn 2 is warm. (Redeploys.)"""
    redeploy(client, via_serve=True)
    ring = HashRing(["rank-0", "rank-1"])
    candidates = [f"via-serve-{i}" for i in range(40)]
    sessions = [next(s for s in candidates if ring.owner(s) == f"rank-{r}") for r in (0, 1)]
    for how in ("header", "body"):
        for turn in range(2):
            for session in sessions:
                named: dict[str, Any] = (
                    {"extra_headers": {"x-session-affinity": f"{how}-{session}"}}
                    if how == "header"
                    else {"extra_body": {"session_id": f"{how}-{session}"}}
                )
                messages = [{"role": "user", "content": f"Name a colour for {session}."}]
                answer = chat(client, messages, **named)
                if turn:
                    assert answer.usage.prompt_tokens_details.cached_tokens > 0, answer.usage


def test_separate_ingress_answers_a_lost_replica(client: openai.OpenAI) -> None:
    """`ray up --via-serve --separate-ingress`: a replica killed mid-stream ends the event
    stream with one `worker_lost` error chunk and `[DONE]`; the next request is served. (Runs
    last: it redeploys the application.)"""
    redeploy(client, via_serve=True, separate_ingress=True)  # the replicas stay up
    kill_mid_stream(client, "victim-2")


def redeploy(client: openai.OpenAI, **path: bool) -> None:
    """Deploy again on the same port. Serve's proxy is started with Serve or never: going from
    the direct path (no proxy) to --via-serve starts Serve again."""
    from supervisor.ray.app import APP_NAME

    base = str(client.base_url).rstrip("/")
    status = serve.status().applications.get(APP_NAME)
    if path.get("via_serve") and status is not None and "TokenpipeHttpFront" in status.deployments:
        serve.shutdown()
    deploy(
        Deployment(
            replicas=2,
            supervisor=SupervisorConfig(workers=1, max_context=1024, max_sessions=8),
            server=ServerConfig(),
            **path,
        ),
        port=int(base.rsplit(":", 1)[1].split("/")[0]),
    )


def kill_mid_stream(client: openai.OpenAI, session: str) -> None:
    import os
    import signal

    import httpx

    base = str(client.base_url).rstrip("/")
    _rank, pid = holder(session)
    model = client.models.list().data[0].id
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count to one hundred."}],
        "max_tokens": 300,
        "stream": True,
    }
    lines: list[str] = []
    with httpx.Client(timeout=120) as http:
        headers = {"x-session-affinity": session}
        with http.stream("POST", f"{base}/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    os.kill(pid, signal.SIGKILL)
    errors = [line for line in lines if "worker_lost" in line]
    assert len(errors) == 1 and lines[-1] == "data: [DONE]", lines[-3:]
    again = chat(client, [{"role": "user", "content": "Hello"}], extra_headers=headers)
    assert again.choices[0].message.content is not None
