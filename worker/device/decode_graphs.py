"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (every sequence adds one token) has static shapes once the batch is padded to
a bucket (1, 2, 4, ... 64), so it is captured once per bucket and replayed: one launch per
step instead of thousands. Inputs live in static device buffers; padded rows have slot -1
(nothing is stored, attention returns zeros) and their outputs are ignored.

The step is the model's own layers with attention through `FusedDecodePlan`, which stands in
for `worker.layers.attention.AttentionPlan` and calls the kernels of
`worker.device.kernels.attention`
(store the new K/V at `position % capacity` of the slot, then split-KV decode attention read
in place from the pool). `decode_logits` mirrors `CausalLM.forward` for that case.

`DecodeGraphRunner` holds the static buffers and graphs; `worker/device/graphed_lm.py`'s
`GraphedCausalLM` is the model object the engine uses on CUDA, built on two runners.
`DecodeGraphRunner.decode(...)` is the same step with sampling inside the graph
(`worker.device.kernels.batched_sampling`); only the sampled ids come back, one sync per step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from worker.device.kernels.attention import decode_attention_op, store_kv_op
from worker.device.kernels.batched_sampling import RowSampling, sample_rows
from worker.device.memory import indexed
from worker.layers.blocks import norm_chain
from worker.layers.quant import QuantLinear

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The one side stream every graph capture on `device` warms up on (PyTorch's recipe: a
    capture's eager warm-up runs off the default stream). One for all: the caching allocator
    keeps what a warm-up freed for the stream it ran on, so a new stream a captured size would
    leave each size's warm-up memory reserved where no other stream's step can use it."""
    key = indexed(device)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(key)
    return _CAPTURE_STREAMS[key]


def bucket_for(batch: int, buckets: Sequence[int] = BATCH_BUCKETS) -> int | None:
    """The smallest bucket >= batch, or None when the batch is larger than all (pure)."""
    for size in sorted(buckets):
        if size >= batch:
            return size
    return None


class FusedDecodePlan:
    """Tensor-only attention plan of a decode step: row b adds the token at `positions[b]`
    to slot `slots[b]` (-1: padding). Everything stays on the device."""

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.slots = slots  # [B] int64
        self.positions = positions  # [B] int64
        self.lens = torch.where(slots >= 0, positions + 1, 0)  # [B] tokens after the write

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, scale: float
    ) -> torch.Tensor:
        """q [B, H, D]; k, v [B, KVH, D]; cache: a worker.layers.kv.LayerCache."""
        store_kv_op(cache.k, cache.v, k.contiguous(), v.contiguous(), self.slots, self.positions)
        return self.attend_stored(q, cache, scale)

    def attend_stored(self, q: torch.Tensor, cache: Any, scale: float) -> torch.Tensor:
        """`attend` once this step's keys and values are in ``cache`` already (written by the
        kernel that norms and rotates them, `rmsnorm.qkv_norm_rope_store_triton`)."""
        return decode_attention_op(
            q.contiguous(), cache.k, cache.v, self.slots, self.lens, float(scale), cache.window or 0
        )


def attend_with_fused_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, plan: Any, scale: float
) -> torch.Tensor:
    """`worker.layers.attention.attend`, plus the FusedDecodePlan case."""
    if isinstance(plan, FusedDecodePlan):
        return plan.attend(q, k, v, cache, scale)
    from worker.layers.attention import attend

    return attend(q, k, v, cache, plan, scale)


def install_fused_decode_hook() -> None:
    """Route the layers' attention through `attend_with_fused_decode` (idempotent).

    Interim: the permanent form is one line at the top of
    `worker.layers.attention.attend`: `if hasattr(plan, "attend"): return plan.attend(q, k,
    v, cache, scale)`; this function is then a no-op in effect.
    """
    import worker.layers.blocks as layers

    if layers.attend is not attend_with_fused_decode:
        layers.attend = attend_with_fused_decode


@torch.no_grad()
def decode_logits(
    model: Any, kv: Any, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """`CausalLM.forward` for one new token per row, tensors only (capturable).

    input_ids, positions, slots: [B] int64 on the model's device -> [B, vocab] float32.
    """
    return rows_logits(model, kv, input_ids, positions, FusedDecodePlan(slots, positions))


def rows_logits(
    model: Any,
    kv: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    plan: Any,
    last: torch.Tensor | None = None,
) -> torch.Tensor:
    """`CausalLM.forward` with a tensor-only attention plan (capturable): the logits of every
    row [T, vocab], or of the rows `last` [B] int64 picks (float32)."""
    x = model.model.embed_tokens(input_ids)  # [T, hidden]
    if model.embed_scale is not None:
        x = x * torch.tensor(model.embed_scale, dtype=x.dtype)
    tables = {key: rot.cos_sin(positions, x.dtype) for key, rot in model._rotaries.items()}
    layers = model.model.layers
    chain = norm_chain(layers, model.model.norm, x)  # each layer's last kernel norms for the next
    normed = None
    for i, (layer, rope_key, cache) in enumerate(zip(layers, model._rope_keys, kv.layers,
                                                     strict=True)):  # fmt: skip
        if chain is None:
            x = layer(x, tables[rope_key], cache, plan)
        else:
            x, normed = layer.forward_chained(x, normed, tables[rope_key], cache, plan, chain[i])
    if normed is not None:
        x = normed  # the final norm, applied by the last layer
    if last is not None:
        x = x.index_select(0, last)
    last_hidden = x if normed is not None else model.model.norm(x)
    gemv = getattr(model, "_decode_lm_head_gemv", None)  # set by worker/device/cuda_setup.py
    if isinstance(model.lm_head, QuantLinear):  # its own kernels (quant_matmul)
        logits = model.lm_head(last_hidden).float()
    else:
        weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        if gemv is not None:
            from worker.device.kernels.gemv import linear_for_decode

            logits = linear_for_decode(last_hidden, weight, gemv).float()  # [B, vocab]
        else:
            logits = F.linear(last_hidden, weight).float()  # [B, vocab]
    cap = model.config.final_logit_softcapping
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


class DecodeGraphRunner:
    """Static buffers and one captured decode graph per bucket (eager when `use_graphs` is
    false: the same code path without capture, for CPU tests)."""

    def __init__(
        self,
        model: Any,
        kv: Any,
        max_batch: int,
        *,
        use_graphs: bool | None = None,
        buckets: Sequence[int] = BATCH_BUCKETS,
        compile_decode: bool | None = None,
    ) -> None:
        install_fused_decode_hook()
        if compile_decode is None:
            compile_decode = os.environ.get("TOKENPIPE_COMPILE_DECODE") == "1"
        # torch.compile fuses the small per-layer ops (norms, rope, residuals) of the step;
        # batch is dynamic, so one compile serves the buckets above 1 (and one for batch 1)
        self._compiled: Any = torch.compile(decode_logits, dynamic=True) if compile_decode else None
        self.model, self.kv = model, kv
        self.device = model.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets = tuple(b for b in sorted(buckets) if b <= max(max_batch, 1))
        if not self.buckets or self.buckets[-1] < max_batch:
            self.buckets += (bucket_for(max_batch, buckets) or max_batch,)
        size = self.buckets[-1]
        dev = self.device
        # static inputs: [size]; rows past the live batch are padding
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slots = torch.full((size,), -1, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(size, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(size, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(size, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(size, dtype=torch.int64, device=dev)
        self.seeds = torch.zeros(size, dtype=torch.int64, device=dev)
        self.counters = torch.zeros(size, dtype=torch.int64, device=dev)  # draw numbers
        pin = self.device.type == "cuda"
        # host staging, one copy per step: ints [5, size] (positions, slots, top_k, seeds,
        # counters), floats [3, size] (temperature, top_p, min_p)
        self._host_ints = torch.zeros((5, size), dtype=torch.int64, pin_memory=pin)
        self._host_floats = torch.zeros((3, size), dtype=torch.float32, pin_memory=pin)
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool: Any = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # outputs of the last step
        self.last_sampled = False  # whether its ids were drawn (else the argmax)
        self.host_ids = torch.zeros(size, dtype=torch.int64, pin_memory=pin)  # its ids

    # -- capture ---------------------------------------------------------------------------

    def _body(self, size: int, sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = (self.input_ids[:size], self.positions[:size], self.slots[:size])
        logits = None
        if self._compiled is not None:
            try:
                logits = self._compiled(self.model, self.kv, *inputs)
            except Exception as exc:  # noqa: BLE001 - fall back to the eager step
                print(f"cuda_graphs: torch.compile failed, eager decode: {exc!r}", file=sys.stderr)
                self._compiled = None
        if logits is None:
            logits = decode_logits(self.model, self.kv, *inputs)
        if sample:
            ids = sample_rows(
                logits, self.temperature[:size], self.top_k[:size], self.top_p[:size],
                self.min_p[:size], self.seeds[:size], self.counters[:size],
            )  # fmt: skip
        else:
            ids = torch.argmax(logits, dim=-1)
        return logits, ids

    def _pad_inputs(self) -> None:
        self.slots.fill_(-1)
        self.input_ids.zero_()
        self.positions.zero_()

    def warm_up(self, sample: bool, sizes: Sequence[int] | None = None) -> None:
        """The step of each of `sizes` (default: every bucket) once, eagerly, on padding rows:
        the kernels the capture launches (worker/device/graphed_lm.py compiles them ahead)."""
        self._pad_inputs()
        with torch.inference_mode():
            for size in sorted(sizes or self.buckets, reverse=True):
                self._body(size, sample)

    def capture(self, sample: bool = False, sizes: Sequence[int] | None = None) -> None:
        """Capture the graphs of `sizes` (default: every bucket), largest first so the
        smaller ones reuse its memory pool. Inputs are reset to padding first."""
        if not self.use_graphs:
            return
        self._pad_inputs()
        for size in sorted(sizes or self.buckets, reverse=True):
            key = (size, sample)
            if key in self._graphs:
                continue
            stream = capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode():
                # warm-up: lazy tables, Triton and torch.compile compilation, cuBLAS; twice,
                # so a recompile (dynamic shapes) happens here and never during capture
                for _ in range(2 if self._compiled is not None else 1):
                    self._body(size, sample)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
                out = self._body(size, sample)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[key] = graph
            self._outputs[key] = out
        torch.cuda.synchronize(self.device)

    # -- one step --------------------------------------------------------------------------

    def _load(
        self,
        input_ids: torch.Tensor,
        positions: Sequence[int],
        slots: Sequence[int],
        rows: Sequence[RowSampling] | None,
        counters: Sequence[int] | None = None,
    ) -> int:
        batch = len(slots)
        size = bucket_for(batch, self.buckets)
        if size is None:
            raise ValueError(f"batch {batch} exceeds the largest bucket {self.buckets[-1]}")
        ints, floats = self._host_ints, self._host_floats
        ints[:, :size].zero_()
        ints[1, :size] = -1
        ints[0, :batch] = torch.as_tensor(positions, dtype=torch.int64)
        ints[1, :batch] = torch.as_tensor(slots, dtype=torch.int64)
        if rows is not None:
            floats[:, :size] = torch.tensor([[0.0], [1.0], [0.0]])
            floats[:, :batch] = torch.tensor(
                [[r.temperature, r.top_p, r.min_p] for r in rows], dtype=torch.float32
            ).T
            ints[2, :batch] = torch.as_tensor([r.top_k for r in rows], dtype=torch.int64)
            ints[3, :batch] = torch.as_tensor(
                [r.seed & ((1 << 63) - 1) for r in rows], dtype=torch.int64
            )
            ints[4, :batch] = torch.as_tensor(
                list(counters) if counters is not None else [p + 1 for p in positions],
                dtype=torch.int64,
            )
        dev_ints = ints.to(self.device, non_blocking=True)[:, :size]
        self.positions[:size].copy_(dev_ints[0])
        self.slots[:size].copy_(dev_ints[1])
        if rows is not None:
            dev_floats = floats.to(self.device, non_blocking=True)[:, :size]
            self.top_k[:size].copy_(dev_ints[2])
            self.seeds[:size].copy_(dev_ints[3])
            self.counters[:size].copy_(dev_ints[4])
            self.temperature[:size].copy_(dev_floats[0])
            self.top_p[:size].copy_(dev_floats[1])
            self.min_p[:size].copy_(dev_floats[2])
        self.input_ids[batch:size].zero_()
        self.input_ids[:batch].copy_(input_ids.to(self.device, non_blocking=True))
        return size

    def _run(self, size: int, sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
        key = (size, sample)
        self.last_sampled = sample
        if not self.use_graphs:
            with torch.inference_mode():
                self._last = self._body(size, sample)
            return self._last
        if key not in self._graphs:
            print(f"cuda_graphs: capturing decode bucket {size} (sample={sample})",
                  file=sys.stderr)  # fmt: skip
            self.capture(sample, [size])
        self._graphs[key].replay()
        self._last = self._outputs[key]
        return self._last

    @property
    def last_logits(self) -> torch.Tensor:
        """[bucket, vocab] logits of the last step (a static buffer: valid until the next)."""
        assert self._last is not None
        return self._last[0]

    @property
    def last_ids(self) -> torch.Tensor:
        """[bucket] int64 ids of the last step: drawn when `last_sampled`, else the argmax."""
        assert self._last is not None
        return self._last[1]

    def copy_ids_to_host(self, size: int) -> None:
        """Queue the copy of the last step's ids into `host_ids` (no sync)."""
        assert self._last is not None
        self.host_ids[:size].copy_(self._last[1][:size], non_blocking=True)

    def step_after(
        self, prev: DecodeGraphRunner, size: int, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The decode step that follows `prev`'s last one, fed from it on the device: each
        row feeds prev's ids (drawn or argmax; `ids` [B] on the device instead, when given:
        the ids sampled after a grammar mask) at the next position, same slots; when prev
        drew, this step draws too, with the same settings and each row's next draw number.
        Queued on the current stream with no host sync; returns the [size, vocab] logits."""
        assert prev._last is not None
        sample = prev.last_sampled
        with torch.inference_mode():
            self.input_ids[:size].copy_(prev._last[1][:size])
            if ids is not None:
                self.input_ids[: ids.shape[0]].copy_(ids)
            torch.add(prev.positions[:size], 1, out=self.positions[:size])
            self.slots[:size].copy_(prev.slots[:size])
            if sample:
                for mine, theirs in (
                    (self.temperature, prev.temperature), (self.top_k, prev.top_k),
                    (self.top_p, prev.top_p), (self.min_p, prev.min_p), (self.seeds, prev.seeds),
                ):  # fmt: skip
                    mine[:size].copy_(theirs[:size])
                torch.add(prev.counters[:size], 1, out=self.counters[:size])
        return self._run(size, sample)[0]

    def logits(
        self,
        step: Any,
        rows: Sequence[RowSampling] | None = None,
        counters: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """[B, vocab] float32 logits of a decode-only StepInput (a view of a static buffer:
        valid until the next step). With `rows` (and their draw numbers) where some row
        samples, the step also draws each row's next id in the graph (`last_ids`)."""
        sample = rows is not None and not all(r.greedy for r in rows)
        size = self._load(
            step.input_ids, step.cached_lens, step.slots, rows if sample else None, counters
        )
        logits, _ = self._run(size, sample)
        return logits[: len(step.slots)]

    def decode(
        self,
        tokens: Sequence[int] | torch.Tensor,
        positions: Sequence[int],
        slots: Sequence[int],
        rows: Sequence[RowSampling],
    ) -> list[int]:
        """Feed one token per sequence and return the sampled next ids (one host sync)."""
        ids = torch.as_tensor(tokens, dtype=torch.int64)
        sample = not all(r.greedy for r in rows)
        size = self._load(ids, positions, slots, rows if sample else None)
        _, picked = self._run(size, sample)
        return picked[: len(slots)].tolist()


def split_decode_rows(step: Any) -> tuple[list[int], list[int]]:
    """(decode rows, other rows) of a step: a decode row adds one token to a non-empty
    cache (pure)."""
    decode, other = [], []
    for i, (cached, new) in enumerate(zip(step.cached_lens, step.new_lens, strict=True)):
        (decode if new == 1 and cached > 0 else other).append(i)
    return decode, other


def sub_step(step: Any, rows: Sequence[int]) -> Any:
    """The StepInput of the given sequences only (their tokens, in the given order)."""
    from worker.models.step import StepInput

    starts = [0]
    for n in step.new_lens:
        starts.append(starts[-1] + n)
    index = [t for i in rows for t in range(starts[i], starts[i + 1])]
    picked = torch.tensor(index, dtype=torch.int64).to(step.input_ids.device, non_blocking=True)
    return StepInput(
        input_ids=step.input_ids.index_select(0, picked),
        positions=step.positions.index_select(0, picked),
        slots=[step.slots[i] for i in rows],
        cached_lens=[step.cached_lens[i] for i in rows],
        new_lens=[step.new_lens[i] for i in rows],
        grammar_masked=step.grammar_masked,
        same_rows_next=step.same_rows_next,
    )
