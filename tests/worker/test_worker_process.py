"""The worker as a real subprocess on the real default model (Gemma 3 270M), over its pipes.

One worker is shared by the module (loading the model is the slow part); each test uses its
own session names and request ids so the tests stay independent.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER_ARGS = [
    "--threads",
    "1",
    "--max-sessions",
    "4",
    "--max-context",
    "512",
    "--prefill-chunk",
    "32",
]
SEED_DONE_KEYS = {
    "done",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "reused_prompt_tokens",
    "prefilled_prompt_tokens",
    "session_reset_reason",
    "prefill_ms",
    "decode_ms",
    "total_ms",
    "prefill_tok_s",
    "decode_tok_s",
}


class Worker:
    """A worker subprocess with a line reader thread."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.stderr: list[bytes] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        self.ready = self.read(timeout=300)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, b""):
            self.lines.put(line)
        self.lines.put(b"")

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in iter(self.proc.stderr.readline, b""):
            self.stderr.append(line)

    def send(self, request: dict[str, Any] | bytes) -> None:
        assert self.proc.stdin is not None
        raw = request if isinstance(request, bytes) else json.dumps(request).encode()
        self.proc.stdin.write(raw.rstrip(b"\n") + b"\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 180) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("worker sent nothing in time: " + self.tail()) from None
        if not line:
            raise AssertionError("worker closed stdout: " + self.tail())
        event = json.loads(line)
        assert isinstance(event, dict)
        return event

    def until_end(self, rid: Any = None) -> list[dict[str, Any]]:
        """Lines up to and including the `done`/`error` of `rid`; other ids' lines are kept."""
        out = []
        while True:
            event = self.read()
            out.append(event)
            if event.get("id") == rid and ("done" in event or "error" in event):
                return out

    def run(self, request: dict[str, Any]) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
        """Send one request and return (text, terminal line, all its lines)."""
        self.send(request)
        events = [e for e in self.until_end(request.get("id")) if e.get("id") == request.get("id")]
        text = "".join(e["token"] for e in events if "token" in e)
        return text, events[-1], events

    def tail(self) -> str:
        return b"".join(self.stderr[-20:]).decode(errors="replace")

    def close(self) -> int:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def drop_in_argv() -> list[str]:
    """The ExecuTorch llm_server form: `WORKER_BIN --model_path M --tokenizer_path T`."""
    from worker.loading.loader import resolve_checkpoint_dir

    checkpoint_dir, gguf = resolve_checkpoint_dir(None, progress=False)
    code = "from worker.main import seed_main; seed_main()"
    return [
        sys.executable,
        "-c",
        code,
        "--model_path",
        str(gguf or checkpoint_dir),
        "--tokenizer_path",
        str(checkpoint_dir / "tokenizer.json"),
        *WORKER_ARGS,
    ]


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker(drop_in_argv())
    yield w
    w.close()


def greedy(prompt: Any, n: int, **extra: Any) -> dict[str, Any]:
    request: dict[str, Any] = {"max_new_tokens": n, **extra}
    if isinstance(prompt, str):
        request["prompt"] = prompt
    else:
        request["prompt_segments"] = prompt
    return request


def test_ready_line(worker: Worker) -> None:
    ready = worker.ready
    assert ready["ready"] is True and ready["event"] == "ready"
    assert ready["max_sessions"] == 4 and ready["max_named_sessions"] == 3


def test_seed_client_event_shapes(worker: Worker) -> None:
    """Exactly as the ExecuTorch worker_client: no op, no id, one request at a time."""
    worker.send({"prompt": "The capital of France is", "max_new_tokens": 4})
    events = []
    while True:  # read token lines until done/error
        event = worker.read()
        events.append(event)
        if "done" in event or "error" in event:
            break
    tokens, done = events[:-1], events[-1]
    assert all(set(e) == {"token", "event"} and isinstance(e["token"], str) for e in tokens)
    assert SEED_DONE_KEYS <= set(done) and done["done"] is True
    assert done["finish_reason"] == "length" and done["completion_tokens"] == 4
    assert done["session_reset_reason"] == "new"
    assert done["reused_prompt_tokens"] + done["prefilled_prompt_tokens"] == done["prompt_tokens"]
    assert len(done["generated_token_ids"]) == 4
    worker.send({"op": "open", "session_id": "seed"})
    assert worker.read() == {"event": "opened", "opened": True, "session_id": "seed"}
    worker.send({"prompt": "Hi", "max_new_tokens": 1, "session_id": "seed"})
    events = []
    while not events or not ("done" in events[-1] or "error" in events[-1]):
        events.append(worker.read())
    assert events[-1]["done"] is True
    worker.send({"op": "reset", "session_id": "seed"})
    assert worker.read() == {"event": "reset", "reset": True, "session_id": "seed"}
    worker.send({"op": "close", "session_id": "seed"})
    assert worker.read() == {"event": "closed", "closed": True, "session_id": "seed"}
    worker.send({"prompt": "", "max_new_tokens": 1})
    error = worker.read()
    assert error["code"] == "empty_prompt" and isinstance(error["error"], str)


def test_warm_resume_matches_cold_and_splice_is_exact(worker: Worker) -> None:
    first_prompt = "Once upon a time, in a small village,"
    _, first, _ = worker.run(greedy(first_prompt, 4, session_id="warm", return_token_ids=True))
    assert first["session_reset_reason"] == "new"
    # splice the generated ids back, then add new text: the whole resident prefix is reused
    segments = [{"text": first_prompt}, {"ids": first["generated_token_ids"]}, {"text": " The"}]
    text, warm, _ = worker.run(greedy(segments, 4, session_id="warm"))
    assert warm["session_reset_reason"] == "exact_prefix"
    assert warm["reused_prompt_tokens"] == first["prompt_tokens"] + 4 - 1
    assert warm["reused_prompt_tokens"] + warm["prefilled_prompt_tokens"] == warm["prompt_tokens"]
    # a cold run of the same full prompt (scratch session) gives the same greedy tokens
    cold_text, cold, _ = worker.run(greedy(segments, 4))
    assert cold["session_reset_reason"] == "new"
    assert cold["prefilled_prompt_tokens"] == warm["prompt_tokens"]
    assert cold["generated_token_ids"] == warm["generated_token_ids"]
    assert cold_text == text
    # the same prompt again: "equal", re-feeds the last token, still the same answer
    worker.run(greedy(segments, 0, session_id="warm2"))
    _, again, _ = worker.run(greedy(segments, 4, session_id="warm2"))
    assert again["session_reset_reason"] == "equal" and again["prefilled_prompt_tokens"] == 1
    assert again["generated_token_ids"] == cold["generated_token_ids"]
    for name in ("warm", "warm2"):
        worker.send({"op": "close", "session_id": name, "id": f"close-{name}"})
        assert worker.read()["closed"] is True


def test_two_sessions_interleaved_match_solo_runs(worker: Worker) -> None:
    prompts = {"A": "My favourite fruit is", "B": "Rust is a programming language that"}
    solo = {}
    for name, prompt in prompts.items():
        _, done, _ = worker.run(greedy(prompt, 4))
        solo[name] = done["generated_token_ids"]
    for name, prompt in prompts.items():
        worker.send(greedy(prompt, 4, session_id=f"il-{name}", id=f"il-{name}"))
    lines = worker.until_end("il-A")
    if not any(e.get("id") == "il-B" and "done" in e for e in lines):
        lines += worker.until_end("il-B")
    ends = {e["id"]: e for e in lines if "done" in e}
    assert ends["il-A"]["generated_token_ids"] == solo["A"]
    assert ends["il-B"]["generated_token_ids"] == solo["B"]
    # really interleaved: B's tokens started before A finished
    first_b = next(i for i, e in enumerate(lines) if e.get("id") == "il-B")
    a_done = next(i for i, e in enumerate(lines) if e.get("id") == "il-A" and "done" in e)
    assert first_b < a_done
    for name in prompts:
        worker.send({"op": "close", "session_id": f"il-{name}"})
        assert worker.read()["closed"] is True


def test_stop_string_split_across_tokens(worker: Worker) -> None:
    prompt = "The first five letters of the alphabet are"
    _, done, events = worker.run(greedy(prompt, 10, return_token_ids=True))
    pieces = [e["token"] for e in events if "token" in e]
    full = "".join(pieces)
    # a stop string that starts inside one token line and ends inside the next
    cut = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) >= 2 and pieces[i])
    start = sum(len(p) for p in pieces[: cut - 1]) + len(pieces[cut - 1]) - 1
    stop = full[start : start + 2]
    assert len(stop) == 2
    text, stopped, stop_events = worker.run(greedy(prompt, 10, stop=[stop]))
    assert stopped["finish_reason"] == "stop"
    assert "generated_token_ids" not in stopped
    assert text == full[: full.index(stop)]
    assert stop not in text and len(stop_events) >= 2


def test_multibyte_characters_arrive_whole(worker: Worker) -> None:
    # Egyptian hieroglyphs are byte-fallback tokens in Gemma's vocabulary: 4 tokens each
    prompt = "𓀀𓀁𓀂 𓀀𓀁𓀂 𓀀𓀁𓀂 𓀀𓀁𓀂 𓀀𓀁𓀂"
    worker.send({"op": "tokenize", "text": "𓀀", "id": "mb-tok"})
    assert len(worker.read()["tokens"]) == 4
    _, done, events = worker.run(greedy(prompt, 9, return_token_ids=True))
    lines = [e for e in events if "token" in e]
    whole = [e for e in lines if len(e["token_ids"]) == 4 and len(e["token"]) == 1]
    assert whole and all(0x13000 <= ord(e["token"]) < 0x13430 for e in whole), lines
    # only the final flush (a character cut off by max_new_tokens) may be incomplete
    assert all("\ufffd" not in e["token"] for e in lines[:-1])
    assert [i for e in lines for i in e["token_ids"]] == done["generated_token_ids"]


def test_cancel_mid_decode(worker: Worker) -> None:
    worker.send(
        greedy("Count: one, two, three,", 200, id="cd", session_id="cancel-d", return_resident=True)
    )
    first = worker.read()
    assert first.get("id") == "cd" and "token" in first
    worker.send({"op": "cancel", "id": "cd"})
    lines = worker.until_end("cd")
    done = lines[-1]
    assert done["finish_reason"] == "cancelled" and 1 <= done["completion_tokens"] < 200
    # the session keeps exactly the fed tokens: prompt + generated[:-1]
    fed = done["resident_append"]
    assert done["resident_keep"] == 0
    assert len(fed) == done["prompt_tokens"] + done["completion_tokens"] - 1
    assert fed[done["prompt_tokens"] :] == done["generated_token_ids"][:-1]
    worker.send({"op": "cancel", "id": "cd"})
    err = worker.read()
    assert (err["code"], err["op"], err["id"]) == ("unknown_id", "cancel", "cd")
    worker.send({"op": "close", "session_id": "cancel-d"})
    assert worker.read()["closed"] is True


def test_cancel_mid_prefill(worker: Worker) -> None:
    prompt = "word " * 250  # about 250 tokens: eight prefill chunks of 32
    worker.send(greedy(prompt, 5, id="cp", session_id="cancel-p", return_resident=True))
    for poll in range(10_000):  # wait until the prefill is under way, then cancel
        worker.send({"op": "stats", "id": f"poll{poll}"})
        requests = worker.read()["stats"]["requests"]
        if requests and requests[0]["fed_prompt_tokens"] > 0:
            break
        time.sleep(0.01)
    worker.send({"op": "cancel", "id": "cp"})
    done = worker.until_end("cp")[-1]
    assert done["finish_reason"] == "cancelled" and done["completion_tokens"] == 0
    assert 0 < done["prefilled_prompt_tokens"] < done["prompt_tokens"]
    assert len(done["resident_append"]) == done["prefilled_prompt_tokens"]
    # the fed chunks are kept: a prompt that extends them resumes from all of them
    extended = [{"ids": done["resident_append"] + [1437]}]
    _, again, _ = worker.run(greedy(extended, 0, session_id="cancel-p", add_prefix=False))
    assert again["session_reset_reason"] == "exact_prefix"
    assert again["reused_prompt_tokens"] == done["prefilled_prompt_tokens"]
    assert again["prefilled_prompt_tokens"] == 1
    worker.send({"op": "close", "session_id": "cancel-p"})
    assert worker.read()["closed"] is True


def test_capacity_exhaustion(worker: Worker) -> None:
    for i in range(3):
        worker.send({"op": "open", "session_id": f"cap{i}", "id": f"o{i}"})
        assert worker.read()["opened"] is True
    worker.send({"op": "open", "session_id": "cap3", "id": "o3"})
    err = worker.read()
    assert err["code"] == "capacity_exhausted" and err["id"] == "o3"
    _, err, _ = worker.run(greedy("Hi", 1, session_id="cap3", id="g3"))
    assert err["code"] == "capacity_exhausted"
    _, done, _ = worker.run(greedy("Hi", 1, id="scratch"))  # the scratch slot still works
    assert done["done"] is True
    for i in range(3):
        worker.send({"op": "close", "session_id": f"cap{i}", "id": f"c{i}"})
        assert worker.read()["closed"] is True


def test_malformed_lines_change_nothing(worker: Worker) -> None:
    request = greedy("The weather today is", 3)
    _, alone, _ = worker.run(request)
    bad_lines = [b"{not json", b'{"op": "bogus"}', b'{"prompt": 5}', b"\xff\xfe", b"[1, 2]"]
    worker.send(request)
    for line in bad_lines:
        worker.send(line)
    worker.send(request)
    events = []
    while sum(1 for e in events if "done" in e) < 2:
        events.append(worker.read())
    errors = [e for e in events if "error" in e]
    assert len(errors) == len(bad_lines)
    assert {e["code"] for e in errors} == {
        "invalid_json",
        "unknown_op",
        "invalid_request",
        "invalid_utf8",
    }
    dones = [e for e in events if "done" in e]
    assert all(d["generated_token_ids"] == alone["generated_token_ids"] for d in dones)
    # seed order: the errors come after the first done and before the second request's lines
    first_done = events.index(dones[0])
    assert all("error" in e for e in events[first_done + 1 : first_done + 1 + len(bad_lines)])


def test_small_ops(worker: Worker) -> None:
    worker.send({"op": "ping", "id": 1})
    assert worker.read() == {"event": "pong", "pong": True, "id": 1}
    worker.send({"op": "info", "id": 2})
    info = worker.read()["info"]
    assert info["vocab_size"] == 262144 and info["prefix_ids"] == [2]
    assert info["max_sessions"] == 4 and info["context_length"] == 512
    worker.send({"op": "stats", "id": 3})
    stats = worker.read()["stats"]
    assert stats["active_requests"] == 0 and stats["rss_bytes"] > 0
    worker.send({"op": "tokenize", "text": "Hello", "add_prefix": True, "id": 4})
    tokens = worker.read()["tokens"]
    assert tokens[0] == 2
    worker.send({"op": "detokenize", "ids": tokens[1:], "id": 5})
    assert worker.read()["text"] == "Hello"
    worker.send({"op": "detokenize", "ids": [10**7], "id": 6})
    assert worker.read()["code"] == "invalid_token_id"


def test_zz_eof_finishes_in_flight(worker: Worker) -> None:
    """Last in the module: EOF right after a request; it completes, then the worker exits 0."""
    worker.send({"prompt": "Hello", "max_new_tokens": 3})
    assert worker.proc.stdin is not None
    worker.proc.stdin.close()
    events = []
    while True:
        event = worker.read()
        events.append(event)
        if "done" in event or "error" in event:
            break
    assert events[-1]["completion_tokens"] == 3
    assert worker.proc.wait(timeout=60) == 0
