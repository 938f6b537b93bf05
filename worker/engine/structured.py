"""What a generate asks of its sampled tokens beyond the id: a grammar they must follow
(`worker.engine.constraints`) and their log-probabilities. The engine's hooks, keyed by the
engine's request key:

    open(key, req)            at admission: compile the constraint (a ConstraintError or None)
    token_mask(keys)          before the forward: start the step's bitmask (None: no row is
                              constrained); `worker.engine.sampling.sample_step` joins it
    fill_ahead(keys)          after a step's tokens were accepted: start the masks of the
                              rows that go on (the next step's `token_mask` takes them)
    top_logprobs(reqs)        per sampling row: -1, or how many top tokens to report
    accept(key, req, token, row_logprobs, eos)   after sampling: advance the grammar, keep
                              the token's log-probabilities until its text is streamed
    take_logprobs(key)        the entries behind the next `token` event
    close(key)                when the request ends
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from protocol import GenerateRequest, TokenLogprob, TopLogprob
from worker.engine.constraints import ConstraintError, Constraints
from worker.engine.sampling import RowLogprobs


class StructuredRows:
    """Grammar state and pending log-probabilities of the requests in flight."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._constraints: Constraints | None = None  # built at the first constrained request
        self._pending: dict[int, list[TokenLogprob]] = {}
        self._text: dict[int, str] = {}

    def open(self, key: int, req: GenerateRequest) -> ConstraintError | None:
        if req.json_schema is None and not req.json_object and not req.regex and not req.grammar:
            return None
        if self._constraints is None:
            self._constraints = Constraints(self._tokenizer)
        try:
            self._constraints.open(key, req)
        except ConstraintError as exc:
            return exc
        return None

    def close(self, key: int) -> None:
        if self._constraints is not None:
            self._constraints.close(key)
        self._pending.pop(key, None)

    def stats(self) -> dict[str, Any] | None:
        """Constrained decoding's figures (`Constraints.stats`); None before the first
        constrained request."""
        return self._constraints.stats() if self._constraints is not None else None

    def token_mask(self, keys: Sequence[int]) -> Callable[[], torch.Tensor | None] | None:
        if not self._constraints:
            return None
        return self._constraints.start_masks(keys).result

    def fill_ahead(self, keys: Sequence[int]) -> None:
        """After a step's tokens were accepted: start the masks of its rows that go on."""
        if self._constraints:
            self._constraints.fill_ahead(keys)

    @staticmethod
    def top_logprobs(reqs: Sequence[GenerateRequest]) -> list[int] | None:
        if not any(r.return_logprobs for r in reqs):
            return None
        return [r.top_logprobs if r.return_logprobs else -1 for r in reqs]

    def accept(
        self,
        key: int,
        req: GenerateRequest,
        token: int,
        row_logprobs: RowLogprobs | None,
        eos_ids: frozenset[int],
    ) -> None:
        if self._constraints is not None:
            self._constraints.accept(key, token)
        if row_logprobs is None or token in eos_ids:
            return
        top = None
        if req.top_logprobs:
            top = [
                TopLogprob(id=i, token=self._token_text(i), logprob=lp)
                for i, lp in zip(row_logprobs.top_ids, row_logprobs.top_logprobs, strict=True)
            ]
        entry = TokenLogprob(
            id=token, token=self._token_text(token), logprob=row_logprobs.logprob, top=top
        )
        self._pending.setdefault(key, []).append(entry)

    def take_logprobs(self, key: int) -> list[TokenLogprob] | None:
        return self._pending.pop(key, None)

    def _token_text(self, token: int) -> str:
        text = self._text.get(token)
        if text is None:
            raw = self._tokenizer.token_bytes(token)
            text = raw.decode("utf-8", errors="replace")
            if not raw:  # a special token: its own spelling
                text = self._tokenizer.id_to_token(token) or ""
            self._text[token] = text
        return text
