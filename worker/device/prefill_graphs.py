"""Short prefills replayed from CUDA graphs: the time to first token of a warm resume.

A warm resume prefills a few dozen new tokens over a long resident prefix. Run eagerly on
the 31B shape, that step launches ~900 kernels, and the host needs 40-70 ms to launch them
while the GPU needs ~20 ms: the step is bound by the host. So a step that prefills one
sequence by at most `PREFILL_BUCKETS[-1]` tokens is captured once per bucket, its tokens
padded to the bucket, and replayed.

Static inputs, filled by one host-to-device copy per call:

- the ids and positions of the N rows;
- each row's slot, with -1 on padding rows, so a padding row stores nothing and never
  touches a ring;
- `meta` = (slot, cached, n).

Attention is `worker.device.kernels.attention.prefill_attention_slot`. It reads the slot's previous
keys in place and its lengths from `meta`, then the new keys are stored with the decode
path's `store_kv`. The logits are those of the last real row.

`PrefillGraphRunner(model, kv).logits(step)` serves a StepInput that `fits` (one sequence,
n <= the largest bucket and <= every ring, the bucket inside the context). `use_graphs=False`
runs the same body without capture: the CPU tests of this path. TOKENPIPE_NO_PREFILL_GRAPHS=1
turns it off (worker/device/graphed_lm.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from worker.device.decode_graphs import bucket_for, capture_stream, rows_logits
from worker.device.kernels.attention import prefill_attention_slot, store_kv
from worker.layers.kv import as_cached

PREFILL_BUCKETS = (16, 32, 64, 128, 256)


class FusedPrefillPlan:
    """Tensor-only attention plan of one sequence's padded prefill (see the module doc)."""

    def __init__(
        self,
        row_slots: torch.Tensor,
        positions: torch.Tensor,
        meta: torch.Tensor,
        state_meta: torch.Tensor | None = None,
    ):
        self.row_slots = row_slots  # [N] int64: the slot, or -1 on padding rows
        self.positions = positions  # [N] int64
        self.meta = meta  # [3] int64: slot, cached, n
        # [5] int64: slot, cached, n, then a recurrent state's snapshot inside the step: its
        # row count (0: none) and entry (worker.device.kernels.deltanet_decode's short prefill)
        self.state_meta = state_meta

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, scale: float
    ) -> torch.Tensor:
        """q [N, H, D]; k, v [N, KVH, D]; cache: a worker.layers.kv.LayerCache. Attention
        reads the cache as it was before the step, so the store comes after it (a ring may
        overwrite entries that the first new tokens still see)."""
        # the new keys as the cache holds them (an fp8 cache: worker.layers.kv.as_cached)
        k, v = as_cached(k.contiguous(), cache.k), as_cached(v.contiguous(), cache.v)
        out = prefill_attention_slot(
            q.contiguous(), k, v, cache.k, cache.v, self.meta,
            sm_scale=float(scale), window=cache.window or 0,
        )  # fmt: skip
        store_kv(cache.k, cache.v, k, v, self.row_slots, self.positions)
        return out


class PrefillGraphRunner:
    """Static buffers and one captured prefill graph per bucket (see the module doc)."""

    def __init__(
        self,
        model: Any,
        kv: Any,
        *,
        use_graphs: bool | None = None,
        buckets: Sequence[int] = PREFILL_BUCKETS,
    ) -> None:
        self.model, self.kv = model, kv
        self.device = model.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        # new tokens per step this path takes: every ring keeps all of them (no two rows of
        # a step share a ring entry)
        rings = [size for size, _ in kv.rings]
        self.max_new = min([max(buckets), *rings])
        self.buckets = tuple(sorted(buckets))
        size = self.buckets[-1]
        pin = self.device.type == "cuda"
        # [ids | positions | row slots] of `size` rows, then meta (slot, cached, n) and a
        # hybrid cache's snapshot inside the step (rows, entry)
        self._host = torch.zeros(3 * size + 5, dtype=torch.int64, pin_memory=pin)
        self._dev = torch.zeros(3 * size + 5, dtype=torch.int64, device=self.device)
        # a hybrid cache (recurrent state): padding passes run no row (n = 0), so a capture
        # never advances a slot's state
        self._pad_n = 0 if callable(getattr(kv, "begin_step", None)) else 1
        self._copied: Any = None  # CUDA event after the last host-to-device copy
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool: Any = None
        self.replays = 0

    def _views(self, size: int) -> tuple[torch.Tensor, ...]:
        top = self.buckets[-1]
        d = self._dev
        return (
            d[:size], d[top : top + size], d[2 * top : 2 * top + size], d[3 * top : 3 * top + 3],
            d[3 * top :],
        )  # fmt: skip

    def _body(self, size: int) -> torch.Tensor:
        ids, positions, row_slots, meta, state_meta = self._views(size)
        plan = FusedPrefillPlan(row_slots, positions, meta, state_meta)
        last = (meta[2:3] - 1).clamp(0, size - 1)  # [1]: the last real row
        return rows_logits(self.model, self.kv, ids, positions, plan, last)

    # -- capture ---------------------------------------------------------------------------

    def _pad_inputs(self) -> None:
        """Every row padding (nothing is stored), slot 0 read, n = 1 (the logits row exists)."""
        top = self.buckets[-1]
        self._dev.zero_()
        self._dev[2 * top : 3 * top].fill_(-1)
        self._dev[3 * top + 2] = self._pad_n

    def warm_up(self, sizes: Sequence[int] | None = None) -> None:
        """The step of each of `sizes` (default: every bucket) once, eagerly, on padding rows:
        the kernels the capture launches (worker/device/graphed_lm.py compiles them ahead)."""
        self._pad_inputs()
        with torch.inference_mode():
            for size in sorted(sizes or self.buckets, reverse=True):
                self._body(size)

    def capture(self, sizes: Sequence[int] | None = None) -> None:
        """Capture the graphs of `sizes` (default: every bucket), largest first so the
        smaller ones reuse its memory pool, each after a warm-up run on padding rows."""
        if not self.use_graphs:
            return
        self._pad_inputs()
        for size in sorted(sizes or self.buckets, reverse=True):
            if size in self._graphs:
                continue
            stream = capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode():
                self._body(size)  # Triton compiles, lazy tables, cuBLAS handles
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
                out = self._body(size)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[size] = graph
            self._outputs[size] = out
        torch.cuda.synchronize(self.device)

    # -- one step --------------------------------------------------------------------------

    def fits(self, step: Any) -> bool:
        """Whether `step` is one sequence this path serves (pure)."""
        if len(step.slots) != 1:
            return False
        n, cached = step.new_lens[0], step.cached_lens[0]
        size = bucket_for(n, self.buckets)
        return n <= self.max_new and size is not None and cached + size <= self.kv.max_context

    def logits(self, step: Any, snapshot: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """[1, vocab] float32 logits of the last new token of a StepInput that `fits` (a
        static buffer: valid until the next call). ``snapshot``: (rows, entry) of a hybrid
        cache's snapshot inside the step (rows 0: none)."""
        n, cached, slot = step.new_lens[0], step.cached_lens[0], step.slots[0]
        size = bucket_for(n, self.buckets)
        assert size is not None  # the caller checked `fits`
        top = self.buckets[-1]
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the host buffer
        host = self._host
        host[top : top + size] = torch.arange(cached, cached + size)
        host[2 * top : 2 * top + size] = -1
        host[2 * top : 2 * top + n] = slot
        host[3 * top :] = torch.tensor([slot, cached, n, *snapshot])
        ids = step.input_ids
        if not ids.is_cuda:
            host[:n] = ids
        self._dev.copy_(host, non_blocking=True)
        if ids.is_cuda:
            self._dev[:n].copy_(ids)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.replays += 1
        if not self.use_graphs:
            with torch.inference_mode():
                return self._body(size)
        if size not in self._graphs:
            print(f"prefill_graphs: capturing bucket {size}", file=sys.stderr)
            self.capture([size])
        self._graphs[size].replay()
        return self._outputs[size]
