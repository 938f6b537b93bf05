"""Issue 16: the first turn of a saved session after a restart, against a cold prefill.

`tokenpipe run --session-dir DIR` (CPU workers, default model): one session's turn, EOF (the
worker saves it), a new `tokenpipe run` on the same directory, then the time to first token
of cold sessions (same length, ids no session holds) and of the restored session's next turn
(its ids plus a few). Prints both and their ratio (target <= 0.25).

    python tools/bench_session_restart.py [--tokens 1500] [--threads 2] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.client import run_command  # noqa: E402


class Run:
    def __init__(self, flags: list[str]) -> None:
        self.process = subprocess.Popen(
            [*run_command(), "run", *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.process.stdout is not None
        self.ready = json.loads(self.process.stdout.readline())

    def ask(self, request: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """The terminal event and the time to the first line, in ms."""
        assert self.process.stdin is not None and self.process.stdout is not None
        start = time.perf_counter()
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        first: float | None = None
        while True:
            event = json.loads(self.process.stdout.readline())
            if first is None:
                first = (time.perf_counter() - start) * 1000
            if event["event"] != "token":
                return event, first

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=120)


def ids(seed: int, n: int) -> list[int]:
    return [2] + [(seed * 7919 + 31 * j) % 200_000 + 1000 for j in range(n)]


def turn(session: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    return {
        "id": session,
        "session_id": session,
        "prompt_segments": [{"ids": prompt}],
        "add_prefix": False,
        "max_new_tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cold", type=int, default=3, help="cold prefills to take the median of")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        flags = ["--workers", str(args.workers), "--threads", str(args.threads),
                 "--max-context", str(args.tokens + 64), "--session-dir", directory]  # fmt: skip
        first = Run(flags)
        done, _ = first.ask(turn("saved", ids(1, args.tokens), 2))
        history = ids(1, args.tokens) + done["generated_token_ids"]
        first.close()
        second = Run(flags)
        assert second.ready.get("restored_sessions") == ["saved"], second.ready
        cold = [
            second.ask(turn(f"cold-{k}", ids(50 + k, len(history) + 2), 1))[1]
            for k in range(args.cold)
        ]
        done, warm = second.ask(turn("saved", [*history, 5000, 5001, 5002], 1))
        second.close()
    median = statistics.median(cold)
    print(
        f"prompt {len(history) + 3} tokens: cold TTFT {median:.0f} ms (median of "
        f"{[round(c) for c in cold]}), first turn after the restart {warm:.0f} ms: "
        f"{warm / median:.3f} of cold (reused {done['reused_prompt_tokens']}, "
        f"{done['session_reset_reason']})"
    )


if __name__ == "__main__":
    main()
