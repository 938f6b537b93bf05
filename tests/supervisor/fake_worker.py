"""A fake tokenpipe worker for supervisor unit tests and the relay benchmark.

Speaks the worker protocol (ready line, ids, sessions, cancel, info/stats, tokenize) on
stdin/stdout without torch. Tokens are bytes of UTF-8 text offset by 10; id 1 is the BOS
prefix. Generation is deterministic in the session's resident ids, so a session rebuilt from
the supervisor's mirror continues exactly as one that never crashed.

Behaviour flags (the supervisor's own worker flags are accepted and ignored):
  --max-sessions N          slots, scratch included (default 4)
  --fake-token-delay S      seconds between token steps (default 0.002)
  --fake-crash-on TEXT      exit hard (os._exit(3)) when a prompt contains TEXT
  --fake-hang-on-start      never print the ready line
  --fake-fail-start         print to stderr and exit 1 at once
  --fake-fail-start-if-exists F   like --fake-fail-start, once file F exists
  --fake-timestamps         token events carry "t": time.monotonic_ns() at emission
  --fake-burst              a prompt "BURST" emits max_new_tokens token lines in one write
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

BOS = 1
OFFSET = 10
DEFAULT_NEW_TOKENS = 16


def encode_text(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


def decode_ids(ids: list[int]) -> str:
    return bytes(i - OFFSET for i in ids if OFFSET <= i < OFFSET + 256).decode(errors="replace")


def next_token(resident: list[int]) -> int:
    """Deterministic 'greedy' next token: a lowercase letter chosen from the resident ids."""
    h = 0
    for i in resident[-8:]:
        h = (h * 31 + i) % 1_000_003
    return OFFSET + ord("a") + (h + len(resident)) % 26


@dataclass
class Active:
    rid: Any
    session_id: str
    remaining: int
    generated: list[int] = field(default_factory=list)
    keep: int = 0
    append: list[int] = field(default_factory=list)
    return_resident: bool = False
    prompt_tokens: int = 0
    cancelled: bool = False


class FakeWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.max_sessions = args.max_sessions
        self.sessions: dict[str, list[int]] = {"": []}
        self.active: list[Active] = []
        self.out = sys.stdout.buffer

    def emit(self, event: dict[str, Any]) -> None:
        self.out.write(orjson.dumps(event) + b"\n")

    def reply(self, req: dict[str, Any], event: dict[str, Any]) -> None:
        if "id" in req:
            event["id"] = req["id"]
        self.emit(event)

    def error(self, req: dict[str, Any], message: str, code: str) -> None:
        self.reply(req, {"event": "error", "error": message, "code": code})

    def handle(self, req: dict[str, Any]) -> bool:
        op = req.get("op", "generate")
        sid = req.get("session_id") or ""
        if op == "generate":
            self.start_generate(req)
        elif op == "open":
            if sid not in self.sessions and len(self.sessions) >= self.max_sessions:
                self.error(req, "no free session slot", "capacity_exhausted")
            else:
                self.sessions.setdefault(sid, [])
                self.reply(req, {"event": "opened", "opened": True, "session_id": sid})
        elif op == "close":
            self.sessions.pop(sid, None)
            self.reply(req, {"event": "closed", "closed": True, "session_id": sid})
        elif op == "reset":
            self.sessions[sid] = []
            self.reply(req, {"event": "reset", "reset": True, "session_id": sid})
        elif op == "cancel":
            for act in self.active:
                if act.rid == req.get("id") and "id" in req:
                    act.cancelled = True
                    return True
            self.reply(
                req, {"event": "error", "error": "unknown id", "code": "unknown_id", "op": "cancel"}
            )
        elif op == "ping":
            self.reply(req, {"event": "pong", "pong": True})
        elif op == "info":
            self.reply(
                req,
                {
                    "event": "info",
                    "info": {
                        "model": "fake",
                        "architecture": "fake",
                        "context_length": 4096,
                        "vocab_size": 266,
                        "bos_id": BOS,
                        "eos_ids": [2],
                        "prefix_ids": [BOS],
                        "bos_token": "<bos>",
                        "eos_token": "<eos>",
                        "chat_template": None,
                        "max_sessions": self.max_sessions,
                        "bytes_per_session": 1000,
                        "device": "cpu",
                        "dtype": "float32",
                        "pid": os.getpid(),
                    },
                },
            )
        elif op == "stats":
            self.reply(
                req,
                {
                    "event": "stats",
                    "stats": {
                        "active_requests": len(self.active),
                        "queued_requests": 0,
                        "sessions": len(self.sessions) - 1,
                        "free_slots": self.max_sessions - len(self.sessions),
                        "rss_bytes": 1 << 20,
                    },
                },
            )
        elif op == "tokenize":
            ids = encode_text(req.get("text", ""))
            if req.get("add_prefix"):
                ids = [BOS] + ids
            self.reply(req, {"event": "tokens", "tokens": ids})
        elif op == "detokenize":
            self.reply(req, {"event": "text", "text": decode_ids(req.get("ids", []))})
        elif op == "shutdown":
            return False
        else:
            self.error(req, f"unknown op {op!r}", "bad_request")
        return True

    def prompt_ids(self, req: dict[str, Any]) -> list[int]:
        ids: list[int] = [BOS] if req.get("add_prefix", True) else []
        if "prompt" in req and req["prompt"] is not None:
            ids += encode_text(req["prompt"])
        elif req.get("messages") is not None:
            text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in req["messages"])
            ids += encode_text(text + "<assistant>")
        for seg in req.get("prompt_segments") or []:
            ids += seg["ids"] if "ids" in seg else encode_text(seg["text"])
        return ids

    def start_generate(self, req: dict[str, Any]) -> None:
        sid = req.get("session_id") or ""
        text = req.get("prompt") or ""
        if self.args.fake_crash_on and self.args.fake_crash_on in text:
            sys.stdout.flush()
            os._exit(3)
        if sid not in self.sessions:
            if len(self.sessions) >= self.max_sessions:
                self.error(req, "no free session slot", "capacity_exhausted")
                return
            self.sessions[sid] = []
        if any(a.session_id == sid for a in self.active) and sid:
            self.error(req, "session busy", "session_busy")
            return
        max_new = req.get("max_new_tokens", -1)
        max_new = DEFAULT_NEW_TOKENS if max_new is None or max_new < 0 else max_new
        if self.args.fake_burst and text == "BURST":
            line = orjson.dumps({"event": "token", "id": req.get("id"), "token": "x"}) + b"\n"
            self.out.write(line * max_new)
            self.reply(
                req,
                {
                    "event": "done",
                    "done": True,
                    "finish_reason": "length",
                    "prompt_tokens": 5,
                    "completion_tokens": max_new,
                },
            )
            return
        prompt = self.prompt_ids(req)
        resident = self.sessions[sid]
        keep = 0
        while keep < min(len(resident), len(prompt)) and resident[keep] == prompt[keep]:
            keep += 1
        self.sessions[sid] = prompt[:]
        act = Active(
            rid=req.get("id"),
            session_id=sid,
            remaining=max_new,
            keep=keep,
            append=prompt[keep:],
            return_resident=bool(req.get("return_resident")),
            prompt_tokens=len(prompt),
        )
        act.id_present = "id" in req  # type: ignore[attr-defined]
        self.active.append(act)

    def step(self) -> None:
        for act in list(self.active):
            resident = self.sessions[act.session_id]
            if act.cancelled or act.remaining <= 0:
                self.finish(act, "cancelled" if act.cancelled else "length")
                continue
            tok = next_token(resident)
            resident.append(tok)
            act.generated.append(tok)
            act.remaining -= 1
            # Key order as a real worker writes it: event, id, token.
            ev: dict[str, Any] = {"event": "token"}
            if act.id_present:  # type: ignore[attr-defined]
                ev["id"] = act.rid
            ev["token"] = chr(tok - OFFSET)
            if self.args.fake_timestamps:
                ev["t"] = time.monotonic_ns()
            self.emit(ev)
            if act.remaining <= 0:
                self.finish(act, "length")

    def finish(self, act: Active, reason: str) -> None:
        self.active.remove(act)
        ev: dict[str, Any] = {
            "event": "done",
            "done": True,
            "prompt_tokens": act.prompt_tokens,
            "completion_tokens": len(act.generated),
            "finish_reason": reason,
            "reused_prompt_tokens": act.keep,
            "prefilled_prompt_tokens": act.prompt_tokens - act.keep,
            "session_reset_reason": "new" if act.keep == 0 else "exact_prefix",
            "prefill_ms": 0.1,
            "decode_ms": 0.1,
            "total_ms": 0.2,
            "prefill_tok_s": 1.0,
            "decode_tok_s": 1.0,
            "generated_token_ids": act.generated,
        }
        if act.return_resident:
            ev["resident_keep"] = act.keep
            ev["resident_append"] = act.append + act.generated
        if act.id_present:  # type: ignore[attr-defined]
            ev["id"] = act.rid
        self.emit(ev)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-sessions", type=int, default=4)
    parser.add_argument("--fake-token-delay", type=float, default=0.002)
    parser.add_argument("--fake-crash-on", default="")
    parser.add_argument("--fake-hang-on-start", action="store_true")
    parser.add_argument("--fake-fail-start", action="store_true")
    parser.add_argument("--fake-burst", action="store_true")
    parser.add_argument("--fake-fail-start-if-exists", default="")
    parser.add_argument("--fake-timestamps", action="store_true")
    args, _unknown = parser.parse_known_args()
    if args.fake_fail_start or (
        args.fake_fail_start_if_exists and os.path.exists(args.fake_fail_start_if_exists)
    ):
        print("fake worker: failing at start on purpose", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"fake worker pid {os.getpid()} starting", file=sys.stderr, flush=True)
    if args.fake_hang_on_start:
        time.sleep(3600)
    worker = FakeWorker(args)
    worker.emit(
        {
            "event": "ready",
            "ready": True,
            "max_sessions": args.max_sessions,
            "max_named_sessions": args.max_sessions - 1,
            "device": "cpu",
        }
    )
    sys.stdout.flush()
    inbox: queue.Queue[bytes | None] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin.buffer:
            inbox.put(line)
        inbox.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    running = True
    eof = False
    while running:
        block = not worker.active and not eof
        try:
            line = inbox.get(block=block, timeout=None if block else 0)
            while True:
                if line is None:
                    eof = True
                elif line.strip():
                    try:
                        running = worker.handle(orjson.loads(line)) and running
                    except orjson.JSONDecodeError:
                        worker.emit({"event": "error", "error": "bad json", "code": "bad_json"})
                line = inbox.get_nowait()
        except queue.Empty:
            pass
        worker.step()
        sys.stdout.flush()
        if eof and not worker.active:
            break
        if worker.active and args.fake_token_delay > 0:
            time.sleep(args.fake_token_delay)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
