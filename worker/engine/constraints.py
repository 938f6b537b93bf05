"""Constrained decoding: a generate's `json_schema`, `json_object`, `regex` or `grammar`
turned into a per-step token mask, with llguidance (BENCHMARKS.md, "Structured output", says
why llguidance and not xgrammar).

- `GrammarCache`: the constraint (`protocol.constraints` says what each field means as an
  llguidance grammar) as a pristine matcher over this vocabulary, built once per (kind,
  source) and cached by its hash; each request takes a `deep_copy`. Errors (invalid schema,
  unsupported keyword, a grammar that does not parse) raise `ConstraintError` with
  llguidance's message, before anything runs; so does a constraint no output can satisfy
  (`protocol.constraints.unsatisfiable_reason`, `unsatisfiable` set).
- `Constraints`: the engine's per-request matchers, keyed by the engine's request key.
  `start_masks(keys)` fills the next-token bitmasks of the given rows on a helper thread
  (llguidance drops the GIL; several rows in parallel on llguidance's own threads), so the
  mask of step t is computed while the device runs step t's forward; `MaskJob.result()`
  joins. `accept(key, token)` advances a row's grammar.

The bitmask is llguidance's layout: int32 words [rows, ceil(V / 32)], bit j of word w set
when token 32 * w + j is allowed. EOS ids are allowed exactly when the grammar accepts.
Rows without a constraint are all ones. `worker.engine.sampling.sample` applies it on the
device (masked logits -> -inf) before sampling.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from protocol import GenerateRequest
from protocol.constraints import (
    UNSATISFIABLE_PREFIX,
    ConstraintError,
    grammar_text,
    request_constraint,
    unsatisfiable_reason,
)

__all__ = ["ConstraintError", "Constraints", "GrammarCache", "llguidance_tokenizer"]


def llguidance_tokenizer(tokenizer: Any) -> Any:
    """An `llguidance.LLTokenizer` over the engine tokenizer's byte table: special and EOS
    tokens (empty bytes) are marked special, so a grammar never produces them as text."""
    import llguidance

    vocab = int(tokenizer.vocab_size)
    table = [tokenizer.token_bytes(i) for i in range(vocab)]
    eos = sorted(tokenizer.eos_ids)

    class _Gtok:
        eos_token_id = eos[0] if eos else None
        bos_token_id = tokenizer.bos_id
        tokens = table
        special_token_ids = [i for i, b in enumerate(table) if not b]

        def __call__(self, data: bytes) -> list[int]:
            return list(tokenizer.encode(data.decode("utf-8", errors="replace")))

    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Gtok()), n_vocab=vocab, eos_token=eos or None
    )


class GrammarCache:
    """Pristine matchers by sha256 of (kind, source), least recently used dropped first."""

    def __init__(self, tokenizer: Any, capacity: int = 256) -> None:
        self._source_tokenizer = tokenizer
        self._ll_tokenizer: Any = None
        self._capacity = capacity
        self._matchers: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.compiles = 0

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance_tokenizer(self._source_tokenizer)
        return self._ll_tokenizer

    def matcher(self, kind: str, source: str) -> Any:
        """A fresh matcher (initial state) for the constraint. Raises ConstraintError."""
        import llguidance

        key = hashlib.sha256(f"{kind}\0{source}".encode()).hexdigest()
        with self._lock:
            pristine = self._matchers.get(key)
            if pristine is not None:
                self._matchers.move_to_end(key)
                self.hits += 1
                return pristine.deep_copy()
        grammar = grammar_text(kind, source)
        pristine = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if pristine.is_error():
            problem = str(pristine.get_error())
            raise ConstraintError(f"{kind}: {problem}", UNSATISFIABLE_PREFIX in problem)
        reason = unsatisfiable_reason(kind, source, grammar)
        if reason is not None:
            raise ConstraintError(f"{kind}: {reason}", unsatisfiable=True)
        with self._lock:
            self.compiles += 1
            self._matchers[key] = pristine
            while len(self._matchers) > self._capacity:
                self._matchers.popitem(last=False)
        return pristine.deep_copy()


class MaskJob:
    """The bitmask [rows, words] int32 (CPU) of one step's sampling rows, being filled."""

    def __init__(
        self,
        future: Future[torch.Tensor] | None,
        mask: torch.Tensor | None,
        owner: Constraints | None = None,
    ) -> None:
        self._future = future
        self._mask = mask
        self._owner = owner

    def result(self) -> torch.Tensor | None:
        """The filled mask, or None when no row of the step is constrained."""
        if self._future is not None:
            started = time.perf_counter()
            self._mask = self._future.result()
            self._future = None
            if self._owner is not None:  # the step's wait: the fill outlasted the forward
                self._owner.wait_s += time.perf_counter() - started
        return self._mask


NO_MASK = MaskJob(None, None)
_AHEAD, _STEP = 0, 1  # host mask buffers: filled ahead, assembled for a step


class Constraints:
    """The grammar state of every constrained request in flight (keyed by engine key)."""

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = int(tokenizer.vocab_size)
        self.cache = GrammarCache(tokenizer)
        self._eos_ids = sorted(int(e) for e in tokenizer.eos_ids)
        self._words = 0  # known with llguidance's tokenizer (`words`)
        self._eos_only: torch.Tensor | None = None
        self._matchers: dict[int, Any] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None  # llguidance's LLExecutor: rows filled in parallel
        # two host buffers, used in turn: step t's copy to the device is done (its ids were
        # read) before step t + 2 refills the buffer. Pinned with CUDA (an async copy).
        self._pinned = torch.cuda.is_available()
        self._buffers: list[torch.Tensor] = []
        self._ahead: tuple[tuple[int, ...], Future[torch.Tensor]] | None = None
        self.ahead_rows = 0  # rows whose mask `fill_ahead` had started
        self.masks = 0  # steps with a constrained row
        self.fill_s = 0.0  # time filling their masks (helper thread)
        self.fill_max_s = 0.0  # the slowest step's fill
        self.start_s = 0.0  # time from the request for a fill to its start (the GIL)
        self.wait_s = 0.0  # time the steps waited for them (`MaskJob.result`)

    @property
    def words(self) -> int:
        """Int32 words per mask row: llguidance's vocabulary, which is one token larger than
        the tokenizer's when the tokenizer has no EOS (it adds one; the logits never reach
        it: `apply_token_mask` reads the first V bits)."""
        if not self._words:
            self._words = (int(self.cache.ll_tokenizer.vocab_size) + 31) // 32
        return self._words

    def _eos_only_row(self) -> torch.Tensor:
        """The mask of a row whose grammar failed (it never should: the mask allowed the
        token): it may only end."""
        if self._eos_only is None:
            self._eos_only = torch.zeros(self.words, dtype=torch.int32)
            for eos in self._eos_ids:
                word, bit = divmod(eos, 32)
                self._eos_only[word] |= torch.tensor(1 << bit).to(torch.int32)
        return self._eos_only

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def open(self, key: int, req: GenerateRequest) -> None:
        """Compile (or take from the cache) the request's constraint. Raises ConstraintError."""
        spec = request_constraint(req)
        if spec is not None:
            self._matchers[key] = self.cache.matcher(*spec)

    def close(self, key: int) -> None:
        self._matchers.pop(key, None)

    def constrained(self, key: int) -> bool:
        return key in self._matchers

    def fill_ahead(self, keys: Sequence[int]) -> None:
        """Start filling the masks of the constrained rows among `keys` (in order) now, right
        after their tokens were accepted, so the fill runs while the host streams the tokens
        and plans the next step; that step's `start_masks` takes the rows it has."""
        ahead_keys = tuple(k for k in keys if k in self._matchers)
        self._ahead = None
        if not ahead_keys:
            return
        rows = [(i, self._matchers[k]) for i, k in enumerate(ahead_keys)]
        job = self._submit(self._fill, len(rows), rows, time.perf_counter(), _AHEAD)
        self._ahead = (ahead_keys, job)

    def start_masks(self, keys: Sequence[int]) -> MaskJob:
        """Start filling the bitmask of these sampling rows (in order); NO_MASK when none of
        them is constrained. Rows `fill_ahead` started are taken from it (all of them: its
        job itself)."""
        rows = [(i, self._matchers[k]) for i, k in enumerate(keys) if k in self._matchers]
        if not rows:
            return NO_MASK
        self.masks += 1
        ahead, self._ahead = self._ahead, None
        asked = time.perf_counter()
        if ahead is None:
            return MaskJob(self._submit(self._fill, len(keys), rows, asked, _STEP), None, self)
        ahead_keys, ahead_job = ahead
        if tuple(keys) == ahead_keys:
            self.ahead_rows += len(rows)
            return MaskJob(ahead_job, None, self)
        where = {k: j for j, k in enumerate(ahead_keys)}
        taken = [(i, where[k]) for i, k in enumerate(keys) if k in where]
        fresh = [(i, m) for i, m in rows if keys[i] not in where]
        self.ahead_rows += len(taken)
        job = self._submit(self._assemble, len(keys), ahead_job, taken, fresh, asked)
        return MaskJob(job, None, self)

    def _submit(self, fn: Any, *args: Any) -> Future[torch.Tensor]:
        # one thread: jobs run in order, so a job's matchers are never filled twice at once
        # and a fill started ahead is done when a later job is
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._pool.submit(fn, *args)

    def _buffer(self, which: int, batch: int) -> torch.Tensor:
        """Host buffer `which` (_AHEAD, _STEP) for `batch` rows. A buffer is refilled only
        after the step that copied it to the device read its ids (that copy is done)."""
        while len(self._buffers) <= which:
            self._buffers.append(torch.empty((0, self.words), dtype=torch.int32))
        if self._buffers[which].shape[0] < batch:
            self._buffers[which] = torch.empty(
                (batch, self.words), dtype=torch.int32, pin_memory=self._pinned
            )
        return self._buffers[which][:batch]

    def _assemble(
        self,
        batch: int,
        ahead_job: Future[torch.Tensor],
        taken: list[tuple[int, int]],
        fresh: list[tuple[int, Any]],
        asked: float,
    ) -> torch.Tensor:
        """The step's mask from the rows filled ahead (`taken`: step row, ahead row) and the
        rest filled now (`fresh`: step row, matcher); free rows allow everything."""
        ahead = ahead_job.result()  # done: it ran before on this thread
        mask = self._fill(batch, fresh, asked, _STEP)
        for i, j in taken:
            mask[i].copy_(ahead[j])
        return mask

    def stats(self) -> dict[str, Any]:
        """The worker's `stats` figures of constrained decoding."""
        return {
            "masked_steps": self.masks,
            "mask_fill_ms": round(self.fill_s * 1000, 1),
            "mask_fill_max_ms": round(self.fill_max_s * 1000, 1),
            "mask_start_ms": round(self.start_s * 1000, 1),
            "mask_wait_ms": round(self.wait_s * 1000, 1),
            "mask_rows_ahead": self.ahead_rows,
            "compiles": self.cache.compiles,
            "cache_hits": self.cache.hits,
        }

    def _fill(
        self, batch: int, rows: list[tuple[int, Any]], asked: float, which: int
    ) -> torch.Tensor:
        started = time.perf_counter()
        self.start_s += started - asked
        mask = self._buffer(which, batch)
        # free rows allow everything; constrained rows are written whole below (one row at
        # a time: a fill of the whole buffer is an OpenMP region, whose threads would then
        # spin on the cores llguidance's threads need)
        constrained = {i for i, _ in rows}
        for i in range(batch):
            if i not in constrained:
                mask[i].fill_(-1)
        row_bytes = self.words * 4
        live = []
        for i, matcher in rows:
            if matcher.is_error():
                mask[i].copy_(self._eos_only_row())
            else:
                live.append((matcher, i))
        if len(live) == 1:
            matcher, i = live[0]
            matcher.unsafe_compute_mask_ptr(mask[i].data_ptr(), row_bytes)
        elif live:  # every row at once on llguidance's threads (the GIL is released)
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(live, mask.data_ptr(), row_bytes, batch)
        took = time.perf_counter() - started
        self.fill_s += took
        self.fill_max_s = max(self.fill_max_s, took)
        return mask

    def accept(self, key: int, token: int) -> bool:
        """Advance the row's grammar by a sampled token. False when the grammar rejects it
        (it never should: the mask allowed it); the row's mask then allows only EOS."""
        matcher = self._matchers.get(key)
        return matcher is None or bool(matcher.consume_token(token))
