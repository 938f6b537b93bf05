"""Load test: many concurrent sessions through `tokenpipe run`, with random cancels.

    python tools/load_test.py run --sessions 64 --requests 20 [--model M] [--write]
    python tools/load_test.py http --clients 200 [--model M] [--write]

`run`: S concurrent conversations (3 in 4 on named sessions with growing prompts, so resume
is exercised; the rest on the scratch session), R greedy requests each, a fraction cancelled
at a random point. Afterwards it checks that
  - every request got exactly one terminal line, with its own id, and no token line after it;
  - greedy outputs of completed requests equal the same requests run one at a time (all of
    them, or a seeded sample of `--verify` requests);
  - stats show no active or queued request and every KV slot free once sessions are closed;
  - each worker's RSS is back within 5% of where it was after the warm-up.
`http`: C concurrent streaming clients against `tokenpipe serve` (`/v1/completions`,
`stream: true`), a fraction disconnecting mid-stream; every client that stayed gets exactly
one final chunk with a finish_reason and `[DONE]`; afterwards `/metrics` must show no active
or queued request, and the RSS of the server and its workers must be back within 5%.

`--write` records the result as rows of RELIABILITY.md (`update_row` is shared with the other
reliability tools). Exit status 0 only when every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

REPO = Path(__file__).resolve().parents[1]
TOKENPIPE = [
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'tokenpipe'; from supervisor.cli import main; main()",
]
TERMINAL = frozenset(
    {"done", "error", "opened", "closed", "reset", "pong", "info", "stats", "tokens", "text"}
)
RELIABILITY = REPO / "RELIABILITY.md"
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
WORDS = (
    "river stone light garden window morning quiet paper bridge candle winter forest "
    "letter music ocean silver"
).split()


# --------------------------------------------------------------------------- RELIABILITY.md

_HEADER = """# Reliability

What was thrown at tokenpipe and what held. Every row is written by the script named in it
(`--write`); rerun the script to refresh its row. CI runs scaled-down versions of the same
checks in `tests/reliability/`.

| check | run by | what was tried | what held | result | when |
| --- | --- | --- | --- | --- | --- |
"""


def update_row(
    key: str, script: str, tried: str, held: str, ok: bool, path: Path = RELIABILITY
) -> None:
    """Insert or replace the table row whose first cell is `key`."""
    text = path.read_text() if path.exists() else _HEADER
    if "| check |" not in text:
        text = _HEADER + "\n" + text
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    row = f"| {key} | `{script}` | {tried} | {held} | {'PASS' if ok else 'FAIL'} | {when} |"
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"| {key} |"):
            lines[i] = row
            break
    else:
        last = max(i for i, line in enumerate(lines) if line.startswith("|"))
        lines.insert(last + 1, row)
    path.write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- JSONL driver


class Supervisor:
    """`tokenpipe run` as an asyncio child: requests by id, every event line recorded."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.events: list[dict[str, Any]] = []
        self.waiters: dict[Any, asyncio.Queue[dict[str, Any]]] = {}
        self.bad_lines = 0
        self.reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, args: list[str]) -> tuple[Supervisor, dict[str, Any]]:
        process = await asyncio.create_subprocess_exec(
            *TOKENPIPE,
            "run",
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=None,
            cwd=REPO,
            limit=1 << 24,
            env={**os.environ, **CHILD_ENV},
        )
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 900)
        if not line:
            raise SystemExit("tokenpipe run exited before its ready line")
        self = cls(process)
        self.reader = asyncio.ensure_future(self._read())
        return self, orjson.loads(line)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while True:
            line = await self.process.stdout.readline()
            if not line:
                break
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                self.bad_lines += 1
                continue
            if not isinstance(event, dict) or "event" not in event:
                self.bad_lines += 1
                continue
            self.events.append(event)
            queue = self.waiters.get(event.get("id"))
            if queue is not None:
                queue.put_nowait(event)

    def send(self, request: dict[str, Any]) -> None:
        self.send_raw_line(orjson.dumps(request))

    def send_raw_line(self, line: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + b"\n")

    async def stream(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """Send and collect the request's lines up to its terminal one."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.waiters[request["id"]] = queue
        self.send(request)
        out = []
        while True:
            event = await asyncio.wait_for(queue.get(), 1800)
            out.append(event)
            if event["event"] in TERMINAL:
                del self.waiters[request["id"]]
                return out

    async def stats(self, tag: str) -> dict[str, Any]:
        events = await self.stream({"op": "stats", "id": f"stats-{tag}-{time.monotonic()}"})
        stats = events[-1]["stats"]
        assert isinstance(stats, dict)
        return stats

    async def close(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.close()
        code = await asyncio.wait_for(self.process.wait(), 300)
        if self.reader is not None:
            await self.reader
        return code


def check_exactly_once(sent: list[Any], events: list[dict[str, Any]]) -> list[str]:
    """Problems found: an id with no or several terminal lines, a foreign id, a late token."""
    problems = []
    # An `unknown_id` answer to a cancel that raced the request's end answers the cancel.
    events = [e for e in events if not (e["event"] == "error" and e.get("op") == "cancel")]
    counts = Counter(e.get("id") for e in events if e["event"] in TERMINAL)
    sent_set = set(sent)
    problems += [f"no terminal line for {i!r}" for i in sent if counts[i] == 0]
    problems += [f"{n} terminal lines for {i!r}" for i, n in counts.items() if n > 1]
    problems += [f"answer with unknown id {i!r}" for i in counts if i not in sent_set]
    ended: set[Any] = set()
    for event in events:
        if event["event"] == "token" and event.get("id") in ended:
            problems.append(f"token after the end of {event.get('id')!r}")
        elif event["event"] in TERMINAL:
            ended.add(event.get("id"))
    return problems


# --------------------------------------------------------------------------- run mode


@dataclass
class RunResult:
    sent: list[Any] = field(default_factory=list)
    done: dict[Any, dict[str, Any]] = field(default_factory=dict)  # rid -> terminal line
    prompts: dict[Any, dict[str, Any]] = field(default_factory=dict)  # rid -> request
    cancels: int = 0


def _prompt(session: int, turn: int) -> str:
    rng = random.Random(session * 1000 + 7)
    words = [rng.choice(WORDS) for _ in range(4 + 3 * turn)]
    return f"Note {session}: " + " ".join(words)


async def _conversation(
    sup: Supervisor,
    result: RunResult,
    index: int,
    requests: int,
    max_new: int,
    cancel_rate: float,
    rng: random.Random,
) -> None:
    named = index % 4 != 3
    sid = f"load-{index}"
    if named:
        rid = f"open-{sid}"
        result.sent.append(rid)
        opened = await sup.stream({"op": "open", "session_id": sid, "id": rid})
        if opened[-1]["event"] != "opened":
            named = False  # no slot: fall back to the scratch session
    for turn in range(requests):
        rid = f"{sid}-r{turn}"
        request: dict[str, Any] = {
            "id": rid,
            "prompt": _prompt(index, turn),
            "max_new_tokens": max_new,
        }
        if named:
            request["session_id"] = sid
        result.sent.append(rid)
        result.prompts[rid] = request
        cancel_after = rng.randrange(0, max_new) if rng.random() < cancel_rate else None
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        sup.waiters[rid] = queue
        sup.send(request)
        tokens = 0
        if cancel_after == 0:
            sup.send({"op": "cancel", "id": rid})
            result.cancels += 1
        while True:
            event = await asyncio.wait_for(queue.get(), 1800)
            if event["event"] == "token":
                tokens += 1
                if cancel_after is not None and tokens == cancel_after:
                    sup.send({"op": "cancel", "id": rid})
                    result.cancels += 1
                continue
            result.done[rid] = event
            del sup.waiters[rid]
            break
    if named:
        rid = f"close-{sid}"
        result.sent.append(rid)
        await sup.stream({"op": "close", "session_id": sid, "id": rid})


def _worker_rss(stats: dict[str, Any]) -> list[int]:
    return [int(w.get("rss_bytes") or 0) for w in stats.get("workers", [])]


async def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    sessions, requests = args.sessions, args.requests
    flags = [
        "--workers",
        str(args.workers),
        "--max-sessions",
        str(sessions + 1),
        "--max-context",
        str(args.max_context),
        "--max-queue",
        str(4 * sessions + 16),
        "--threads",
        str(args.threads),
    ]
    if args.model:
        flags += ["--model", args.model]
    started = time.monotonic()
    sup, ready = await Supervisor.start(flags)
    problems: list[str] = []
    # Warm-up: a few requests at the concurrency of the test, so the allocator's high-water
    # mark is reached before the baseline RSS is taken.
    warm = [
        sup.stream({"id": f"warm-{i}", "prompt": _prompt(i, 2), "max_new_tokens": 4})
        for i in range(min(sessions, 16))
    ]
    await asyncio.gather(*warm)
    baseline = await sup.stats("baseline")
    rss_start = _worker_rss(baseline)
    rng = random.Random(args.seed)
    result = RunResult()
    t0 = time.monotonic()

    async def progress() -> None:
        while True:
            await asyncio.sleep(30)
            print(
                f"load_test: {len(result.done)}/{sessions * requests} requests answered after "
                f"{time.monotonic() - t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    reporter = asyncio.ensure_future(progress())
    await asyncio.gather(
        *(
            _conversation(
                sup,
                result,
                i,
                requests,
                args.max_new,
                args.cancel_rate,
                random.Random(rng.random()),
            )
            for i in range(sessions)
        )
    )
    reporter.cancel()
    load_s = time.monotonic() - t0
    events = [
        e
        for e in sup.events
        if str(e.get("id", "")).startswith(("load-", "open-load", "close-load"))
    ]
    problems += check_exactly_once(result.sent, events)
    errors = Counter(e.get("code") for e in result.done.values() if e["event"] == "error")
    if errors:
        problems.append(f"error answers: {dict(errors)}")
    finish = Counter(e.get("finish_reason") for e in result.done.values() if e["event"] == "done")
    after = await sup.stats("after")
    if after["active_requests"] or after["queued_requests"]:
        problems.append(
            f"requests left: active {after['active_requests']}, queued {after['queued_requests']}"
        )
    max_slots = int(ready["max_sessions"])
    if after["sessions"] or after["free_slots"] != max_slots:
        problems.append(
            f"KV slots leaked: sessions {after['sessions']}, free "
            f"{after['free_slots']} of {max_slots}"
        )
    rss_end = _worker_rss(after)
    growth = [(end - start) / start for start, end in zip(rss_start, rss_end, strict=True)]
    if any(g > 0.05 for g in growth):
        problems.append(f"worker RSS grew by {[f'{g:+.1%}' for g in growth]}")
    # Greedy outputs against the same requests one at a time, on the scratch session.
    completed = [
        rid
        for rid, e in result.done.items()
        if e["event"] == "done" and e["finish_reason"] != "cancelled"
    ]
    sample = (
        completed
        if args.verify <= 0
        else random.Random(args.seed).sample(completed, min(args.verify, len(completed)))
    )
    mismatches = 0
    for rid in sample:
        request = {k: v for k, v in result.prompts[rid].items() if k != "session_id"}
        request["id"] = f"verify-{rid}"
        alone = (await sup.stream(request))[-1]
        if alone.get("generated_token_ids") != result.done[rid].get("generated_token_ids"):
            mismatches += 1
            if mismatches <= 5:
                problems.append(
                    f"{rid}: concurrent {result.done[rid].get('generated_token_ids')}"
                    f" != alone {alone.get('generated_token_ids')}"
                )
    if mismatches > 5:
        problems.append(f"... {mismatches} greedy mismatches in all")
    code = await sup.close()
    if code != 0:
        problems.append(f"tokenpipe run exited with status {code}")
    if sup.bad_lines:
        problems.append(f"{sup.bad_lines} stdout lines were not protocol events")
    return {
        "mode": "run",
        "sessions": sessions,
        "requests_per_session": requests,
        "requests": len(result.prompts),
        "cancels_sent": result.cancels,
        "finish_reasons": dict(finish),
        "errors": dict(errors),
        "verified": len(sample),
        "mismatches": mismatches,
        "rss_start": rss_start,
        "rss_end": rss_end,
        "rss_growth": [round(g, 4) for g in growth],
        "load_seconds": round(load_s, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "problems": problems,
        "model": args.model or "default (Gemma 3 270M)",
    }


# --------------------------------------------------------------------------- http mode


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _http_client(
    http: Any,
    base: str,
    index: int,
    max_new: int,
    disconnect_rate: float,
    rng: random.Random,
    headers: dict[str, str],
) -> dict[str, Any]:
    body = {
        "prompt": _prompt(index, index % 3),
        "max_tokens": max_new,
        "temperature": 0,
        "stream": True,
    }
    drop_after = rng.randrange(1, max_new + 1) if rng.random() < disconnect_rate else None
    chunks = finals = 0
    saw_done = False
    async with http.stream(
        "POST", f"{base}/v1/completions", json=body, headers=headers
    ) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "dropped": False, "ok": False}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                saw_done = True
                continue
            chunk = json.loads(data)
            chunks += 1
            if any(c.get("finish_reason") for c in chunk.get("choices", [])):
                finals += 1
            if drop_after is not None and chunks >= drop_after:
                return {"status": 200, "dropped": True, "ok": True}
    return {
        "status": 200,
        "dropped": False,
        "ok": saw_done and finals == 1,
        "finals": finals,
        "done": saw_done,
    }


async def http_mode(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    flags = [
        "--port",
        str(port),
        "--workers",
        str(args.workers),
        "--max-sessions",
        str(args.max_sessions),
        "--max-context",
        str(args.max_context),
        "--max-queue",
        str(args.clients + 16),
        "--worker-arg",
        f"--threads={args.threads}",
    ]
    if args.model:
        flags += ["--model", args.model]
    process = await asyncio.create_subprocess_exec(
        *TOKENPIPE,
        "serve",
        *flags,
        cwd=REPO,
        env={**os.environ, **CHILD_ENV},
        stdout=asyncio.subprocess.DEVNULL,
    )  # uvicorn's access log: one line per request
    problems: list[str] = []
    started = time.monotonic()
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as http:
        while True:
            try:
                if (await http.get(f"{base}/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.returncode is not None or time.monotonic() - started > 900:
                raise SystemExit("tokenpipe serve did not become healthy")
            await asyncio.sleep(1)
        server = psutil.Process(process.pid)

        def tree_rss() -> int:
            procs = [server, *server.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs if p.is_running())

        await asyncio.gather(
            *(
                _http_client(http, base, i, args.max_new, 0.0, random.Random(i), {})
                for i in range(min(args.clients, 16))
            )
        )
        rss_start = tree_rss()
        rng = random.Random(args.seed)
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(
                _http_client(
                    http,
                    base,
                    i,
                    args.max_new,
                    args.disconnect_rate,
                    random.Random(rng.random()),
                    {},
                )
                for i in range(args.clients)
            ),
            return_exceptions=True,
        )
        load_s = time.monotonic() - t0
        failures = [r for r in results if isinstance(r, BaseException)]
        answered = [r for r in results if isinstance(r, dict)]
        bad = [r for r in answered if not r["ok"]]
        problems += [f"client raised {f!r}" for f in failures[:5]]
        problems += [f"bad stream: {r}" for r in bad[:5]]
        await asyncio.sleep(2)
        metrics = (await http.get(f"{base}/metrics")).text
        rss_end = tree_rss()
    growth = (rss_end - rss_start) / rss_start
    if growth > 0.05:
        problems.append(f"server RSS grew by {growth:+.1%}")
    gauges = ("tokenpipe_active_requests ", "tokenpipe_queued_requests ", "tokenpipe_queue_depth ")
    inflight = [line for line in metrics.splitlines() if line.startswith(gauges)]
    if len(inflight) != len(gauges) or any(float(line.split()[-1]) != 0 for line in inflight):
        problems.append(f"requests still in flight: {inflight}")
    process.terminate()
    code = await asyncio.wait_for(process.wait(), 120)
    if code not in (0, -15):  # uvicorn re-raises SIGTERM after a graceful shutdown
        problems.append(f"tokenpipe serve exited with status {code}")
    return {
        "mode": "http",
        "clients": args.clients,
        "dropped": sum(1 for r in answered if r["dropped"]),
        "completed": sum(1 for r in answered if not r["dropped"] and r["ok"]),
        "rss_start": rss_start,
        "rss_end": rss_end,
        "rss_growth": round(growth, 4),
        "load_seconds": round(load_s, 1),
        "problems": problems,
        "model": args.model or "default (Gemma 3 270M)",
    }


# --------------------------------------------------------------------------- main


def write_row(summary: dict[str, Any]) -> None:
    """Record a run or http summary (as printed) in RELIABILITY.md."""
    ok = not summary["problems"]
    if summary["mode"] == "run":
        growth = ", ".join(f"{g:+.1%}" for g in summary["rss_growth"])
        tried = (
            f"{summary['sessions']} sessions x {summary['requests_per_session']} "
            f"requests = {summary['requests']} through `tokenpipe run` "
            f"({summary['model']}, 512 context), {summary['cancels_sent']} cancels sent "
            f"({summary['load_seconds']:.0f} s)"
        )
        held = (
            f"one terminal line each ({summary['finish_reasons']}, errors "
            f"{summary['errors'] or 0}); {summary['verified']} greedy outputs equal the "
            f"same request run alone ({summary['mismatches']} mismatches); no active "
            f"request, no leaked slot; worker RSS {growth} vs after warm-up"
        )
    else:
        tried = (
            f"{summary['clients']} concurrent streaming clients on `tokenpipe serve` "
            f"({summary['model']}), {summary['dropped']} disconnected mid-stream "
            f"({summary['load_seconds']:.0f} s)"
        )
        held = (
            f"{summary['completed']} complete streams, each one final chunk + [DONE]; "
            f"nothing active or queued after; server + worker RSS "
            f"{summary['rss_growth']:+.1%} vs after warm-up"
        )
    if not ok:
        held += "; PROBLEMS: " + "; ".join(summary["problems"][:3])
    update_row(
        f"load ({summary['mode']})", f"tools/load_test.py {summary['mode']}", tried, held, ok
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for name in ("run", "http"):
        p = sub.add_parser(name)
        p.add_argument("--model", default=None)
        p.add_argument("--workers", type=int, default=1)
        p.add_argument("--max-context", type=int, default=512)
        p.add_argument("--max-new", type=int, default=8)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--write", action="store_true", help="record the result in RELIABILITY.md")
    run = sub.choices["run"]
    run.add_argument("--sessions", type=int, default=64)
    run.add_argument("--requests", type=int, default=20)
    run.add_argument("--cancel-rate", type=float, default=0.15)
    run.add_argument(
        "--verify", type=int, default=64, help="completed requests to rerun alone (0: all)"
    )
    http = sub.choices["http"]
    http.add_argument("--clients", type=int, default=200)
    http.add_argument("--max-sessions", type=int, default=16)
    http.add_argument("--disconnect-rate", type=float, default=0.25)
    args = parser.parse_args(argv)
    summary = asyncio.run(run_mode(args) if args.mode == "run" else http_mode(args))
    print(json.dumps(summary, indent=2))
    ok = not summary["problems"]
    if args.write:
        write_row(summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
