"""Sessions on a hybrid model (qwen3_5_moe) through the real Engine: a resumed continuation is
token-identical to the same prompt in a fresh session — append-only (the live state), rollback
to a snapshot (a regenerate, an edited last turn) and rollback without one (full re-prefill,
``truncated``). A tiny random model with the 35B-A3B layout; greedy decoding."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from protocol import DoneEvent, Event, GenerateRequest, IdsSegment
from worker.engine.engine import Engine, EngineConfig
from worker.models.config import ModelConfig
from worker.models.registry import build_model

VOCAB = 256
torch.set_num_threads(1)


class IdTokenizer:
    """Ids are bytes; no EOS, so every turn runs to max_new_tokens."""

    vocab_size = VOCAB
    bos_id = None
    eos_ids: frozenset[int] = frozenset()
    prefix_ids: list[int] = []
    chat_template = None
    bos_token = None
    eos_token = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])


def _config() -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 12,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 32,
            "max_position_embeddings": 512,
        }
    )


@pytest.fixture
def model() -> Any:
    """A fresh copy each test: the Engine repacks its weights (``prepare_for_cpu``)."""
    return tiny_hybrid()


def tiny_hybrid() -> Any:
    torch.manual_seed(0)
    model = build_model(_config(), "cpu", torch.float32)
    with torch.no_grad():  # spread weights: clear argmax margins
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 if "norm" in name else torch.randn_like(p) * 0.08)
    return model


def make_engine(model: Any, **overrides: Any) -> Engine:
    loaded = SimpleNamespace(
        model=model, tokenizer=IdTokenizer(), config=model.config, meta={"model": "tiny"}
    )
    settings = {"max_sessions": 4, "max_context": 256, "prefill_chunk": 16, **overrides}
    return Engine(loaded, EngineConfig(**settings), "cpu")


def run(engine: Engine, *requests: GenerateRequest) -> list[DoneEvent]:
    events: list[Event] = []
    for request in requests:
        events.extend(engine.submit(request))
    for _ in range(10_000):
        if engine.idle:
            break
        events.extend(engine.step())
    done = [e for e in events if isinstance(e, DoneEvent)]
    assert len(done) == len(requests), events
    return sorted(done, key=lambda d: str(d.id))


def gen(ids: list[int], session: str | None, n: int = 12, rid: str = "r") -> GenerateRequest:
    return GenerateRequest(
        id=rid,
        prompt_segments=[IdsSegment(ids)],
        add_prefix=False,
        max_new_tokens=n,
        session_id=session,
    )


def fresh(engine: Engine, ids: list[int], n: int = 12) -> list[int]:
    """The same prompt in a fresh (anonymous) session."""
    (done,) = run(engine, gen(ids, None, n, rid="fresh"))
    assert done.session_reset_reason == "new" and done.reused_prompt_tokens == 0
    assert done.generated_token_ids is not None
    return done.generated_token_ids


def ids(n: int, seed: int) -> list[int]:
    gen_ = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen_).tolist()


def test_append_rollback_with_and_without_snapshot_equal_fresh(model: Any) -> None:
    engine = make_engine(model)
    p1, u2, u2_edit = ids(30, 1), ids(9, 2), ids(7, 3)

    (d1,) = run(engine, gen(p1, "s"))
    g1 = d1.generated_token_ids
    assert g1 is not None and g1 == fresh(engine, p1)

    # append-only: the new prompt extends the resident ids, the live state continues
    p2 = p1 + g1 + u2
    (d2,) = run(engine, gen(p2, "s"))
    assert d2.session_reset_reason == "exact_prefix"
    assert d2.reused_prompt_tokens == len(p1) + len(g1) - 1  # the last sampled id was not fed
    assert d2.generated_token_ids == fresh(engine, p2)

    # regenerate (the same prompt again): the snapshot before the prompt's last token
    (d3,) = run(engine, gen(p2, "s"))
    assert d3.session_reset_reason == "mismatch"
    assert (d3.reused_prompt_tokens, d3.prefilled_prompt_tokens) == (len(p2) - 1, 1)
    assert d3.generated_token_ids == d2.generated_token_ids

    # an edited last user turn: back to the end of turn 1's generation, then re-prefill
    p3 = p1 + g1 + u2_edit
    (d4,) = run(engine, gen(p3, "s"))
    assert d4.session_reset_reason == "truncated"
    assert d4.reused_prompt_tokens == len(p1) + len(g1) - 1
    assert d4.generated_token_ids == fresh(engine, p3)

    # a rollback before every snapshot: a full re-prefill, reported as truncated
    p4 = p1[:5] + ids(20, 4)
    (d5,) = run(engine, gen(p4, "s"))
    assert d5.session_reset_reason == "truncated" and d5.reused_prompt_tokens == 0
    assert d5.prefilled_prompt_tokens == len(p4)
    assert d5.generated_token_ids == fresh(engine, p4)

    # and the session goes on appending after all that
    p5 = p4 + (d5.generated_token_ids or []) + ids(4, 5)
    (d6,) = run(engine, gen(p5, "s"))
    assert d6.session_reset_reason == "exact_prefix"
    assert d6.generated_token_ids == fresh(engine, p5)


def test_rollback_to_a_prompt_snapshot_inside_a_prefill_chunk(model: Any) -> None:
    """The prompt-end snapshot falls inside a prefill chunk (prompt of 37, chunks of 16): an
    agent that keeps the prompt but rewrites the reply resumes there."""
    engine = make_engine(model)
    p1 = ids(37, 6)
    (d1,) = run(engine, gen(p1, "s", n=10))
    p2 = p1 + ids(12, 7)  # the reply replaced by other tokens
    (d2,) = run(engine, gen(p2, "s"))
    assert d2.session_reset_reason == "truncated" and d2.reused_prompt_tokens == len(p1) - 1
    assert d2.generated_token_ids == fresh(engine, p2)
    assert d1.generated_token_ids is not None


def test_old_snapshots_are_evicted_then_rollback_reprefills(model: Any) -> None:
    """Four snapshots a session: after three more turns, turn 1's are gone."""
    engine = make_engine(model)
    history = ids(20, 8)
    (d,) = run(engine, gen(history, "s", n=4))
    for turn in range(3):
        history = history + (d.generated_token_ids or []) + ids(5, 20 + turn)
        (d,) = run(engine, gen(history, "s", n=4))
        assert d.session_reset_reason == "exact_prefix"
    edited = history[:22] + ids(6, 30)  # inside turn 1's reply
    (d,) = run(engine, gen(edited, "s", n=8))
    assert d.session_reset_reason == "truncated" and d.reused_prompt_tokens == 0
    assert d.generated_token_ids == fresh(engine, edited, n=8)


def test_concurrent_sessions_batched_with_rollbacks(model: Any) -> None:
    """Two sessions prefilling and decoding in the same steps, each rolled back: each equals
    its prompt alone."""
    engine = make_engine(model)
    a1, b1 = ids(25, 40), ids(33, 41)
    da, db = run(engine, gen(a1, "a", rid="a"), gen(b1, "b", rid="b"))
    a2 = a1 + ids(6, 42)  # the reply replaced: back to a's prompt-end snapshot
    b2 = b1 + (db.generated_token_ids or []) + ids(3, 43)  # append
    da2, db2 = run(engine, gen(a2, "a", rid="a"), gen(b2, "b", rid="b"))
    assert (da2.session_reset_reason, db2.session_reset_reason) == ("truncated", "exact_prefix")
    assert da2.generated_token_ids == fresh(engine, a2)
    assert db2.generated_token_ids == fresh(engine, b2)
    assert da.generated_token_ids is not None


def test_bytes_per_session_counts_state_and_snapshots(model: Any) -> None:
    engine = make_engine(model, max_context=128)
    info = engine.info()
    kv = engine.kv
    deltanet_live = 3 * ((2 * 2 * 8 + 4 * 12) * 3 + 4 * 8 * 12) * 4  # 3 layers, fp32
    kv_bytes = 1 * 2 * 2 * 128 * 16 * 4  # 1 full layer, K and V, 2 heads
    assert info["bytes_per_session"] == kv.bytes_per_slot
    assert kv.bytes_per_slot == kv_bytes + (1 + kv.snapshots) * deltanet_live
