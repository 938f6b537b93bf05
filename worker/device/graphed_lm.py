"""The model object the engine uses on CUDA: decode steps from CUDA graphs, decode ahead.

`GraphedCausalLM(model)` is a drop-in for the model object. `make_kv_cache` also builds the
graph runners (worker/device/decode_graphs.py, worker/device/prefill_graphs.py);
`model(step, kv)` replays a
graph for the sequences that decode one token and for a short prefill of one sequence (a warm
resume's new turn, a short prompt), and runs the eager model for the rest (long prefill
chunks; every row when the decoders exceed the largest bucket). See the class for decode
ahead.

A hybrid cache (qwen3_5_moe: recurrent DeltaNet state next to the KV, ``begin_step`` /
``end_step`` around each forward) gets decode ahead for batches of up to ``HYBRID_AHEAD_ROWS``
rows (TOKENPIPE_HYBRID_AHEAD_ROWS; 0: none): a step launched ahead advances its slots'
recurrent and conv states in place, so it is launched after the step's ``end_step`` (whose
snapshot copies then precede it) behind a backup of those states (``back_up_ahead``, on the
side stream); a miss waits for it and puts the backup back (``restore_ahead``), a hit hands
the advanced state to the step's bookkeeping (``keep_ahead``, before ``begin_step``). The cache
settles a slot through ``_drop_ahead`` before anything else reads or replaces its state
(worker/layers/hybrid_cache.py). The backup is 64 MB a row at the 35B-A3B shape, 54 us of
copying on an H200 (and as much to restore), against the host's ~0.5 ms turn it hides: int4-
experts batch 1 went from 302 to 357 tok/s (BENCHMARKS.md). At bigger batches the copies grow
with the rows while the host's share of a step shrinks, so they run without it. Steps with a
prefill riding along launch nothing ahead. Its short prefills replay prefill graphs whose
DeltaNet layers run the in-place Triton recurrence over the rows (padding rows and the
captures' warm-up rows advance no state; a snapshot inside the step goes in as device data):
the eager 64-token prefill was bound by the host (~150 ms of launches for ~21 ms of GPU work).
Each replay is framed by the cache's ``begin_step`` / ``end_step`` as the eager forward is.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.device.compile_ahead import CompilePool, compile_ahead
from worker.device.decode_graphs import DecodeGraphRunner, bucket_for, split_decode_rows, sub_step
from worker.device.kernels.attention import use_triton
from worker.device.kernels.batched_sampling import RowSampling
from worker.device.prefill_graphs import PrefillGraphRunner

# a hybrid cache's decode ahead: batches of at most this many rows (module doc)
HYBRID_AHEAD_ROWS = 4


@dataclass
class _Ahead:
    """A decode step launched before the engine asked for it (see GraphedCausalLM)."""

    lane: int  # the runner whose buffers hold its outputs
    size: int  # its bucket
    slots: tuple[int, ...]
    positions: tuple[int, ...]  # the position each row feeds
    inputs_from: int  # the lane whose `host_ids` hold the ids it fed
    done: Any  # CUDA event after its outputs (None off CUDA)


# what a lane's last step drew with: each row's settings and draw number (None: argmax only)
_Draws = tuple[tuple[RowSampling, ...], tuple[int, ...]]


class GraphedCausalLM:
    """The model object with decode steps served by a DecodeGraphRunner (see module doc).

    Wiring (CUDA only): `loaded.model = GraphedCausalLM(loaded.model)` before the Engine is
    built; everything else is delegated to the wrapped model.

    Decode ahead (two runners, "lanes"): after a decode step, the step that would follow it
    is launched at once on a side stream, fed on the device, so the GPU works while the host
    samples, streams the token and builds the next step. Each row feeds the token its
    request will take: the argmax, or for a sampling row the draw the graph made with the
    row's settings and next draw number (sampling is counter-based, so that draw is the one
    `worker.engine.sampling.sample` makes; the logits carry `presampled`, which hands it the
    graph's ids). A slot's settings are learnt from its last `presampled` call. When the next
    call asks for exactly that step (same slots and positions, and the ids it fed equal the
    ones the engine now feeds), its logits are already there. Otherwise it is waited for and
    dropped: it wrote one position past each row's tokens, which the next write there
    replaces (the KV cache's `lookahead` keeps resumes from relying on the ring entry it
    overwrote). Two misses in a row on the ids stop decode-ahead for that set of slots.
    TOKENPIPE_NO_DECODE_AHEAD=1 turns it off.
    """

    def __init__(
        self,
        model: Any,
        *,
        use_graphs: bool | None = None,
        capture: bool = True,
        decode_ahead: bool | None = None,
        prefill_graphs: bool | None = None,
        compiles: CompilePool | None = None,
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
        if prefill_graphs is None:
            prefill_graphs = os.environ.get("TOKENPIPE_NO_PREFILL_GRAPHS") != "1"
        self._prefill_graphs = prefill_graphs
        self._compiles = compiles  # the start-up's Triton compiles, before the first capture
        self.prefill: PrefillGraphRunner | None = None
        self._lanes: list[DecodeGraphRunner] = []
        self._ahead: _Ahead | None = None
        self._no_ahead_for: tuple[int, ...] | None = None
        self._side: Any = None  # the side stream (CUDA)
        self._lane_draws: list[_Draws | None] = []
        # slot -> (settings, draw number, position) of the draw its next decode step makes
        self._next_draw: dict[int, tuple[RowSampling, int, int]] = {}
        self._misses_in_row = 0
        self.ahead_hits = 0
        self.ahead_misses = 0

    # the engine's prefill chunk, for the compile trace's long-prefill stage (0: none), and
    # its prefix cache's block (0: no prefix cache), whose ends a hybrid prefill keeps states at
    trace_chunk = 0
    trace_block = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def make_kv_cache(self, num_slots: int, max_context: int, **kwargs: Any) -> Any:
        kv = self.inner.make_kv_cache(num_slots, max_context, **kwargs)
        ahead_rows = num_slots  # the rows a step launched ahead may have
        if _is_hybrid(kv):  # see the module doc
            ahead_rows = min(num_slots, _hybrid_ahead_rows())
            self._decode_ahead = self._decode_ahead and ahead_rows > 0
            kv.reserve_ahead(ahead_rows if self._decode_ahead else 0)
            kv.settle = self._drop_ahead
            # its short prefills run the Triton recurrence (worker/layers/deltanet.py)
            probe = torch.empty(0, device=self.inner.device)
            self._prefill_graphs = self._prefill_graphs and use_triton(probe)
        self._lanes = [DecodeGraphRunner(self.inner, kv, num_slots, use_graphs=self._use_graphs)]
        if self._decode_ahead:  # the second lane: only the buckets a step ahead may have
            lane = DecodeGraphRunner(self.inner, kv, ahead_rows, use_graphs=self._use_graphs)
            self._lanes.append(lane)
        lanes = len(self._lanes)
        self.runner = self._lanes[0]
        self._lane_draws = [None] * lanes
        self._next_draw = {}
        self.prefill = None
        if self._prefill_graphs:
            self.prefill = PrefillGraphRunner(self.inner, kv, use_graphs=self._use_graphs)
        self._ahead, self._no_ahead_for = None, None
        if self._decode_ahead:
            kv.lookahead = 1
            if self.runner.device.type == "cuda":
                self._side = torch.cuda.Stream(self.runner.device)
        if self._capture:
            compile_ahead(self._compiles, self._warm_up_stages(kv), "CUDA graphs")
            self._compiles = None  # the worker closes the pool once it is ready
            for lane in self._lanes:
                lane.capture(sample=False)
                lane.capture(sample=True)
            if self.prefill is not None:
                self.prefill.capture()
            self._warm_up_prefill(kv)
        return kv

    def _warm_up_stages(self, kv: Any) -> list[Callable[[], object]]:
        """The kernels the captures and the prefill warm-up launch, as eager runs in capture
        order, a bucket each: the decode step that samples (the argmax one is the same
        forward without the sampler), the short prefills, the eager prefill."""
        decode, prefill = self.runner, self.prefill
        assert decode is not None
        stages: list[Callable[[], object]] = [
            functools.partial(decode.warm_up, True, [size])
            for size in sorted(decode.buckets, reverse=True)
        ]
        if prefill is not None:
            stages += [
                functools.partial(prefill.warm_up, [size])
                for size in sorted(prefill.buckets, reverse=True)
            ]
        stages.append(functools.partial(self._warm_up_prefill, kv))
        stages.append(functools.partial(self._trace_long_prefill, kv))
        return stages

    def _warm_up_prefill(self, kv: Any) -> None:
        """Compile the prefill kernels now, not in the first request: two tokens from scratch
        in slot 0, then two more over them (the cached-prefix and ring variants). The slot's
        KV is garbage afterwards, as it may be for any free slot."""
        if self.runner is None or self.runner.device.type != "cuda":
            return
        from worker.models.step import StepInput

        for cached in (0, 2):
            self.inner(StepInput.single([0, 0], 0, cached, device=self.runner.device), kv)
        if _is_hybrid(kv) and kv.max_context >= 132:  # the kernels of chunks past 64 tokens
            self.inner(StepInput.single([0] * 128, 0, 4, device=self.runner.device), kv)
        torch.cuda.synchronize(self.runner.device)

    def _trace_long_prefill(self, kv: Any) -> None:
        """For the compile trace only: the chunks of the engine's prefill warm-up
        (`Engine.warm_up_prefill`, after the captures: two chunks and an odd tail, one slot),
        so their kernel variants compile on the pool beside the others, not one after another
        in that warm-up. Needs `trace_chunk`, the engine's prefill chunk (worker/main.py). With
        `trace_block` (a prefix cache) a hybrid model's steps also keep a state at a block end
        inside them, as the prefix cache has a prompt's steps do (its last block end before the
        final token: inside the warm-up's tail; the first block end: a short prompt's only
        step), and fla's state pass then runs with other arguments (session 35: the last
        variant the warm-up compiled itself). Nothing is written: the pool does not exist yet."""
        chunk = self.trace_chunk
        assert self.runner is not None
        if chunk <= 0:
            return
        from worker.engine.engine import warm_up_tokens
        from worker.layers.hybrid_cache import StateCapture
        from worker.models.step import StepInput

        total = warm_up_tokens(chunk, kv.max_context)
        block = self.trace_block if _is_hybrid(kv) else 0
        if block > 0:  # row -1: no pool row; states at a step's end would go to the pool
            ends = {block, (total - 1) // block * block}
            inside = sorted(t for t in ends if 0 < t < total and t % chunk)
            kv.set_state_captures([StateCapture(0, t, -1) for t in inside])
        try:
            done = 0
            while done < total:
                n = min(chunk, total - done)
                self.inner(StepInput.single([0] * n, 0, done, device=self.runner.device), kv)
                done += n
        finally:
            if block > 0:
                kv.set_state_captures([])

    def __call__(self, step: Any, kv: Any) -> torch.Tensor:
        """Decode rows through the graph; prefill rows (a chunk riding along with the
        decoders) in a second forward of their own: a prefill graph when it fits, else the
        eager model."""
        runner = self.runner
        if runner is None or kv is not runner.kv:
            return self.inner(step, kv)
        decode, other = split_decode_rows(step)
        if not decode or bucket_for(len(decode), runner.buckets) is None:
            self._drop_ahead()
            return self._prefill(step, kv)
        if not other:
            return self._framed_decode(step, kv)
        # [len(decode), vocab]; a hybrid cache's prefill must not run beside a step ahead
        decode_logits_ = self._framed_decode(sub_step(step, decode), kv, ahead=not _is_hybrid(kv))
        prefill_logits = self._prefill(sub_step(step, other), kv)  # [len(other), vocab]
        out = torch.empty(
            (len(step.slots), decode_logits_.shape[1]),
            dtype=decode_logits_.dtype,
            device=decode_logits_.device,
        )
        device = out.device
        out[torch.tensor(decode, device=device)] = decode_logits_
        out[torch.tensor(other, device=device)] = prefill_logits
        return out

    def graph_stats(self) -> dict[str, Any]:
        """The worker's `stats` fields of this path: decode steps launched ahead and used or
        dropped, and short prefills replayed from a graph."""
        out: dict[str, Any] = {
            "decode_ahead": {"hits": self.ahead_hits, "misses": self.ahead_misses}
        }
        if self.prefill is not None:
            out["prefill_graph_replays"] = self.prefill.replays
        return out

    def reset_stats(self) -> None:
        """`graph_stats`' counters back to 0 (after the start-up's prefill warm-up)."""
        self.ahead_hits = self.ahead_misses = 0
        if self.prefill is not None:
            self.prefill.replays = 0

    def _prefill(self, step: Any, kv: Any) -> torch.Tensor:
        if self.prefill is not None and self.prefill.fits(step):
            if self._ahead is not None:
                # two graphs must not run at once: every graph was captured on torch's one
                # capture stream, so their cuBLAS kernels share one workspace (concurrent
                # replays hung the GPU). The guess stays valid; only the overlap is lost.
                self._wait(self._ahead)
            if not _is_hybrid(kv):
                return self.prefill.logits(step)
            kv.begin_step(step, graphed=True)  # the snapshot bookkeeping, as the eager forward's
            slot, cached = step.slots[0], step.cached_lens[0]
            logits = self.prefill.logits(step, kv.step_snapshot(slot, cached))
            kv.end_step()
            return logits
        return self.inner(step, kv)

    def _framed_decode(self, step: Any, kv: Any, ahead: bool = True) -> torch.Tensor:
        """`_decode`, inside the hybrid cache's step bookkeeping when it has one: the step
        launched ahead is settled before `begin_step` (a hit's state is already advanced), the
        next one launched after `end_step` (its snapshot copies come first)."""
        if not _is_hybrid(kv):
            return self._decode(step, self._take_ahead(step), ahead)
        lane = self._take_ahead(step, kv)
        kv.begin_step(step)
        logits = self._decode(step, lane, ahead=False)
        kv.end_step()
        if ahead:
            self._then_ahead(logits, step)
        return logits

    # -- decode ahead ----------------------------------------------------------------------

    def _take_ahead(self, step: Any, kv: Any = None) -> int | None:
        """The lane holding `step`'s logits when the step launched ahead is exactly `step`
        (a hit), else None (dropped: waited for; a hybrid cache's states put back). `kv`: the
        hybrid cache, whose step must not want a slot's state from before the step."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        batch = len(step.slots)
        slots, positions = tuple(step.slots), tuple(step.cached_lens)
        same_rows = ahead.slots == slots and ahead.positions == positions
        fed = self._lanes[ahead.inputs_from].host_ids[:batch].tolist() if same_rows else None
        hit = same_rows and fed == step.input_ids.tolist()
        self._wait(ahead)
        if hit and (kv is None or not kv.reads_state_before(step)):
            self.ahead_hits += 1
            self._misses_in_row = 0
            if kv is not None:
                kv.keep_ahead()
            return ahead.lane
        self.ahead_misses += 1
        self._restore(ahead)
        if same_rows and not hit:  # the rows did not take the ids guessed
            self._misses_in_row += 1
            if self._misses_in_row >= 2:
                self._no_ahead_for = slots
        return None

    def _decode(self, step: Any, lane: int | None, ahead: bool = True) -> torch.Tensor:
        """[B, vocab] logits of a decode-only step: from `lane` (the step launched ahead, a
        hit) or a replay now; then (`ahead`) the next step is launched ahead."""
        batch = len(step.slots)
        slots, positions = tuple(step.slots), tuple(step.cached_lens)
        if lane is not None:
            logits = self._lanes[lane].last_logits[:batch]
        else:
            lane = 0  # every lane is free: the step launched ahead, if any, was waited for
            size = bucket_for(batch, self._lanes[0].buckets)
            assert size is not None  # __call__ sends bigger batches to the eager model
            draws = self._known_draws(slots, positions)
            rows, counters = draws if draws is not None else (None, None)
            logits = self._lanes[lane].logits(step, rows, counters)
            self._lane_draws[lane] = draws if self._lanes[lane].last_sampled else None
            if len(self._lanes) > 1:
                self._lanes[lane].copy_ids_to_host(size)
        logits.presampled = functools.partial(self._presampled, lane, slots, positions)
        logits.lane = lane
        if ahead:
            self._then_ahead(logits, step)
        return logits

    def _then_ahead(self, logits: torch.Tensor, step: Any) -> None:
        """Launch the step after `logits`' (a decode step's) ahead, or, for rows that take
        masked ids, hand the launch to the sampler (it feeds the ids once they are known).
        Nothing when the engine knows the next step's rows differ (it would be dropped)."""
        if not step.same_rows_next:
            return
        lane: int = logits.lane  # type: ignore[attr-defined]
        size = bucket_for(len(step.slots), self._lanes[0].buckets)
        assert size is not None
        slots, positions = tuple(step.slots), tuple(step.cached_lens)
        if step.grammar_masked:
            logits.launch_ahead = functools.partial(  # type: ignore[attr-defined]
                self._launch_ahead, lane, size, slots, positions
            )
        else:
            self._launch_ahead(lane, size, slots, positions)

    def _known_draws(self, slots: Sequence[int], positions: Sequence[int]) -> _Draws | None:
        """Each row's settings and draw number at this step, as learnt from `presampled`
        (None when a row's are unknown: the step takes the argmax)."""
        rows, counters = [], []
        for slot, position in zip(slots, positions, strict=True):
            known = self._next_draw.get(slot)
            if known is None or known[2] != position:
                return None
            rows.append(known[0])
            counters.append(known[1])
        return tuple(rows), tuple(counters)

    def _presampled(
        self,
        lane: int,
        slots: tuple[int, ...],
        positions: tuple[int, ...],
        params: Sequence[Any],
        streams: Sequence[Any],
    ) -> torch.Tensor | None:
        """The ids `lane`'s step drew when it drew with exactly these rows' settings and draw
        numbers (`worker.engine.sampling.sample` asks), else None. Learns each slot's settings
        for its next step either way."""
        from worker.engine.sampling import row_settings

        rows = tuple(row_settings(p, s) for p, s in zip(params, streams, strict=True))
        counters = tuple(s.draws if s is not None else 0 for s in streams)
        for slot, position, row, counter in zip(slots, positions, rows, counters, strict=True):
            self._next_draw[slot] = (row, counter + 1, position + 1)
        if self._lane_draws[lane] != (rows, counters):
            return None
        return self._lanes[lane].last_ids[: len(slots)]

    def _launch_ahead(
        self,
        lane: int,
        size: int,
        slots: tuple[int, ...],
        positions: tuple[int, ...],
        ids: torch.Tensor | None = None,
    ) -> None:
        """Launch the step after `lane`'s on the side stream, fed with its graph's ids, or
        with `ids` [B] (device, current stream: the ids sampled after a grammar mask)."""
        if len(self._lanes) < 2 or slots == self._no_ahead_for:
            return
        self._no_ahead_for = None  # a new set of rows: try again
        runner, nxt = self._lanes[lane], 1 - lane
        if max(positions) + 1 >= runner.kv.max_context:
            return  # the next position would not fit: never write past max_context
        if size not in self._lanes[nxt].buckets:
            return  # more rows than a step ahead may have (a hybrid cache's backup)
        hybrid = _is_hybrid(runner.kv)
        draws = self._lane_draws[lane]
        if draws is not None:
            draws = (draws[0], tuple(c + 1 for c in draws[1]))
        self._lane_draws[nxt] = draws
        if ids is not None:  # what the hit check reads as fed (same stream as `ids`)
            runner.host_ids[: ids.shape[0]].copy_(ids, non_blocking=True)
        done = None
        if self._side is not None:
            main = torch.cuda.current_stream(runner.device)
            self._side.wait_stream(main)
            if ids is not None:
                ids.record_stream(self._side)  # read there after the caller drops it
            with torch.cuda.stream(self._side):
                if hybrid:  # the states this step advances, restored on a miss
                    runner.kv.back_up_ahead(slots)
                self._lanes[nxt].step_after(runner, size, ids)
                self._lanes[nxt].copy_ids_to_host(size)
                done = torch.cuda.Event()
                done.record(self._side)
        else:  # CPU (tests): the same work, eagerly
            if hybrid:
                runner.kv.back_up_ahead(slots)
            self._lanes[nxt].step_after(runner, size, ids)
            self._lanes[nxt].copy_ids_to_host(size)
        self._ahead = _Ahead(nxt, size, slots, tuple(p + 1 for p in positions), lane, done)

    def _wait(self, ahead: _Ahead) -> None:
        if ahead.done is not None:
            torch.cuda.current_stream(self._lanes[0].device).wait_event(ahead.done)

    def _restore(self, ahead: _Ahead) -> None:
        """After a dropped step launched ahead (waited for): a hybrid cache's states back."""
        kv = self._lanes[ahead.lane].kv
        if _is_hybrid(kv) and kv.ahead_slots:
            kv.restore_ahead()

    def _drop_ahead(self) -> None:
        """Settle the step launched ahead, if any: wait for it and drop it (the engine before
        it copies or replaces a slot's cache; a hybrid cache before it reads a slot's state)."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            self._wait(ahead)
            self.ahead_misses += 1
            self._restore(ahead)


def _hybrid_ahead_rows() -> int:
    """TOKENPIPE_HYBRID_AHEAD_ROWS (rows of a hybrid cache's step ahead; 0: none), else the
    default."""
    value = os.environ.get("TOKENPIPE_HYBRID_AHEAD_ROWS", "").strip()
    if not value:
        return HYBRID_AHEAD_ROWS
    if not value.isdigit():
        raise ValueError(f"TOKENPIPE_HYBRID_AHEAD_ROWS must be a row count >= 0, got {value!r}")
    return int(value)


def _is_hybrid(kv: Any) -> bool:
    """Whether the cache keeps per-step state bookkeeping (worker.layers.hybrid_cache)."""
    return callable(getattr(kv, "begin_step", None))
