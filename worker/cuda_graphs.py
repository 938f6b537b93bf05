"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (every sequence adds one token) has static shapes once the batch is padded to
a bucket (1, 2, 4, ... 64), so it is captured once per bucket and replayed: one launch per
step instead of thousands. Inputs live in static device buffers; padded rows have slot -1
(nothing is stored, attention returns zeros) and their outputs are ignored.

The step is the model's own layers with attention through `FusedDecodePlan`, which stands in
for `worker.models.attention.AttentionPlan` and calls the kernels of `worker.kernels.attention`
(store the new K/V at `position % capacity` of the slot, then split-KV decode attention read
in place from the pool). `decode_logits` mirrors `CausalLM.forward` for that case.

Two entry points:
- `GraphedCausalLM(model)`: a drop-in for the model object. `make_kv_cache` also builds the
  runner; `model(step, kv)` replays a graph for the sequences that decode one token and runs
  the eager model for the rest (prefill chunks; every row when the decoders exceed the
  largest bucket).
- `DecodeGraphRunner.decode(...)`: the same step with sampling inside the graph
  (`worker.kernels.batched_sampling`); only the sampled ids come back, one sync per step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.kernels.attention import decode_attention_op, store_kv_op
from worker.kernels.batched_sampling import RowSampling, sample_rows

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


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
        """q [B, H, D]; k, v [B, KVH, D]; cache: a worker.models.kv.LayerCache."""
        store_kv_op(cache.k, cache.v, k.contiguous(), v.contiguous(), self.slots, self.positions)
        return decode_attention_op(
            q.contiguous(), cache.k, cache.v, self.slots, self.lens, float(scale), cache.window or 0
        )


def attend_with_fused_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, plan: Any, scale: float
) -> torch.Tensor:
    """`worker.models.attention.attend`, plus the FusedDecodePlan case."""
    if isinstance(plan, FusedDecodePlan):
        return plan.attend(q, k, v, cache, scale)
    from worker.models.attention import attend

    return attend(q, k, v, cache, plan, scale)


def install_fused_decode_hook() -> None:
    """Route the layers' attention through `attend_with_fused_decode` (idempotent).

    Interim: the permanent form is one line at the top of
    `worker.models.attention.attend`: `if hasattr(plan, "attend"): return plan.attend(q, k,
    v, cache, scale)`; this function is then a no-op in effect.
    """
    import worker.models.layers as layers

    if layers.attend is not attend_with_fused_decode:
        layers.attend = attend_with_fused_decode


@torch.no_grad()
def decode_logits(
    model: Any, kv: Any, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """`CausalLM.forward` for one new token per row, tensors only (capturable).

    input_ids, positions, slots: [B] int64 on the model's device -> [B, vocab] float32.
    """
    plan = FusedDecodePlan(slots, positions)
    x = model.model.embed_tokens(input_ids)  # [B, hidden]
    if model.embed_scale is not None:
        x = x * torch.tensor(model.embed_scale, dtype=x.dtype)
    tables = {key: rot.cos_sin(positions, x.dtype) for key, rot in model._rotaries.items()}
    for layer, rope_key, cache in zip(model.model.layers, model._rope_keys, kv.layers, strict=True):
        x = layer(x, tables[rope_key], cache, plan)
    last = model.model.norm(x)
    weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    gemv = getattr(model, "_decode_lm_head_gemv", None)  # set by worker/cuda_setup.py
    if gemv is not None:
        from worker.kernels.gemv import linear_for_decode

        logits = linear_for_decode(last, weight, gemv).float()  # [B, vocab]
    else:
        logits = F.linear(last, weight).float()  # [B, vocab]
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
        pin = self.device.type == "cuda"
        # host staging, one copy per step: ints [4, size] (positions, slots, top_k, seeds),
        # floats [3, size] (temperature, top_p, min_p)
        self._host_ints = torch.zeros((4, size), dtype=torch.int64, pin_memory=pin)
        self._host_floats = torch.zeros((3, size), dtype=torch.float32, pin_memory=pin)
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool: Any = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # outputs of the last step
        self.host_ids = torch.zeros(size, dtype=torch.int64, pin_memory=pin)  # its argmax

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
                self.min_p[:size], self.seeds[:size], self.positions[:size],
            )  # fmt: skip
        else:
            ids = torch.argmax(logits, dim=-1)
        return logits, ids

    def capture(self, sample: bool = False, sizes: Sequence[int] | None = None) -> None:
        """Capture the graphs of `sizes` (default: every bucket), largest first so the
        smaller ones reuse its memory pool. Inputs are reset to padding first."""
        if not self.use_graphs:
            return
        self.slots.fill_(-1)
        self.input_ids.zero_()
        self.positions.zero_()
        for size in sorted(sizes or self.buckets, reverse=True):
            key = (size, sample)
            if key in self._graphs:
                continue
            stream = torch.cuda.Stream(self.device)
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
            ints[3, :batch] = torch.as_tensor([r.seed for r in rows], dtype=torch.int64)
        dev_ints = ints.to(self.device, non_blocking=True)[:, :size]
        self.positions[:size].copy_(dev_ints[0])
        self.slots[:size].copy_(dev_ints[1])
        if rows is not None:
            dev_floats = floats.to(self.device, non_blocking=True)[:, :size]
            self.top_k[:size].copy_(dev_ints[2])
            self.seeds[:size].copy_(dev_ints[3])
            self.temperature[:size].copy_(dev_floats[0])
            self.top_p[:size].copy_(dev_floats[1])
            self.min_p[:size].copy_(dev_floats[2])
        self.input_ids[batch:size].zero_()
        self.input_ids[:batch].copy_(input_ids.to(self.device, non_blocking=True))
        return size

    def _run(self, size: int, sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
        key = (size, sample)
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

    def copy_ids_to_host(self, size: int) -> None:
        """Queue the copy of the last step's argmax ids into `host_ids` (no sync)."""
        assert self._last is not None
        self.host_ids[:size].copy_(self._last[1][:size], non_blocking=True)

    def step_after(self, prev: DecodeGraphRunner, size: int) -> torch.Tensor:
        """The decode step that follows `prev`'s last one, fed from it on the device: each
        row feeds prev's argmax at the next position, same slots. Queued on the current
        stream with no host sync; returns the [size, vocab] logits buffer."""
        assert prev._last is not None
        with torch.inference_mode():
            self.input_ids[:size].copy_(prev._last[1][:size])
            torch.add(prev.positions[:size], 1, out=self.positions[:size])
            self.slots[:size].copy_(prev.slots[:size])
        return self._run(size, sample=False)[0]

    def logits(self, step: Any) -> torch.Tensor:
        """[B, vocab] float32 logits of a decode-only StepInput (a view of a static buffer:
        valid until the next step)."""
        size = self._load(step.input_ids, step.cached_lens, step.slots, None)
        logits, _ = self._run(size, sample=False)
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
        sample = any(r.temperature > 0 and r.top_k != 1 for r in rows)
        size = self._load(ids, positions, slots, rows if sample else None)
        _, picked = self._run(size, sample)
        return picked[: len(slots)].tolist()


def is_decode_only(step: Any) -> bool:
    """Every sequence of the step adds one token to a non-empty cache (pure)."""
    return all(n == 1 for n in step.new_lens) and all(c > 0 for c in step.cached_lens)


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
    )


@dataclass
class _Ahead:
    """A decode step launched before the engine asked for it (see GraphedCausalLM)."""

    lane: int  # the runner whose buffers hold its outputs
    size: int  # its bucket
    slots: tuple[int, ...]
    positions: tuple[int, ...]  # the position each row feeds
    inputs_from: int  # the lane whose `host_ids` hold the ids it fed
    done: Any  # CUDA event after its outputs (None off CUDA)


class GraphedCausalLM:
    """The model object with decode steps served by a DecodeGraphRunner (see module doc).

    Wiring (CUDA only): `loaded.model = GraphedCausalLM(loaded.model)` before the Engine is
    built; everything else is delegated to the wrapped model.

    Decode ahead (two runners, "lanes"): after a decode step, the step that would follow it
    if every row took its argmax is launched at once on a side stream, fed on the device, so
    the GPU works while the host samples, streams the token and builds the next step. When
    the next call asks for exactly that step (same slots and positions, and the ids it fed
    equal the ones the engine now feeds), its logits are already there. Otherwise it is
    waited for and dropped: it wrote one position past each row's tokens, which the next
    write there replaces (the KV cache's `lookahead` keeps resumes from relying on the ring
    entry it overwrote). A miss on the ids (the rows sample) stops decode-ahead for that set
    of slots. TOKENPIPE_NO_DECODE_AHEAD=1 turns it off.
    """

    def __init__(
        self,
        model: Any,
        *,
        use_graphs: bool | None = None,
        capture: bool = True,
        decode_ahead: bool | None = None,
    ):
        if isinstance(model, GraphedCausalLM):  # wrapping twice: one wrapper (one runner)
            model = model.inner
        self.inner = model
        self.runner: DecodeGraphRunner | None = None
        self._use_graphs = use_graphs
        self._capture = capture
        if decode_ahead is None:
            decode_ahead = os.environ.get("TOKENPIPE_NO_DECODE_AHEAD") != "1"
        self._decode_ahead = decode_ahead
        self._lanes: list[DecodeGraphRunner] = []
        self._ahead: _Ahead | None = None
        self._no_ahead_for: tuple[int, ...] | None = None
        self._side: Any = None  # the side stream (CUDA)
        self.ahead_hits = 0
        self.ahead_misses = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def make_kv_cache(self, num_slots: int, max_context: int, **kwargs: Any) -> Any:
        kv = self.inner.make_kv_cache(num_slots, max_context, **kwargs)
        lanes = 2 if self._decode_ahead else 1
        self._lanes = [
            DecodeGraphRunner(self.inner, kv, num_slots, use_graphs=self._use_graphs)
            for _ in range(lanes)
        ]
        self.runner = self._lanes[0]
        self._ahead, self._no_ahead_for = None, None
        if self._decode_ahead:
            kv.lookahead = 1
            if self.runner.device.type == "cuda":
                self._side = torch.cuda.Stream(self.runner.device)
        if self._capture:
            for lane in self._lanes:
                lane.capture(sample=False)
            self._warm_up_prefill(kv)
        return kv

    def _warm_up_prefill(self, kv: Any) -> None:
        """Compile the prefill kernels now, not in the first request: two tokens from scratch
        in slot 0, then two more over them (the cached-prefix and ring variants). The slot's
        KV is garbage afterwards, as it may be for any free slot."""
        if self.runner is None or self.runner.device.type != "cuda":
            return
        from worker.models.step import StepInput

        for cached in (0, 2):
            self.inner(StepInput.single([0, 0], 0, cached, device=self.runner.device), kv)
        torch.cuda.synchronize(self.runner.device)

    def __call__(self, step: Any, kv: Any) -> torch.Tensor:
        """Decode rows through the graph; prefill rows (a chunk riding along with the
        decoders) through the eager model, in a second forward of their own."""
        runner = self.runner
        if runner is None or kv is not runner.kv:
            return self.inner(step, kv)
        decode, other = split_decode_rows(step)
        if not decode or bucket_for(len(decode), runner.buckets) is None:
            self._drop_ahead()
            return self.inner(step, kv)
        if not other:
            return self._decode(step)
        decode_logits_ = self._decode(sub_step(step, decode))  # [len(decode), vocab]
        prefill_logits = self.inner(sub_step(step, other), kv)  # [len(other), vocab]
        out = torch.empty(
            (len(step.slots), decode_logits_.shape[1]),
            dtype=decode_logits_.dtype,
            device=decode_logits_.device,
        )
        device = out.device
        out[torch.tensor(decode, device=device)] = decode_logits_
        out[torch.tensor(other, device=device)] = prefill_logits
        return out

    # -- decode ahead ----------------------------------------------------------------------

    def _decode(self, step: Any) -> torch.Tensor:
        """[B, vocab] logits of a decode-only step: the step launched ahead when it matches,
        else a replay now; then the next step is launched ahead."""
        batch = len(step.slots)
        slots, positions = tuple(step.slots), tuple(step.cached_lens)
        ahead, self._ahead = self._ahead, None
        lane: int | None = None
        if ahead is not None:
            same_rows = ahead.slots == slots and ahead.positions == positions
            fed = self._lanes[ahead.inputs_from].host_ids[:batch].tolist() if same_rows else None
            hit = same_rows and fed == step.input_ids.tolist()
            self._wait(ahead)
            if hit:
                self.ahead_hits += 1
                lane, size = ahead.lane, ahead.size
                logits = self._lanes[lane]._last[0]  # type: ignore[index]
            else:
                self.ahead_misses += 1
                if same_rows:  # the rows do not take the argmax: they sample
                    self._no_ahead_for = slots
        if lane is None:
            lane = ahead.inputs_from if ahead is not None else 0  # a lane not in flight
            runner = self._lanes[lane]
            size = runner._load(step.input_ids, step.cached_lens, step.slots, None)
            logits, _ = runner._run(size, sample=False)
            if len(self._lanes) > 1:
                runner.copy_ids_to_host(size)
        self._launch_ahead(lane, size, slots, positions)
        return logits[:batch]

    def _launch_ahead(
        self, lane: int, size: int, slots: tuple[int, ...], positions: tuple[int, ...]
    ) -> None:
        if len(self._lanes) < 2 or slots == self._no_ahead_for:
            return
        if self._no_ahead_for is not None and slots != self._no_ahead_for:
            self._no_ahead_for = None  # a new set of rows: try again
        runner = self._lanes[lane]
        if max(positions) + 1 >= runner.kv.max_context:
            return  # the next position would not fit: never write past max_context
        nxt = 1 - lane
        done = None
        if self._side is not None:
            main = torch.cuda.current_stream(runner.device)
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                self._lanes[nxt].step_after(runner, size)
                self._lanes[nxt].copy_ids_to_host(size)
                done = torch.cuda.Event()
                done.record(self._side)
        else:  # CPU (tests): the same work, eagerly
            self._lanes[nxt].step_after(runner, size)
            self._lanes[nxt].copy_ids_to_host(size)
        self._ahead = _Ahead(nxt, size, slots, tuple(p + 1 for p in positions), lane, done)

    def _wait(self, ahead: _Ahead) -> None:
        if ahead.done is not None:
            torch.cuda.current_stream(self._lanes[0].device).wait_event(ahead.done)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._wait(self._ahead)
            self.ahead_misses += 1
            self._ahead = None
