"""Embed tokenpipe in a Python program with the client API (a `tokenpipe run` child).

Run: python examples/python/client_api.py
"""

from __future__ import annotations

from protocol import DoneEvent, GenerateRequest, TokenEvent
from supervisor.client import Client


def main() -> None:
    with Client.spawn(["--max-context", "512"]) as client:
        print(f"ready: {client.ready.max_sessions} sessions on {client.ready.workers} worker(s)")

        # Stream one completion.
        request = GenerateRequest(prompt="The capital of France is", max_new_tokens=8)
        for event in client.generate(request):
            if isinstance(event, TokenEvent):
                print(event.token, end="", flush=True)
            elif isinstance(event, DoneEvent):
                print(f"\n[{event.completion_tokens} tokens, {event.finish_reason}]")

        # A named session keeps its cache between turns: the second prompt extends the first.
        client.open_session("notes")
        first = "Shopping list: apples,"
        reply = "".join(
            e.token
            for e in client.generate(
                GenerateRequest(prompt=first, session_id="notes", max_new_tokens=6)
            )
            if isinstance(e, TokenEvent)
        )
        events = list(
            client.generate(
                GenerateRequest(prompt=first + reply + " and", session_id="notes", max_new_tokens=6)
            )
        )
        done = events[-1]
        assert isinstance(done, DoneEvent)
        print(f"second turn reused {done.reused_prompt_tokens} cached prompt tokens")
        client.close_session("notes")

        print(f"tokenize: {client.tokenize('Hello world')}")
        stats = client.stats()
        for worker in stats["workers"]:
            print(
                f"worker {worker['index']}: {worker['state']}, RSS {worker['rss_bytes'] >> 20} MiB"
            )


if __name__ == "__main__":
    main()
