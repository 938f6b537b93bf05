"""Soak: N minutes of mixed traffic through `tokenpipe run`, RSS sampled every minute.

    python tools/soak.py [--minutes 60] [--sample-seconds 60] [--model M] [--write]

Traffic, from `--clients` concurrent loops: conversations on named sessions that grow turn by
turn and reset when they near the context, anonymous greedy and sampled requests, cancels at
random points, open/close churn, tokenize/detokenize, malformed lines, stats. Every sample
records each worker's and the supervisor's RSS. At the end: a least-squares line through the
worker RSS samples after the first (the warm-up); the slope must be flat, meaning the fitted
growth over the whole run stays under `--max-growth` (default 2%) of the mean RSS. Every
request must have ended exactly once, and no request or KV slot may be left held.
`--write` records the result as the soak row of RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from load_test import WORDS, Supervisor, check_exactly_once, update_row  # noqa: E402


def fit_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two points)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var


class Traffic:
    def __init__(self, sup: Supervisor, max_context: int, seed: int) -> None:
        self.sup = sup
        self.max_context = max_context
        self.rng = random.Random(seed)
        self.sent: list[Any] = []
        self.counts: dict[str, int] = {}
        self.serial = 0

    def _id(self, kind: str) -> str:
        self.serial += 1
        self.counts[kind] = self.counts.get(kind, 0) + 1
        rid = f"soak-{kind}-{self.serial}"
        self.sent.append(rid)
        return rid

    async def ask(self, kind: str, request: dict[str, Any]) -> dict[str, Any]:
        request["id"] = self._id(kind)
        return (await self.sup.stream(request))[-1]

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    async def conversation(self, name: str, deadline: float) -> None:
        await self.ask("open", {"op": "open", "session_id": name})
        text = f"A diary, {name}:"
        while time.monotonic() < deadline:
            text += " " + self._words(self.rng.randint(3, 12))
            done = await self.ask(
                "turn",
                {"prompt": text, "session_id": name, "max_new_tokens": self.rng.randint(1, 12)},
            )
            if done.get("event") == "done" and done.get("prompt_tokens", 0) > self.max_context // 2:
                await self.ask("reset", {"op": "reset", "session_id": name})
                text = f"A diary, {name}:"
        await self.ask("close", {"op": "close", "session_id": name})

    async def mixed(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            roll = self.rng.random()
            if roll < 0.35:
                await self.ask("greedy", {"prompt": self._words(8), "max_new_tokens": 8})
            elif roll < 0.55:
                await self.ask(
                    "sampled",
                    {
                        "prompt": self._words(6),
                        "max_new_tokens": 8,
                        "temperature": 0.8,
                        "top_p": 0.9,
                        "seed": self.rng.randint(1, 1 << 30),
                    },
                )
            elif roll < 0.7:
                await self._cancelled()
            elif roll < 0.8:
                name = f"churn-{self.rng.randint(0, 3)}"
                await self.ask("open", {"op": "open", "session_id": name})
                await self.ask(
                    "turn", {"prompt": self._words(5), "session_id": name, "max_new_tokens": 2}
                )
                await self.ask("close", {"op": "close", "session_id": name})
            elif roll < 0.9:
                tokens = await self.ask("tokenize", {"op": "tokenize", "text": self._words(20)})
                await self.ask("detokenize", {"op": "detokenize", "ids": tokens.get("tokens", [])})
            elif roll < 0.97:
                rid = self._id("bad")
                self.sup.send_raw_line(
                    self.rng.choice(
                        [
                            b'{"id": "%s", "prompt": 5}',
                            b'{"id": "%s", "op": "x"}',
                            b'{"id": "%s", "prompt": "x", "top_p": 3}',
                        ]
                    )
                    % rid.encode()
                )
                queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
                self.sup.waiters[rid] = queue
                await asyncio.wait_for(queue.get(), 600)
                del self.sup.waiters[rid]
            else:
                await self.ask("stats", {"op": "stats"})

    async def _cancelled(self) -> None:
        rid = self._id("cancel")
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sup.waiters[rid] = queue
        self.sup.send({"id": rid, "prompt": self._words(10), "max_new_tokens": 64})
        after = self.rng.randint(0, 6)
        tokens = 0
        if after == 0:
            self.sup.send({"op": "cancel", "id": rid})
        while True:
            event = await asyncio.wait_for(queue.get(), 600)
            if event["event"] != "token":
                break
            tokens += 1
            if tokens == after:
                self.sup.send({"op": "cancel", "id": rid})
        del self.sup.waiters[rid]


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    flags = [
        "--workers",
        "1",
        "--max-sessions",
        str(args.clients + 5),
        "--max-context",
        str(args.max_context),
        "--threads",
        str(args.threads),
        "--max-queue",
        "256",
    ]
    if args.model:
        flags += ["--model", args.model]
    sup, _ready = await Supervisor.start(flags)
    traffic = Traffic(sup, args.max_context, args.seed)
    started = time.monotonic()
    deadline = started + args.minutes * 60
    samples: list[dict[str, Any]] = []

    async def sampler() -> None:
        while True:
            stats = await sup.stats("sample")
            samples.append(
                {
                    "t_min": round((time.monotonic() - started) / 60, 2),
                    "worker_rss_mb": round(
                        sum(w["rss_bytes"] for w in stats["workers"]) / 2**20, 1
                    ),
                    "supervisor_rss_mb": round(stats["supervisor"]["rss_bytes"] / 2**20, 1),
                    "active": stats["active_requests"],
                }
            )
            print(json.dumps(samples[-1]), flush=True)
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(args.sample_seconds, max(0.0, deadline - time.monotonic())))

    loops = [traffic.conversation(f"soak-conv-{i}", deadline) for i in range(args.clients // 2)]
    loops += [traffic.mixed(deadline) for _ in range(args.clients - args.clients // 2)]
    await asyncio.gather(sampler(), *loops)
    final = await sup.stats("final")
    problems = check_exactly_once(
        traffic.sent, [e for e in sup.events if str(e.get("id", "")).startswith("soak-")]
    )
    if final["active_requests"] or final["queued_requests"] or final["sessions"]:
        problems.append(
            f"left held at the end: {final['active_requests']} active, "
            f"{final['queued_requests']} queued, {final['sessions']} sessions"
        )
    code = await sup.close()
    if code != 0:
        problems.append(f"tokenpipe run exited with status {code}")
    points = [(s["t_min"] / 60, s["worker_rss_mb"]) for s in samples[1:]]
    slope = fit_slope(points)  # MB per hour
    hours = (points[-1][0] - points[0][0]) if len(points) > 1 else 0.0
    mean = sum(y for _, y in points) / len(points) if points else 0.0
    growth = slope * hours / mean if mean else 0.0
    if len(points) < 3:
        problems.append(f"only {len(points)} samples after warm-up: too short to fit")
    elif growth > args.max_growth:
        problems.append(f"worker RSS trend {slope:+.1f} MB/h = {growth:+.1%} over the run")
    sup_points = [(s["t_min"] / 60, s["supervisor_rss_mb"]) for s in samples[1:]]
    return {
        "minutes": args.minutes,
        "requests": traffic.counts,
        "total": sum(traffic.counts.values()),
        "samples": samples,
        "worker_slope_mb_per_h": round(slope, 2),
        "supervisor_slope_mb_per_h": round(fit_slope(sup_points), 2),
        "fitted_growth": round(growth, 4),
        "problems": problems,
        "model": args.model or "default (Gemma 3 270M)",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--sample-seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-growth", type=float, default=0.02)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    summary = asyncio.run(soak(args))
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=2))
    ok = not summary["problems"]
    if args.write:
        first, last = summary["samples"][0], summary["samples"][-1]
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(summary["requests"].items()))
        tried = (
            f"{args.minutes:g} min of mixed traffic through `tokenpipe run` "
            f"({summary['model']}, {args.clients} concurrent loops): {summary['total']} "
            f"requests ({kinds}); RSS sampled every {args.sample_seconds:g} s "
            f"({len(summary['samples'])} samples)"
        )
        held = (
            f"worker RSS {first['worker_rss_mb']} -> {last['worker_rss_mb']} MB, fitted "
            f"slope {summary['worker_slope_mb_per_h']:+.1f} MB/h "
            f"({summary['fitted_growth']:+.2%} over the run); supervisor "
            f"{summary['supervisor_slope_mb_per_h']:+.1f} MB/h; every request ended once; "
            "nothing held at the end"
        )
        if not ok:
            held += "; PROBLEMS: " + "; ".join(summary["problems"][:3])
        update_row("soak", "tools/soak.py", tried, held, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
