"""What the Ray front ends add per request (issue 19's target: <= 2 ms median).

The same requests, one at a time on a kept-alive connection, to
  1. `tokenpipe serve` directly (one CPU worker), then
  2. `tokenpipe ray up`'s OpenAI API (Ray's local cluster, one replica of the same server:
     the HTTP front end -> the replica's own HTTP port; with --via-serve, Serve's proxy -> the
     replica deployment, the path before the direct one);
and, with --jsonl, `tokenpipe run` against `tokenpipe ray run` (front end -> the replica's
JSONL port).

Requests: `GET /v1/models` (no model work: the path's own cost), a one-token completion (end
to end; the model's time varies by a few ms on a busy CPU, so look at /v1/models for the
overhead), and the same in a named session (`x-session-affinity`). Prints the median and p90
of each, and the difference.

    python tools/bench_ray.py [--requests 200] [--jsonl] [--via-serve]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.client import run_command  # noqa: E402

SERVER_ARGS = ["--workers", "1", "--max-context", "1024"]
# Ray runs a replica that reserves one CPU with OMP_NUM_THREADS=1; the direct runs match it.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
SESSION = {"x-session-affinity": "bench"}  # routed by Serve's proxy to the session's replica


def timed(call: Callable[[], object], n: int) -> list[float]:
    for _ in range(max(3, n // 10)):  # warm-up
        call()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1000)
    return out


def wait_http(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def http_cases(base: str, n: int) -> dict[str, list[float]]:
    with httpx.Client(base_url=base, timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def models() -> None:
            client.get("/v1/models").raise_for_status()

        def completion() -> None:
            client.post("/v1/completions", json={**COMPLETION, "model": model}).raise_for_status()

        def in_session() -> None:
            client.post(
                "/v1/completions", json={**COMPLETION, "model": model}, headers=SESSION
            ).raise_for_status()

        return {
            "GET /v1/models": timed(models, n),
            "completion, 1 token": timed(completion, n),
            "same, x-session-affinity": timed(in_session, n),
        }


class JsonlPipe:
    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ONE_THREAD
        )
        assert self.process.stdout is not None
        self.ready = json.loads(self.process.stdout.readline())

    def ask(self, request: dict[str, object]) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        while json.loads(self.process.stdout.readline())["event"] == "token":
            pass

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def jsonl_cases(argv: list[str], n: int) -> dict[str, list[float]]:
    pipe = JsonlPipe(argv)
    try:
        generate = {"id": 1, "prompt": COMPLETION["prompt"], "max_new_tokens": 1}
        return {
            "tokenize": timed(lambda: pipe.ask({"op": "tokenize", "id": 1, "text": "hi"}), n),
            "generate, 1 token": timed(lambda: pipe.ask(generate), n),
        }
    finally:
        pipe.close()


def report(title: str, direct: dict[str, list[float]], via_ray: dict[str, list[float]]) -> None:
    print(f"\n{title}  (ms: median / p90)")
    for case, times in direct.items():
        d, r = statistics.median(times), statistics.median(via_ray[case])
        d90 = statistics.quantiles(times, n=10)[-1]
        r90 = statistics.quantiles(via_ray[case], n=10)[-1]
        print(
            f"  {case:22s} direct {d:7.2f} / {d90:7.2f}   ray {r:7.2f} / {r90:7.2f}"
            f"   added {r - d:+.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--port", type=int, default=18470)
    parser.add_argument("--jsonl", action="store_true", help="also tokenpipe run vs ray run")
    parser.add_argument(
        "--via-serve",
        action="store_true",
        help="HTTP through Ray Serve's proxy (ray up --via-serve)",
    )
    args = parser.parse_args()

    serve = subprocess.Popen(
        [*run_command(), "serve", "--port", str(args.port), "--log-level", "warning", *SERVER_ARGS],
        env=ONE_THREAD,
    )
    try:
        wait_http(f"http://127.0.0.1:{args.port}/health")
        direct_http = http_cases(f"http://127.0.0.1:{args.port}", args.requests)
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    direct_jsonl: dict[str, list[float]] = {}
    if args.jsonl:
        direct_jsonl = jsonl_cases([*run_command(), "run", *SERVER_ARGS], args.requests)

    import ray
    from ray import serve as ray_serve

    from supervisor.core import SupervisorConfig
    from supervisor.openai.app import ServerConfig
    from supervisor.ray.app import Deployment, connect, deploy

    address = connect(None, num_cpus=2)
    try:
        spec = Deployment(
            replicas=1,
            supervisor=SupervisorConfig(workers=1, max_context=1024),
            server=ServerConfig(),
            via_serve=args.via_serve,
        )
        deploy(spec, port=args.port + 1)
        ray_http = http_cases(f"http://127.0.0.1:{args.port + 1}", args.requests)
        ray_jsonl = (
            jsonl_cases([*run_command(), "ray", "run", "--address", address], args.requests)
            if args.jsonl
            else {}
        )
    finally:
        ray_serve.shutdown()
        ray.shutdown()
    report("OpenAI HTTP: tokenpipe serve vs tokenpipe ray up", direct_http, ray_http)
    if args.jsonl:
        report("JSONL: tokenpipe run vs tokenpipe ray run", direct_jsonl, ray_jsonl)


if __name__ == "__main__":
    main()
