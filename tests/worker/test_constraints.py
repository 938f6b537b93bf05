"""The grammar masks of `worker.engine.constraints` on a tiny byte-level tokenizer: several
rows filled at once (llguidance's threads) equal each row filled alone, and a tokenizer
without any EOS (llguidance then adds one past the vocabulary) still gets its masks."""

from __future__ import annotations

from typing import Any

import pytest
import tokenizers
import torch
from tiny_models import byte_level_tokenizer_json

from protocol import GenerateRequest
from worker.engine.constraints import Constraints
from worker.loading.tokenizer import Tokenizer

pytest.importorskip("llguidance")

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"enum": ["hello", "world"]}, "minItems": 2},
    {"type": "string", "pattern": "^h[a-z]+$"},
]


def _tokenizer(eos: bool) -> Tokenizer:
    import json

    backend = tokenizers.Tokenizer.from_str(json.dumps(byte_level_tokenizer_json()))
    config = {"eos_token_id": [backend.token_to_id("<eos>")]} if eos else {}
    return Tokenizer.from_backend(backend, config=config)


def _allowed(row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("eos", [True, False])
def test_rows_filled_together_equal_rows_filled_alone(eos: bool) -> None:
    tok = _tokenizer(eos)
    constraints = Constraints(tok)
    for key, schema in enumerate(SCHEMAS):
        constraints.open(key, GenerateRequest(prompt="x", json_schema=schema))
    vocab = tok.vocab_size
    assert constraints.words == (vocab + (0 if eos else 1) + 31) // 32
    # a free row (key 9) between constrained ones; advance each grammar a few tokens
    for _ in range(4):
        together = constraints.start_masks([0, 9, 1, 2]).result()
        assert together is not None and together.shape == (4, constraints.words)
        assert bool((together[1] == -1).all())  # the free row allows everything
        for position, key in ((0, 0), (2, 1), (3, 2)):
            alone = constraints.start_masks([key]).result()
            assert alone is not None and torch.equal(alone[0], together[position])
            allowed = _allowed(together[position], vocab)
            assert allowed and len(allowed) < vocab
            assert constraints.accept(key, min(allowed))


def test_masks_filled_ahead_equal_masks_filled_for_the_step() -> None:
    tok = _tokenizer(True)
    ahead, plain = Constraints(tok), Constraints(tok)
    for c in (ahead, plain):
        for key, schema in enumerate(SCHEMAS[:2]):
            c.open(key, GenerateRequest(prompt="x", json_schema=schema))
    vocab = tok.vocab_size
    steps: list[list[int]] = [
        [0, 1],  # nothing filled ahead yet
        [0, 1],  # the rows filled ahead, in order: their job itself
        [1, 0],  # another order: rows copied from it
        [0, 9, 1],  # a free row in between
        [0, 1, 2],  # a new constrained row: filled for the step
        [2, 0],  # row 1 left the step (its ahead mask is not used)
    ]
    for step, keys in enumerate(steps):
        if step == 4:
            for c in (ahead, plain):
                c.open(2, GenerateRequest(prompt="x", json_schema=SCHEMAS[2]))
        got = ahead.start_masks(keys).result()
        want = plain.start_masks(keys).result()
        assert got is not None and want is not None and torch.equal(got, want), step
        tokens = {k: min(_allowed(want[i], vocab)) for i, k in enumerate(keys) if k != 9}
        for c in (ahead, plain):
            for key, token in tokens.items():
                assert c.accept(key, token)
        ahead.fill_ahead(keys)  # the free row is left out
    assert ahead.ahead_rows == 2 * (len(steps) - 1)
