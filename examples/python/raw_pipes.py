"""Embed tokenpipe with nothing but a child process and JSONL on its pipes.

Any language can do the same: write one JSON request per line to `tokenpipe run`'s stdin,
read one JSON event per line from its stdout (the first line is `ready`).

Run: python examples/python/raw_pipes.py
"""

from __future__ import annotations

import json
import subprocess


def main() -> None:
    proc = subprocess.Popen(
        ["tokenpipe", "run", "--max-context", "512"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        bufsize=1,
    )
    assert proc.stdin is not None and proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    print(f"ready: max_sessions={ready['max_sessions']}")

    # Two requests in flight at once: their lines interleave, each tagged with its id.
    for rid, prompt in (("a", "Roses are red,"), ("b", "The quick brown fox")):
        proc.stdin.write(json.dumps({"id": rid, "prompt": prompt, "max_new_tokens": 8}) + "\n")
    proc.stdin.flush()

    texts = {"a": "", "b": ""}
    finished = 0
    while finished < 2:
        event = json.loads(proc.stdout.readline())
        if event["event"] == "token":
            texts[event["id"]] += event["token"]
        elif event["event"] in ("done", "error"):
            finished += 1
    for rid, text in texts.items():
        print(f"{rid}: {text!r}")

    proc.stdin.close()  # EOF: the supervisor stops its workers and exits 0
    print(f"exit status {proc.wait()}")


if __name__ == "__main__":
    main()
