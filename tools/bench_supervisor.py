"""Benchmark: what the supervisor adds on top of a worker.

1. Added latency per token event. The same requests go to a worker directly and through
   `tokenpipe run` (one worker), in one run. The worker (the fake from tests/supervisor,
   paced like a real decode loop) stamps each token event with CLOCK_MONOTONIC at emission;
   the reader records when the line arrives. Added latency = median(via supervisor) -
   median(direct). Target: < 100 us.
2. Relay rate. A fake worker writes token events as fast as it can (one burst per request);
   the reader counts the lines that come out of `tokenpipe run`. Target: >= 100,000 events/s.
   The same burst read from the worker directly shows the worker is not the bottleneck.

Usage: python tools/bench_supervisor.py [--requests 20] [--tokens 200] [--burst 200000]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[1]
FAKE = [sys.executable, str(REPO / "tests" / "supervisor" / "fake_worker.py")]
RUN = [
    sys.executable,
    "-c",
    "import sys; sys.argv[0]='tokenpipe'; from supervisor.cli import main; main()",
    "run",
]


def start(argv: list[str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        bufsize=0,
    )
    assert proc.stdout is not None
    ready = orjson.loads(proc.stdout.readline())
    assert ready.get("ready"), ready
    return proc


def via_supervisor(fake_args: list[str]) -> list[str]:
    return [*RUN, "--workers", "1", "--worker-command", " ".join([*FAKE, *fake_args])]


def send(proc: subprocess.Popen[bytes], request: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(orjson.dumps(request) + b"\n")


def stop(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(30)


def event_latencies(argv: list[str], requests: int, tokens: int) -> list[float]:
    """Microseconds from the worker's write to the reader's read, for every token event."""
    proc = start(argv)
    assert proc.stdout is not None
    readline = proc.stdout.readline
    out: list[float] = []
    for i in range(requests):
        send(proc, {"prompt": f"request {i}", "max_new_tokens": tokens, "id": i})
        while True:
            line = readline()
            arrived = time.monotonic_ns()
            event = orjson.loads(line)
            if event["event"] != "token":
                break
            out.append((arrived - event["t"]) / 1000)
    stop(proc)
    return out


def relay_rate(argv: list[str], bursts: int, size: int) -> float:
    """Token events per second read from `argv`'s stdout."""
    proc = start(argv)
    assert proc.stdout is not None
    read = proc.stdout.read
    best = 0.0
    for i in range(bursts):
        send(proc, {"prompt": "BURST", "max_new_tokens": size, "id": i})
        lines = 0
        t0 = time.perf_counter()
        while lines < size + 1:
            chunk = read(1 << 16)
            assert chunk
            lines += chunk.count(b"\n")
        best = max(best, size / (time.perf_counter() - t0))
    stop(proc)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--delay", type=float, default=0.001, help="worker seconds per token")
    parser.add_argument("--burst", type=int, default=200_000)
    parser.add_argument("--bursts", type=int, default=3)
    args = parser.parse_args()

    paced = ["--fake-timestamps", "--fake-token-delay", str(args.delay)]
    direct = event_latencies([*FAKE, *paced], args.requests, args.tokens)
    through = event_latencies(via_supervisor(paced), args.requests, args.tokens)
    d50, s50 = statistics.median(direct), statistics.median(through)
    d99 = statistics.quantiles(direct, n=100)[98]
    s99 = statistics.quantiles(through, n=100)[98]
    print(f"token events: {len(direct)} direct, {len(through)} via supervisor")
    print(f"worker -> reader latency, direct:         median {d50:8.1f} us   p99 {d99:8.1f} us")
    print(f"worker -> reader latency, via supervisor: median {s50:8.1f} us   p99 {s99:8.1f} us")
    print(f"added latency per token event (median):   {s50 - d50:8.1f} us  (target < 100 us)")

    burst = ["--fake-burst", "--fake-token-delay", "0"]
    raw = relay_rate([*FAKE, *burst], args.bursts, args.burst)
    relayed = relay_rate(via_supervisor(burst), args.bursts, args.burst)
    print(f"fake worker alone:         {raw:12,.0f} events/s")
    print(f"relayed by the supervisor: {relayed:12,.0f} events/s  (target >= 100,000)")


if __name__ == "__main__":
    main()
