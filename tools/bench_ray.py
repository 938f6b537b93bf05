"""What the Ray front ends add per request (issue 19's target: <= 2 ms median).

The same requests, one at a time on a kept-alive connection per path, to
  1. `tokenpipe serve` directly (one CPU worker, started alone),
  2. the replica's own HTTP port inside Ray (the same server: what the front end talks to;
     not with --via-serve),
  3. `tokenpipe ray up`'s OpenAI API (Ray's local cluster, one replica: the HTTP front end ->
     the replica's port; with --via-serve, Serve's proxy -> the replica deployment, the path
     before the direct one);
and, with --jsonl, `tokenpipe run` against `tokenpipe ray run` (front end -> the replica's
JSONL port). All of them run at once and take turns request by request, so load from other
jobs on a shared machine falls on every path alike.

Requests: `GET /v1/models` (no model work: the path's own cost), a one-token completion, and
the same in a named session (`x-session-affinity`). Prints the median and p90 of each, and
what Ray adds over `tokenpipe serve` (the target) and over the replica's own port (the front
end's own cost).

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
SESSION = {"x-session-affinity": "bench"}

Call = Callable[[], object]


def timed(paths: dict[str, Call], n: int) -> dict[str, list[float]]:
    """Each path's call `n` times, the paths taking turns; ms per call."""
    for _ in range(max(3, n // 10)):  # warm-up
        for call in paths.values():
            call()
    out: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(n):
        for name, call in paths.items():
            start = time.perf_counter()
            call()
            out[name].append((time.perf_counter() - start) * 1000)
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


def http_cases(
    bases: dict[str, tuple[str, dict[str, str]]], n: int
) -> dict[str, dict[str, list[float]]]:
    """`bases`: path name -> (URL, headers every request of that path carries)."""
    clients = {
        name: httpx.Client(base_url=base, headers=headers, timeout=60)
        for name, (base, headers) in bases.items()
    }
    try:
        model = next(iter(clients.values())).get("/v1/models").json()["data"][0]["id"]
        body = {**COMPLETION, "model": model}

        def models(client: httpx.Client) -> Call:
            return lambda: client.get("/v1/models").raise_for_status()

        def completion(client: httpx.Client, headers: dict[str, str] | None = None) -> Call:
            return lambda: client.post("/v1/completions", json=body, headers=headers)

        return {
            "GET /v1/models": timed({k: models(c) for k, c in clients.items()}, n),
            "completion, 1 token": timed({k: completion(c) for k, c in clients.items()}, n),
            "same, x-session-affinity": timed(
                {k: completion(c, SESSION) for k, c in clients.items()}, n
            ),
        }
    finally:
        for client in clients.values():
            client.close()


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


def jsonl_cases(argvs: dict[str, list[str]], n: int) -> dict[str, dict[str, list[float]]]:
    pipes = {name: JsonlPipe(argv) for name, argv in argvs.items()}
    try:
        tokenize = {"op": "tokenize", "id": 1, "text": "hi"}
        generate = {"id": 1, "prompt": COMPLETION["prompt"], "max_new_tokens": 1}

        def ask(pipe: JsonlPipe, request: dict[str, object]) -> Call:
            return lambda: pipe.ask(request)

        return {
            "tokenize": timed({k: ask(p, tokenize) for k, p in pipes.items()}, n),
            "generate, 1 token": timed({k: ask(p, generate) for k, p in pipes.items()}, n),
        }
    finally:
        for pipe in pipes.values():
            pipe.close()


def report(title: str, cases: dict[str, dict[str, list[float]]]) -> None:
    print(f"\n{title}  (ms: median / p90; added: median over `direct`)")
    for case, paths in cases.items():
        medians = {name: statistics.median(times) for name, times in paths.items()}
        cells = [
            f"{name} {medians[name]:7.2f} / {statistics.quantiles(times, n=10)[-1]:7.2f}"
            for name, times in paths.items()
        ]
        added = f"added {medians['ray'] - medians['direct']:+.2f}"
        if "replica" in medians:
            added += f" (front end alone {medians['ray'] - medians['replica']:+.2f})"
        print(f"  {case:26s} {'   '.join(cells)}   {added}")


def replica_http_port() -> tuple[str, dict[str, str]]:
    """The replica's own HTTP port and the secret header it wants, as the front ends learn
    them (Serve's replica metadata)."""
    from supervisor.ray.app import replica_handle
    from supervisor.ray.directory import Directory
    from supervisor.ray.endpoints import SECRET_HEADER
    from supervisor.ray.router import publish_to

    directory = Directory()
    publish_to(directory)
    replica_handle().ready_info.remote().result(timeout_s=120)
    deadline = time.monotonic() + 30
    while not directory.live and time.monotonic() < deadline:
        time.sleep(0.1)
    replica = directory.live[0]
    return f"http://{replica.http}", {SECRET_HEADER: replica.secret}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--port", type=int, default=18470)
    parser.add_argument("--jsonl", action="store_true", help="also tokenpipe run vs ray run")
    parser.add_argument(
        "--via-serve", action="store_true", help="HTTP through Serve's proxy (ray up --via-serve)"
    )
    args = parser.parse_args()

    import ray
    from ray import serve as ray_serve

    from supervisor.core import SupervisorConfig
    from supervisor.openai.app import ServerConfig
    from supervisor.ray.app import Deployment, connect, deploy

    serve = subprocess.Popen(
        [*run_command(), "serve", "--port", str(args.port), "--log-level", "warning", *SERVER_ARGS],
        env=ONE_THREAD,
    )
    address = connect(None, num_cpus=2)
    try:
        wait_http(f"http://127.0.0.1:{args.port}/health")
        spec = Deployment(
            replicas=1,
            supervisor=SupervisorConfig(workers=1, max_context=1024),
            server=ServerConfig(),
            via_serve=args.via_serve,
        )
        deploy(spec, port=args.port + 1)
        bases = {"direct": (f"http://127.0.0.1:{args.port}", {})}
        if not args.via_serve:
            bases["replica"] = replica_http_port()
        bases["ray"] = (f"http://127.0.0.1:{args.port + 1}", {})
        http = http_cases(bases, args.requests)
        serve.terminate()
        serve.wait(timeout=60)
        jsonl = {}
        if args.jsonl:
            jsonl = jsonl_cases(
                {
                    "direct": [*run_command(), "run", *SERVER_ARGS],
                    "ray": [*run_command(), "ray", "run", "--address", address],
                },
                args.requests,
            )
    finally:
        if serve.poll() is None:
            serve.terminate()
            serve.wait(timeout=60)
        ray_serve.shutdown()
        ray.shutdown()
    path = "Serve's proxy" if args.via_serve else "the direct path"
    report(f"OpenAI HTTP: tokenpipe serve vs tokenpipe ray up ({path})", http)
    if args.jsonl:
        report("JSONL: tokenpipe run vs tokenpipe ray run", jsonl)


if __name__ == "__main__":
    main()
