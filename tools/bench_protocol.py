"""Benchmark the protocol codec on one core.

Encodes and decodes a million token events (`encode_event(TokenEvent(..., id=...))` then
`decode_event`), and decodes typical generate request lines (`decode_request`), printing
events/s and requests/s. Target: >= 500,000 token events encoded+decoded per second.
Rates are per second of this process's CPU time (`time.process_time`), so a machine shared
with other work does not make them look slower than one core really is; the wall-clock
total is printed too.

    python tools/bench_protocol.py [--events 1000000] [--requests 200000]
"""

from __future__ import annotations

import argparse
import time

from protocol import (
    GenerateRequest,
    TokenEvent,
    decode_event,
    decode_request,
    encode_event,
    encode_request,
)

TOKEN_TEXTS = [" the", " quick", " brown", " fox", " jumps", " über", "\n", " 🦊", ",", " lazy"]
TYPICAL_GENERATE = encode_request(
    GenerateRequest(
        id="req-12345",
        prompt="You are a helpful assistant.\nUser: Write a haiku about pipes.\nAssistant:",
        max_new_tokens=256,
        temperature=0.7,
        top_p=0.95,
        top_k=40,
        seed=1234,
        stop=["\nUser:"],
        session_id="editor-42",
    )
)
SEED_GENERATE = (
    b'{"prompt": "You are a helpful assistant.\\nUser: Write a haiku about pipes.\\nAssistant:",'
    b' "max_new_tokens": 256, "temperature": 0.7, "top_p": 0.95, "top_k": 40, "seed": 1234,'
    b' "stop": ["\\nUser:"], "session_id": "editor-42"}\n'
)


def bench_events(count: int) -> tuple[float, float, float]:
    """Seconds to encode, to decode, and to encode+decode `count` token events."""
    events = [TokenEvent(token=TOKEN_TEXTS[i % 10], id=i) for i in range(1000)]
    repeats = count // len(events)
    start = time.process_time()
    for _ in range(repeats):
        lines = [encode_event(event) for event in events]
    encode_s = time.process_time() - start
    start = time.process_time()
    for _ in range(repeats):
        for line in lines:
            decode_event(line)
    decode_s = time.process_time() - start
    start = time.process_time()
    for _ in range(repeats):
        for event in events:
            decode_event(encode_event(event))
    both_s = time.process_time() - start
    return encode_s, decode_s, both_s


def bench_requests(line: bytes, count: int) -> float:
    """Seconds to decode `line` `count` times; checks it decodes to a request."""
    assert isinstance(decode_request(line), GenerateRequest)
    start = time.process_time()
    for _ in range(count):
        decode_request(line)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=200_000)
    args = parser.parse_args()
    wall_start = time.perf_counter()
    events = args.events // 1000 * 1000
    encode_s, decode_s, both_s = bench_events(events)
    print(f"token events: {events:,}")
    print(f"  encode_event            {events / encode_s:>12,.0f} events/s")
    print(f"  decode_event            {events / decode_s:>12,.0f} events/s")
    print(f"  encode+decode           {events / both_s:>12,.0f} events/s  (target >= 500,000)")
    for name, line in (("typed generate", TYPICAL_GENERATE), ("seed generate", SEED_GENERATE)):
        seconds = bench_requests(line, args.requests)
        print(
            f"decode_request {name:<15} {args.requests / seconds:>8,.0f} requests/s "
            f"({seconds / args.requests * 1e6:.2f} us, {len(line)} bytes)"
        )
    print(f"wall time {time.perf_counter() - wall_start:.1f} s")


if __name__ == "__main__":
    main()
