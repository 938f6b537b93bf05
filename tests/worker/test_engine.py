"""The engine in process, on a tiny deterministic fake model (the model contract only).

The fake KV records the ids fed to each slot, so every test can check the central
invariant: a session's resident ids are exactly what its KV holds.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from protocol import (
    CancelRequest,
    CloseRequest,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateRequest,
    IdsSegment,
    OpenRequest,
    PingRequest,
    ResetRequest,
    TextSegment,
    TokenEvent,
    decode_request,
)
from worker.engine.engine import Engine, EngineConfig
from worker.models.step import StepInput

VOCAB = 300
BOS, EOS = 1, 2


class FakeKV:
    def __init__(self, slots: int, max_context: int) -> None:
        self.store: dict[int, list[int]] = {s: [] for s in range(slots)}
        self.max_context = max_context
        self.bytes_per_slot = max_context * 8

    def keepable_prefix(self, cached_len: int, common_len: int) -> int:
        return common_len


class FakeModel(torch.nn.Module):
    """Next token = a hash of every id in the slot (so a wrong KV shows in the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.fail_next = False
        self.forwards: list[list[int]] = []  # new_lens of each forward

    def make_kv_cache(self, num_slots: int, max_context: int) -> FakeKV:
        return FakeKV(num_slots, max_context)

    @staticmethod
    def next_token(history: list[int]) -> int:
        h = 0
        for i, t in enumerate(history):
            h = (h * 31 + t * (i + 7)) % 1_000_003
        return 3 + ord("a") + h % 26  # a byte token 'a'..'z'

    def forward(self, step: StepInput, kv: FakeKV) -> torch.Tensor:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        self.forwards.append(list(step.new_lens))
        ids = step.input_ids.tolist()
        positions = step.positions.tolist()
        rows = []
        start = 0
        for slot, cached, new in zip(step.slots, step.cached_lens, step.new_lens, strict=True):
            stored = kv.store[slot]
            assert cached <= len(stored)
            assert positions[start : start + new] == list(range(cached, cached + new))
            del stored[cached:]
            stored.extend(ids[start : start + new])
            assert len(stored) <= kv.max_context
            start += new
            row = torch.full((VOCAB,), -5.0)
            row[self.next_token(stored)] = 5.0
            rows.append(row)
        return torch.stack(rows)


class FakeTokenizer:
    """Byte-level: id = byte + 3; 0 pad, 1 BOS, 2 EOS."""

    vocab_size = VOCAB
    bos_id = BOS
    eos_ids = frozenset({EOS})
    prefix_ids = [BOS]
    chat_template = None
    bos_token = "<bos>"
    eos_token = "<eos>"

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - 3]) if 3 <= token_id < 259 else b""


def make_engine(**overrides: Any) -> Engine:
    loaded = SimpleNamespace(
        model=FakeModel(),
        tokenizer=FakeTokenizer(),
        config=SimpleNamespace(architecture="Fake", context_length=64),
        meta={"model": "fake"},
    )
    settings = {"max_sessions": 3, "max_context": 64, "prefill_chunk": 8, **overrides}
    return Engine(loaded, EngineConfig(**settings), "cpu")


def expected_tokens(prompt_ids: list[int], n: int) -> list[int]:
    history = list(prompt_ids)
    out = []
    for _ in range(n):
        t = FakeModel.next_token(history)
        out.append(t)
        history.append(t)
    return out


def drive(engine: Engine, *requests: Any, max_steps: int = 1000) -> list[Event]:
    events: list[Event] = []
    for r in requests:
        req = decode_request(r) if isinstance(r, bytes) else r
        events.extend(engine.submit(req))
    for _ in range(max_steps):
        if engine.idle:
            return events
        events.extend(engine.step())
    raise AssertionError("engine did not finish")


def terminal(events: list[Event], rid: Any = None) -> DoneEvent | ErrorEvent:
    ends = [e for e in events if isinstance(e, (DoneEvent, ErrorEvent)) and e.id == rid]
    assert len(ends) == 1, events
    return ends[0]


def text_of(events: list[Event], rid: Any = None) -> str:
    return "".join(e.token for e in events if isinstance(e, TokenEvent) and e.id == rid)


def check_resident(engine: Engine) -> None:
    for session in engine.pool.named.values():
        assert engine.kv.store[session.slot][: len(session.resident_ids)] == session.resident_ids
        assert len(engine.kv.store[session.slot]) == len(session.resident_ids) or session.dirty


def gen(prompt: Any = "hi", **kw: Any) -> GenerateRequest:
    if isinstance(prompt, str):
        return GenerateRequest(prompt=prompt, **kw)
    return GenerateRequest(prompt_segments=prompt, **kw)


def test_ready_and_greedy_generation() -> None:
    engine = make_engine()
    ready = engine.ready_event()
    assert (ready.max_sessions, ready.max_named_sessions) == (3, 2)
    events = drive(engine, gen("hello", max_new_tokens=5))
    done = terminal(events)
    prompt = [BOS] + FakeTokenizer().encode("hello")
    want = expected_tokens(prompt, 5)
    assert isinstance(done, DoneEvent)
    assert done.generated_token_ids == want
    assert done.finish_reason == "length" and done.completion_tokens == 5
    assert done.prompt_tokens == 6 and done.prefilled_prompt_tokens == 6
    assert done.session_reset_reason == "new"
    assert text_of(events) == FakeTokenizer().decode(want)


def test_max_new_tokens_clamped_and_zero() -> None:
    engine = make_engine(max_context=16)
    done = terminal(drive(engine, gen("0123456789", max_new_tokens=-1)))
    assert isinstance(done, DoneEvent) and done.completion_tokens == 16 - 11
    done = terminal(drive(engine, gen("0123456789", max_new_tokens=100)))
    assert isinstance(done, DoneEvent) and done.completion_tokens == 5
    done = terminal(drive(engine, gen("0123456789", max_new_tokens=0)))
    assert isinstance(done, DoneEvent)
    assert (done.completion_tokens, done.finish_reason, done.generated_token_ids) == (
        0,
        "length",
        [],
    )


def test_prompt_errors() -> None:
    engine = make_engine(max_context=8)
    err = terminal(drive(engine, gen("")))
    assert isinstance(err, ErrorEvent) and err.code == "empty_prompt"
    err = terminal(drive(engine, gen([IdsSegment([5, 999])])))
    assert isinstance(err, ErrorEvent) and err.code == "invalid_token_id"
    err = terminal(drive(engine, gen("0123456789")))
    assert isinstance(err, ErrorEvent) and err.code == "context_length_exceeded"
    assert "11" in err.error and "8" in err.error
    assert engine.idle and engine.pool.free_slots == 3


def test_chunked_prefill_respects_chunk() -> None:
    engine = make_engine(prefill_chunk=4)
    drive(engine, gen("x" * 13, max_new_tokens=1))
    assert engine.model.forwards == [[4], [4], [4], [2]]


def test_warm_resume_exact_prefix_and_equal() -> None:
    engine = make_engine()
    first = terminal(drive(engine, gen("abc", session_id="s", max_new_tokens=4)))
    assert isinstance(first, DoneEvent) and first.session_reset_reason == "new"
    check_resident(engine)
    prompt = [BOS] + FakeTokenizer().encode("abc")
    # splice back the generated ids: everything resident is reused
    spliced = [IdsSegment(first.generated_token_ids or []), TextSegment("de")]
    second = terminal(
        drive(engine, gen([TextSegment("abc"), *spliced], session_id="s", max_new_tokens=3))
    )
    full = prompt + (first.generated_token_ids or []) + FakeTokenizer().encode("de")
    assert isinstance(second, DoneEvent)
    assert second.session_reset_reason == "exact_prefix"
    assert second.reused_prompt_tokens == len(prompt) + 3  # the last sampled was never fed
    assert second.reused_prompt_tokens + second.prefilled_prompt_tokens == len(full)
    assert second.generated_token_ids == expected_tokens(full, 3)
    check_resident(engine)
    # the same prompt as resident: re-feeds the last token, same answer as cold
    resident = list(engine.pool.get("s").resident_ids)
    third = terminal(
        drive(
            engine, gen([IdsSegment(resident)], session_id="s", add_prefix=False, max_new_tokens=2)
        )
    )
    assert isinstance(third, DoneEvent) and third.session_reset_reason == "equal"
    assert third.prefilled_prompt_tokens == 1
    assert third.generated_token_ids == expected_tokens(resident, 2)
    # a diverging prompt keeps the common prefix
    fourth = terminal(drive(engine, gen("abX", session_id="s", max_new_tokens=2)))
    assert isinstance(fourth, DoneEvent) and fourth.session_reset_reason == "mismatch"
    assert fourth.reused_prompt_tokens == 3
    assert fourth.generated_token_ids == expected_tokens([BOS] + FakeTokenizer().encode("abX"), 2)
    check_resident(engine)


def test_no_warm_resume_prefills_everything() -> None:
    engine = make_engine(warm_resume=False)
    drive(engine, gen("abc", session_id="s", max_new_tokens=2))
    done = terminal(drive(engine, gen("abcdef", session_id="s", max_new_tokens=2)))
    assert isinstance(done, DoneEvent)
    assert done.reused_prompt_tokens == 0 and done.prefilled_prompt_tokens == 7


def test_return_resident_mirrors_session() -> None:
    engine = make_engine()
    mirror: list[int] = []
    for prompt in ("abc", "abcdef", "xy"):
        done = terminal(
            drive(engine, gen(prompt, session_id="m", max_new_tokens=3, return_resident=True))
        )
        assert isinstance(done, DoneEvent) and done.resident_append is not None
        mirror = mirror[: done.resident_keep] + done.resident_append
        assert mirror == engine.pool.get("m").resident_ids
    check_resident(engine)


def test_interleaved_sessions_match_solo_runs() -> None:
    solo = {}
    for name, prompt in (("a", "first prompt"), ("b", "second, longer prompt here")):
        done = terminal(drive(make_engine(), gen(prompt, session_id=name, max_new_tokens=20)))
        solo[name] = done.generated_token_ids
    engine = make_engine(prefill_chunk=4)
    events = drive(
        engine,
        gen("first prompt", session_id="a", max_new_tokens=20, id=1),
        gen("second, longer prompt here", session_id="b", max_new_tokens=20, id=2),
        gen("scratch", max_new_tokens=20, id=3),
    )
    assert terminal(events, 1).generated_token_ids == solo["a"]
    assert terminal(events, 2).generated_token_ids == solo["b"]
    assert any(len(lens) == 3 for lens in engine.model.forwards)  # really batched
    check_resident(engine)


def test_stop_string_trims_and_dirties() -> None:
    engine = make_engine()
    want = expected_tokens([BOS] + FakeTokenizer().encode("q"), 8)
    text = FakeTokenizer().decode(want)
    stop = text[3:5]
    events = drive(engine, gen("q", session_id="s", max_new_tokens=8, stop=[stop]))
    done = terminal(events)
    assert isinstance(done, DoneEvent) and done.finish_reason == "stop"
    assert done.generated_token_ids is None
    assert text_of(events) == text[: text.index(stop)]
    assert engine.pool.get("s").dirty
    again = terminal(drive(engine, gen("q", session_id="s", max_new_tokens=1)))
    assert isinstance(again, DoneEvent) and again.session_reset_reason == "dirty"


def test_stop_token_ids_end_turn_unfed() -> None:
    engine = make_engine()
    want = expected_tokens([BOS] + FakeTokenizer().encode("q"), 4)
    events = drive(engine, gen("q", session_id="s", max_new_tokens=8, stop_token_ids=[want[2]]))
    done = terminal(events)
    assert isinstance(done, DoneEvent) and done.finish_reason == "stop"
    assert done.generated_token_ids == want[:2]
    assert engine.pool.get("s").resident_ids == [BOS] + FakeTokenizer().encode("q") + want[:2]
    check_resident(engine)


def test_one_slot_worker_says_it_holds_no_named_sessions() -> None:
    """--max-sessions 1 keeps its slot for requests without a session_id: a named one is
    refused with a message that says so (not "close one first": there is none to close)."""
    engine = make_engine(max_sessions=1)
    for req in (OpenRequest(session_id="a"), gen("x", session_id="a", max_new_tokens=1)):
        err = terminal(drive(engine, req))
        assert isinstance(err, ErrorEvent) and err.code == "capacity_exhausted"
        assert "--max-sessions 2" in err.error and "close one" not in err.error
    assert isinstance(terminal(drive(engine, gen("x", max_new_tokens=1))), DoneEvent)


def test_sessions_capacity_open_close_reset() -> None:
    engine = make_engine(max_sessions=3)
    events = drive(
        engine,
        OpenRequest(session_id="a"),
        OpenRequest(session_id="a"),
        OpenRequest(session_id="b"),
        OpenRequest(session_id="c"),
    )
    assert [type(e).__name__ for e in events] == ["OpenedEvent"] * 3 + ["ErrorEvent"]
    assert events[-1].code == "capacity_exhausted"
    err = terminal(drive(engine, gen("x", session_id="c", max_new_tokens=1)))
    assert isinstance(err, ErrorEvent) and err.code == "capacity_exhausted"
    # the scratch slot still serves anonymous requests
    assert isinstance(terminal(drive(engine, gen("x", max_new_tokens=1))), DoneEvent)
    events = drive(
        engine,
        CloseRequest(session_id="a"),
        CloseRequest(session_id="a"),
        ResetRequest(session_id="b"),
        ResetRequest(session_id="zz"),
    )
    assert [type(e).__name__ for e in events] == [
        "ClosedEvent",
        "ClosedEvent",
        "ResetEvent",
        "ResetEvent",
    ]
    assert isinstance(
        terminal(drive(engine, gen("x", session_id="c", max_new_tokens=1))), DoneEvent
    )


def test_cancel_mid_decode_and_mid_prefill() -> None:
    engine = make_engine(prefill_chunk=2)
    events = engine.submit(gen("abc", session_id="s", max_new_tokens=50, id="d"))
    for _ in range(5):
        events += engine.step()
    events += engine.submit(CancelRequest(id="d"))
    events += drive(engine)
    done = terminal(events, "d")
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
    assert 0 < done.completion_tokens < 50
    check_resident(engine)
    assert not engine.pool.get("s").dirty
    # mid-prefill: 2 tokens per step, cancel after two steps
    events = engine.submit(gen("x" * 30, session_id="p", max_new_tokens=5, id="p1"))
    events += engine.step() + engine.step()
    events += engine.submit(CancelRequest(id="p1"))
    events += drive(engine)
    done = terminal(events, "p1")
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
    assert done.completion_tokens == 0 and done.prefilled_prompt_tokens == 4
    assert engine.pool.get("p").resident_ids == ([BOS] + [ord("x") + 3] * 30)[:4]
    check_resident(engine)
    # unknown / finished ids
    err = engine.submit(CancelRequest(id="p1"))
    assert isinstance(err[0], ErrorEvent) and err[0].code == "unknown_id" and err[0].op == "cancel"


def test_failed_step_dirties_session_only() -> None:
    engine = make_engine()
    drive(engine, gen("abc", session_id="ok", max_new_tokens=2))
    resident_ok = list(engine.pool.get("ok").resident_ids)
    engine.model.fail_next = True
    err = terminal(drive(engine, gen("abc", session_id="bad", max_new_tokens=2)))
    assert isinstance(err, ErrorEvent) and err.code == "internal_error"
    assert engine.pool.get("bad").dirty
    assert engine.pool.get("ok").resident_ids == resident_ok
    done = terminal(drive(engine, gen("abc", session_id="bad", max_new_tokens=2)))
    assert isinstance(done, DoneEvent) and done.session_reset_reason == "dirty"
    assert engine.pool.free_slots == 1


def test_id_less_requests_answer_in_order() -> None:
    engine = make_engine()
    events = drive(
        engine,
        b'{"prompt": "a", "max_new_tokens": 3}',
        b"not json",
        b'{"op": "ping"}',
        b'{"prompt": "b", "max_new_tokens": 2}',
    )
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["TokenEvent"] * 3 + ["DoneEvent", "ErrorEvent", "PongEvent"] + [
        "TokenEvent"
    ] * 2 + ["DoneEvent"]


def test_same_session_generates_queue_in_order() -> None:
    engine = make_engine()
    events = drive(
        engine,
        gen("ab", session_id="s", max_new_tokens=3, id=1),
        gen("ab", session_id="s", max_new_tokens=3, id=2),
    )
    first, second = terminal(events, 1), terminal(events, 2)
    assert isinstance(first, DoneEvent) and isinstance(second, DoneEvent)
    assert second.session_reset_reason == "mismatch" and second.reused_prompt_tokens == 2
    assert events.index(first) < events.index(second)


def test_duplicate_id_and_immediate_ops() -> None:
    engine = make_engine()
    assert engine.submit(gen("ab", max_new_tokens=3, id=9)) == []
    dup = engine.submit(gen("ab", max_new_tokens=3, id=9))
    assert isinstance(dup[0], ErrorEvent) and dup[0].code == "duplicate_id"
    pong = engine.submit(PingRequest(id="p"))
    assert type(pong[0]).__name__ == "PongEvent" and pong[0].id == "p"
    drive(engine)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_seeded_sampling_reproducible_in_batch(temperature: float) -> None:
    alone = terminal(
        drive(make_engine(), gen("s", temperature=temperature, seed=5, max_new_tokens=6))
    )
    events = drive(
        make_engine(),
        gen("s", temperature=temperature, seed=5, max_new_tokens=6, id=1),
        gen("other", temperature=1.0, max_new_tokens=6, id=2),
    )
    assert terminal(events, 1).generated_token_ids == alone.generated_token_ids


def test_serve_loop_answers_in_order_and_exits_on_eof() -> None:
    import io
    import json

    from worker.main import serve

    stdin = io.BytesIO(
        b'{"prompt": "ab", "max_new_tokens": 2}\n'
        b"\n"
        b'{"op": "nope"}\n'
        b'{"op": "ping", "id": 1}\n'
        b'{"prompt": "cd", "max_new_tokens": 1, "id": "x"}\n'
    )
    stdout = io.BytesIO()
    assert serve(make_engine(), stdin, stdout) == 0
    lines = [json.loads(line) for line in stdout.getvalue().splitlines()]
    assert lines[0]["ready"] is True
    events = [line["event"] for line in lines[1:]]
    assert events.count("done") == 2 and events.count("error") == 1
    assert events.count("pong") == 1
    # the id-less error waits for the id-less generate before it; id'd lines may interleave
    seed_lines = [line for line in lines[1:] if "id" not in line]
    assert [line["event"] for line in seed_lines] == ["token", "token", "done", "error"]


def test_serve_shutdown_finishes_in_flight() -> None:
    import io
    import json

    from worker.main import serve

    stdin = io.BytesIO(
        b'{"prompt": "ab", "max_new_tokens": 3, "id": 1}\n'
        b'{"op": "shutdown", "id": 2}\n'
        b'{"op": "ping", "id": 3}\n'
    )
    stdout = io.BytesIO()
    assert serve(make_engine(), stdin, stdout) == 0
    lines = [json.loads(line) for line in stdout.getvalue().splitlines()]
    done = [line for line in lines if line["event"] == "done"]
    assert len(done) == 1 and done[0]["completion_tokens"] == 3
    late = [line for line in lines if line.get("id") == 3]
    assert late and late[0]["code"] == "shutting_down"


def test_drop_in_command_defaults() -> None:
    from worker.main import command

    params = {p.name: p for p in command.params}
    assert params["max_sessions"].default == 8  # > 1: named sessions available
    assert {"--model_path", "--model"} <= set(params["model"].opts)
    assert "--tokenizer_path" in params["tokenizer_path"].opts
