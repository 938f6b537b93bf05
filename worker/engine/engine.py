"""The engine: weights, the KV pool, sessions, and the batched token-step loop. No I/O.

`submit(request)` takes a decoded request and returns the events it answers at once
(ping, cancel errors, ...); everything else is queued. `step()` starts what the
scheduler admits and runs at most one forward pass (every decoding sequence plus at most
one prefill chunk), returning the events produced. `main.py` feeds and drains it.

Token lifecycle of a generate: the prompt is prefilled in chunks; the forward that feeds
the last prompt token yields logits, a token is sampled and streamed (unless it is an
EOS id), and becomes `pending`; the next decode step feeds it. So the resident ids never
hold the last sampled token (it is fed only if the request goes on), and a turn that ends
by length leaves `prompt + generated[:-1]` resident.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol import (
    CancelRequest,
    ClosedEvent,
    CloseRequest,
    DetokenizeRequest,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    GenerateRequest,
    IdsSegment,
    InfoEvent,
    InfoRequest,
    OpenedEvent,
    OpenRequest,
    PingRequest,
    PongEvent,
    ReadyEvent,
    Request,
    RequestId,
    ResetEvent,
    ResetRequest,
    ShutdownRequest,
    StatsEvent,
    StatsRequest,
    TextEvent,
    TokenEvent,
    TokenizeRequest,
    TokensEvent,
)
from protocol.errors import NO_NAMED_SESSIONS
from worker.engine.host_pool import HostBuffer, HostPool, lay_out
from worker.engine.prefix_cache import DEFAULT_BLOCK, PrefixCache, block_keys
from worker.engine.prompt import PromptError, build_prompt, chat_template_for
from worker.engine.resume import NEW, TRUNCATED, ResumePlan, plan_resume
from worker.engine.sampling import (
    NoiseStream,
    RowLogprobs,
    SamplingParams,
    make_generator,
    sample_step,
)
from worker.engine.scheduler import QueuedItem, RunningItem, plan_admission, plan_step
from worker.engine.session import Session, SessionPool
from worker.engine.session_store import SessionStore, model_fingerprint
from worker.engine.structured import StructuredRows
from worker.engine.text import TextStream
from worker.engine.tiers import SessionTiers
from worker.layers.slot_state import SlotState
from worker.models.step import StepInput

SMALL_STEP_TOKENS = 64  # CPU steps of at most this many tokens run torch ops on one thread


def warm_up_tokens(chunk: int, max_context: int) -> int:
    """The prompt length of `Engine.warm_up_prefill`: two chunks and an odd tail of 3/4 of
    one, capped by the context (the compile trace runs the same chunks:
    ``GraphedCausalLM._trace_long_prefill``)."""
    return min(2 * chunk + (3 * chunk // 4 | 1), max_context - 3)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, validated once."""

    max_sessions: int = 8
    max_context: int = 4096
    prefill_chunk: int = 512
    warm_resume: bool = True
    prefix_ids: tuple[int, ...] | None = None  # None: the tokenizer's own
    max_resident: int | None = None  # device slots; None: max_sessions (no tiers)
    host_cache_bytes: int = 4 << 30  # idle sessions' caches in host memory
    session_dir: str | None = None  # idle sessions on disk, kept across restarts
    prefix_cache_bytes: int = 0  # shared prompt blocks (0: off)
    prefix_block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_context", "prefill_chunk", "prefix_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_resident is not None and not 1 <= self.max_resident <= self.max_sessions:
            raise ValueError(
                f"max_resident must be in [1, max_sessions={self.max_sessions}], "
                f"got {self.max_resident}"
            )
        if self.host_cache_bytes < 0 or self.prefix_cache_bytes < 0:
            raise ValueError("host_cache_bytes and prefix_cache_bytes must be >= 0")

    @property
    def resident(self) -> int:
        return self.max_sessions if self.max_resident is None else self.max_resident


@dataclass
class _Queued:
    key: int
    request: Request | None
    deferred_error: ErrorEvent | None = None  # a bad id-less line, answered in order
    t_arrival: float = field(default_factory=time.perf_counter)


@dataclass
class _Active:
    """A generate in flight. `prompt_ids[fed:]` is what prefill still has to feed."""

    key: int
    request: GenerateRequest
    session: Session
    prompt_ids: list[int]
    fed: int  # index into prompt_ids of the next prompt token to feed
    plan: ResumePlan
    reused: int  # prompt tokens not prefilled: the session's kept ones and shared blocks
    block_keys: list[bytes]  # the prompt's full blocks (worker/engine/prefix_cache.py)
    next_block: int  # the first block not yet offered to the prefix cache
    state_points: tuple[int, ...]  # block ends where a hybrid cache keeps a state
    max_new: int
    params: SamplingParams
    generator: NoiseStream | None  # its draws (None: greedy)
    eos_ids: frozenset[int]
    text: TextStream
    t_arrival: float  # when the request line was read (total_ms counts from here)
    t_start: float  # when it was admitted (prefill_ms counts from here)
    t_first: float | None = None
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # sampled, streamed, not yet fed
    unreported_ids: list[int] = field(default_factory=list)  # ids behind held-back text
    cancelled: bool = False

    @property
    def prefill_remaining(self) -> int:
        return len(self.prompt_ids) - self.fed


class Engine:
    """One model, one device, many sessions. Single-threaded: call from one thread."""

    def __init__(
        self,
        loaded: Any,
        config: EngineConfig,
        device: torch.device | str,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.meta: dict[str, Any] = dict(getattr(loaded, "meta", None) or {})
        self._formats: dict[str, dict[str, int]] | None = None  # info["weights"], on demand
        self.config = config
        self.device = torch.device(device)
        # a CPU worker process: the kernels split matmuls over the threads the worker set
        # (worker/main.py) while a decode step's torch ops run on one (_torch_threads_for)
        self._cpu_threads = 0
        if self.device.type == "cpu":
            from worker.device import cpu_gemv

            self._cpu_threads = cpu_gemv.configured_kernel_threads()
        prepare = getattr(self.model, "prepare_for_cpu", None)
        if self.device.type == "cpu" and callable(prepare):
            prepare()  # decode-friendly weight layout (worker.device.cpu_gemv); else a no-op
        self.log = log or _stderr_log
        early_lines: list[str] = []  # its log, kept for when the engine keeps the store
        self.pool = SessionPool(config.max_sessions, config.resident)
        self.host_pool: HostPool | None = None  # the tiers' pinned buffers, made once
        early_store = self._early_store(config, early_lines.append)
        self.kv = self.model.make_kv_cache(config.resident, config.max_context)
        self.tiers: SessionTiers | None = None
        if hasattr(self.kv, "export_slot"):
            store = None
            if self.host_pool is None:
                self.host_pool = self._make_host_pool(self.kv)
            if config.session_dir is not None:
                fingerprint = model_fingerprint(self.model, self.tokenizer, self.kv.geometry())
                if early_store is not None and early_store.fingerprint == fingerprint:
                    store, early_store.log = early_store, self.log
                    for line in early_lines:  # what it logged meanwhile
                        self.log(line)
                else:
                    if early_store is not None:
                        early_store.close()
                    store = SessionStore(
                        config.session_dir, fingerprint, self.log, self._prefetch_buffer
                    )
            self.tiers = SessionTiers(config.host_cache_bytes, store, self.host_pool)
        elif config.session_dir is not None:
            raise ValueError("--session-dir: this model's cache cannot be saved")
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache_bytes > 0 and hasattr(self.kv, "make_pool"):
            self.prefix_cache = PrefixCache(self.kv, config.prefix_cache_bytes, config.prefix_block)
        self.prefill_chunk = config.prefill_chunk
        self._clock = itertools.count(1)
        self._unsaved: set[str] = set()  # named sessions used since --session-dir saved them
        self.structured = StructuredRows(self.tokenizer)  # grammars and logprobs per request
        self.prefix_ids = list(
            config.prefix_ids if config.prefix_ids is not None else self.tokenizer.prefix_ids
        )
        self.chat_template = chat_template_for(
            self.tokenizer, getattr(self.model_config, "architecture", None)
        )
        self.shutting_down = False
        self._keys = itertools.count()
        self._queue: list[_Queued] = []
        self._active: list[_Active] = []  # arrival order
        self._steps = 0
        self._generated_tokens = 0
        self.restored_names = self._restore_sessions()  # open at start from --session-dir
        self.restored_sessions = len(self.restored_names)

    # ------------------------------------------------------------------ public surface

    def ready_event(self) -> ReadyEvent:
        return ReadyEvent(
            max_sessions=self.config.max_sessions,
            max_named_sessions=self.pool.max_named,
            model=self.meta.get("model"),
            architecture=getattr(self.model_config, "architecture", None),
            context_length=self.config.max_context,
            device=str(self.device),
            protocol_version=1,
            max_resident=self.pool.max_resident,
            restored_sessions=list(self.restored_names) or None,
        )

    @property
    def idle(self) -> bool:
        return not self._queue and not self._active

    def submit(self, request: Request) -> list[Event]:
        """Take one decoded request; return the events that answer it right away."""
        rid = request.id
        if self.shutting_down:
            return [_error(rid, "the worker is shutting down", ErrorCode.SHUTTING_DOWN)]
        if isinstance(request, CancelRequest):
            return self._cancel(request.id)
        if rid is not None and self._in_flight(rid):
            msg = f"a request with id {rid!r} is still in flight"
            return [_error(rid, msg, ErrorCode.DUPLICATE_ID, op=request.op)]
        if isinstance(request, ShutdownRequest) and rid is not None:
            self.shutting_down = True
            return []
        immediate = (PingRequest, InfoRequest, StatsRequest, TokenizeRequest, DetokenizeRequest)
        if rid is not None and isinstance(request, immediate):
            try:
                return self._run_op(request)
            except Exception as exc:  # noqa: BLE001 - answer, keep serving
                return [_error(rid, f"internal error: {exc!r}", ErrorCode.INTERNAL_ERROR)]
        self._queue.append(_Queued(next(self._keys), request))
        return []

    def submit_error(self, error: ErrorEvent) -> list[Event]:
        """A line that failed to decode: answered now if it has an id, else in order."""
        if error.id is not None:
            return [error]
        self._queue.append(_Queued(next(self._keys), None, deferred_error=error))
        return []

    def step(self) -> list[Event]:
        """Start what may start, then run at most one forward pass."""
        events: list[Event] = []
        for active in [a for a in self._active if a.cancelled]:
            events.extend(self._finish(active, "cancelled"))
        self._admit(events)
        plan = plan_step(
            [
                RunningItem(a.key, a.session.name, a.request.id is None, a.prefill_remaining)
                for a in self._active
            ],
            self.prefill_chunk,
        )
        if not plan.empty:
            self._run_forward(plan.decode, plan.prefill, events)
        return events

    # ------------------------------------------------------------------------ admission

    def _in_flight(self, rid: RequestId) -> bool:
        return any(a.request.id == rid for a in self._active) or any(
            q.request is not None and q.request.id == rid for q in self._queue
        )

    def _queued_item(self, q: _Queued) -> QueuedItem:
        req = q.request
        session = getattr(req, "session_id", None) or None
        is_generate = isinstance(req, GenerateRequest)
        if is_generate and session is None:
            needs_slot = True
        elif is_generate and session is not None:
            known = self.pool.get(session)
            needs_slot = known.slot is None if known else self.pool.can_create_named()
        else:
            needs_slot = False
        in_order = q.request is None or q.request.id is None
        return QueuedItem(q.key, session, in_order, is_generate, needs_slot)

    def _admit(self, events: list[Event]) -> None:
        if not self._queue:
            return
        running = [
            RunningItem(a.key, a.session.name, a.request.id is None, a.prefill_remaining)
            for a in self._active
        ]
        items = {q.key: self._queued_item(q) for q in self._queue}
        slots = self.pool.free_slots + len(self._evictable(set()))
        admitted = set(plan_admission(list(items.values()), running, slots))
        if not admitted:
            return
        starting = [q for q in self._queue if q.key in admitted]
        self._queue = [q for q in self._queue if q.key not in admitted]
        keep_resident = {items[q.key].session for q in starting} - {None}
        waiting: list[_Queued] = []
        for q in starting:
            if items[q.key].needs_slot and not self._free_a_slot(keep_resident):
                waiting.append(q)  # a slot this plan counted on is wanted by an item started
                continue  # earlier in it; next step, once that one holds it
            try:
                if q.deferred_error is not None:
                    events.append(q.deferred_error)
                elif isinstance(q.request, GenerateRequest):
                    events.extend(self._start_generate(q.key, q.request, q.t_arrival))
                elif isinstance(q.request, ShutdownRequest):
                    self.shutting_down = True
                elif q.request is not None:
                    events.extend(self._run_op(q.request))
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                rid = q.request.id if q.request is not None else None
                events.append(_error(rid, f"internal error: {exc!r}", ErrorCode.INTERNAL_ERROR))
        if waiting:
            self._queue = sorted(waiting + self._queue, key=lambda q: q.key)

    # -------------------------------------------------------------------------- the tiers

    def _evictable(self, keep: set[str | None]) -> list[Session]:
        """Idle named sessions holding a slot they may give up, least recently used first."""
        if not self.pool.tiered:
            return []
        busy = {a.session.name for a in self._active} | keep
        idle = [s for s in self.pool.named.values() if s.slot is not None and s.name not in busy]
        return sorted(idle, key=lambda s: s.last_used)

    def _free_a_slot(self, keep: set[str | None]) -> bool:
        """Make sure a slot is free, moving the least recently used idle session's cache
        to host memory (or dropping it) if needed; False when every slot is busy."""
        if self.pool.free_slots > 0:
            return True
        candidates = self._evictable(keep)
        if not candidates:
            return False
        self._offload(candidates[0], keep)
        return True

    def _offload(self, session: Session, keep: Collection[str | None] = ()) -> None:
        assert session.slot is not None and session.name is not None
        if self.tiers is None or not session.resident_ids or session.dirty:
            session.clear()
            self.pool.detach(session)
            return
        self._settle_slots()
        store = self.tiers.store
        # the copy an idle save made of this very version, if the writer still holds it: no
        # second device-to-host copy
        state = store.pending_state(session.name, session.version) if store else None
        if state is None:
            state = self._export(session, evict=True, keep=keep)
        self.pool.detach(session)
        lost = self.tiers.offload(session.name, state, session.resident_ids, session.version)
        for name in lost:  # no room anywhere: those sessions will re-prefill
            dropped = self.pool.get(name)
            if dropped is not None and dropped.slot is None:
                dropped.clear()

    def _export(
        self,
        session: Session,
        evict: bool,
        keep: set[str | None] = frozenset(),  # type: ignore[assignment]
    ) -> SlotState:
        """The session's slot copied to the host: into a pool buffer when one is free (with
        ``evict``, after pushing a host copy not in ``keep`` out if the pool is exhausted),
        else pageable."""
        assert session.slot is not None and self.tiers is not None
        buffer = self.tiers.buffer(0, evict, keep)
        state = self.kv.export_slot(session.slot, len(session.resident_ids), buffer)
        if buffer is not None and state.buffer is not buffer:  # did not fit or not used
            buffer.release()
        return state

    def _prefetch_buffer(self, nbytes: int) -> HostBuffer | None:
        """A pool buffer for a session read from disk (any thread: no CUDA call), or None."""
        pool = self.host_pool
        return pool.take(nbytes, wait=False) if pool is not None else None

    def _make_host_pool(self, kv: Any) -> HostPool | None:
        """The tiers' buffers (``--host-cache-gb`` worth, each a whole slot's state), pinned
        here on CUDA, once; None without tiers or a session directory, or for a cache that
        cannot lay a slot out."""
        config = self.config
        if not (self.pool.tiered or config.session_dir is not None):
            return None
        views = getattr(kv, "slot_views", None)
        if views is None or config.host_cache_bytes <= 0:
            return None
        _, buffer_bytes = lay_out(views(0, 1 << 62))
        pinned = self.device.type == "cuda"
        count = config.host_cache_bytes // buffer_bytes if buffer_bytes else 0
        if pinned and count:
            self.log(
                f"host cache: pinning {count} buffers of {buffer_bytes / 1e9:.2f} GB "
                f"({count * buffer_bytes / 1e9:.1f} GB, --host-cache-gb)"
            )
        pool = HostPool(buffer_bytes, count, pinned, progress=self.log)
        if pinned and count:
            rate = pool.total_bytes / max(pool.pin_seconds, 1e-9) / 1e9
            self.log(f"host cache: pinned in {pool.pin_seconds:.1f} s ({rate:.1f} GB/s)")
        elif count == 0:
            self.log(
                f"host cache: --host-cache-gb holds no whole session state ({buffer_bytes} "
                "bytes each): host copies go to pageable memory"
            )
        return pool

    def _bring_in(self, session: Session) -> None:
        """A named session without a slot gets one (free: admission made sure) and its
        cache back from host memory or disk; without a usable copy it starts empty."""
        assert session.name is not None
        slot = self.pool.attach(session)
        self._settle_slots()
        clear_slot = getattr(self.kv, "clear_slot", None)
        if clear_slot is not None:
            clear_slot(slot)
        copy = self.tiers.take(session.name) if self.tiers is not None else None
        if copy is None:
            session.clear()
            return
        state, resident_ids = copy
        try:
            if state.tokens != len(resident_ids):
                raise ValueError(f"{state.tokens} cached tokens for {len(resident_ids)} ids")
            self.kv.import_slot(slot, state)
        except Exception as exc:  # noqa: BLE001 - a bad copy: rebuild the slow way
            self.log(
                f"session {session.name!r}: its saved cache does not fit ({exc}); rebuilding it"
            )
            state.release(self._copied_event())
            if clear_slot is not None:
                clear_slot(slot)
            session.clear()
            return
        state.release(self._copied_event())  # its buffer is free once the copy has run
        session.resident_ids = list(resident_ids)
        session.dirty = False

    def _copied_event(self) -> torch.cuda.Event | None:
        """An event after the copies launched so far (CUDA), or None."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _settle_slots(self) -> None:
        """Before a slot's cache is copied out or replaced between steps: no decode step
        launched ahead (CUDA, worker/device/graphed_lm.py) may still write to the slot, or be
        taken later as the next step of the session that now holds it."""
        drop_ahead = getattr(self.model, "_drop_ahead", None)
        if callable(drop_ahead):
            drop_ahead()

    def _early_store(self, config: EngineConfig, log: Callable[[str], None]) -> SessionStore | None:
        """With --session-dir and a model in the CUDA graphs' wrapper: the session directory
        opened and scanned before the KV cache and the graphs are built. The fingerprint's
        cache geometry comes from a meta-device cache of the eager model; the engine keeps
        this store only if the real cache's fingerprint is the same."""
        inner = getattr(self.model, "inner", None)  # the CUDA graphs' wrapper holds the model
        if config.session_dir is None or inner is None:
            return None
        try:
            meta = inner.make_kv_cache(config.resident, config.max_context, device="meta")
            fingerprint = model_fingerprint(self.model, self.tokenizer, meta.geometry())
        except (AttributeError, TypeError, RuntimeError):
            return None
        # the tiers' buffers, pinned now (before the graphs are captured), so that the saved
        # sessions' payloads can be read into them while the graphs are captured: the reads
        # make no CUDA call (pinning from another thread during a capture would be unsafe)
        self.host_pool = self._make_host_pool(meta)
        store = SessionStore(config.session_dir, fingerprint, log, self._prefetch_buffer)
        found = [name for name, _ids, _mtime in store.scan()][: self.pool.max_named]
        if found and self.host_pool is not None and self.host_pool.buffers:
            store.prefetch(found, self.host_pool.total_bytes)
        return store

    def _restore_sessions(self) -> list[str]:
        """Named sessions found in --session-dir at start: registered, their caches on disk.
        Their names, newest first."""
        store = self.tiers.store if self.tiers is not None else None
        if store is None:
            return []
        restored: list[str] = []
        for name, resident_ids, _mtime in store.scan():
            if not self.pool.can_create_named():
                self.log(
                    f"session {name!r} in {store.directory} not restored: "
                    f"{self.pool.max_named} named sessions already (--max-sessions)"
                )
                continue
            session = self.pool.open_named(name)
            session.resident_ids = resident_ids
            store.set_version(name, session.version)
            restored.append(name)
        if restored:
            self.log(f"restored {len(restored)} session(s) from {store.directory}")
            # their caches are read back into memory in the background, newest first (on
            # CUDA this began before the graphs were captured: _early_store)
            store.prefetch(restored, self.config.host_cache_bytes)
        return restored

    def idle_work(self) -> bool:
        """While nothing runs: with --session-dir, hand one session whose cache changed since
        it was last saved to the writer thread; else move one host copy that went to pageable
        memory (the pool was exhausted then) into a free pool buffer. True if there was one
        (call again)."""
        if not self.idle or self.tiers is None:
            return False
        return self._save_one() or self.tiers.pin_one()

    def idle_soon(self) -> bool:
        """Idle work waits for a pool buffer that a write or a copy still holds: look again
        shortly instead of blocking."""
        return self.idle and self.tiers is not None and self.tiers.buffers_coming_back()

    def _save_one(self) -> bool:
        """One session whose cache changed since it was last saved, to the writer thread."""
        store = self.tiers.store if self.tiers is not None else None
        if store is None or not store.writable or not self.idle:
            return False
        while self._unsaved:
            session = self.pool.get(self._unsaved.pop())
            if session is None or session.dirty or not session.resident_ids:
                continue
            assert session.name is not None
            if store.has_version(session.name, session.version):
                continue
            if session.slot is not None:
                state = self._export(session, evict=False)
            else:
                entry = self.tiers.host.entries.get(session.name) if self.tiers else None
                if entry is None or entry.version != session.version:
                    continue
                state = entry.state
                state.retain()  # held by the host tier and the writer
            store.write(session.name, state, session.resident_ids, session.version)
            return True
        return False

    def close(self) -> None:
        """Shutdown: save every named session (--session-dir) and wait for the writes."""
        store = self.tiers.store if self.tiers is not None else None
        if store is None:
            return
        while self._save_one():
            pass
        store.close()

    def warm_up_prefill(self) -> int:
        """Run one unnamed request of two prefill chunks and an odd tail of 3/4 of one (capped
        by the context) before the first user's: a GPU compiles the prefill's kernel variants
        (Triton specialises on lengths that are multiples of 16, the MoE kernels take another
        path for short tails), fla autotunes (a prefix-cache state inside the tail's step
        calls its state pass with other arguments), and cuBLAS picks its kernels here at
        start-up, not in a user's first long prompt (session 33: the Qwen3.5 file's first 16k
        prompt took 11.4 s on a fresh install, the next 0.8 s). Then the worker forgets it: the
        prefix cache's blocks and the step counters. Its prompt tokens (0: no room)."""
        tokens = warm_up_tokens(self.prefill_chunk, self.config.max_context)
        if tokens < 2 or not self.idle or not self.pool.free_slots:
            return 0  # never at a named session's expense (one restored into every slot)
        ids = [int(self.prefix_ids[0]) if self.prefix_ids else 0] * tokens
        request = GenerateRequest(prompt_segments=[IdsSegment(ids)], max_new_tokens=2,
                                  add_prefix=False)  # fmt: skip
        self.submit(request)
        errors: list[str] = []
        while not self.idle:
            errors += [e.error for e in self.step() if isinstance(e, ErrorEvent)]
        if self.prefix_cache is not None:
            self.prefix_cache.forget()
        self._steps = self._generated_tokens = 0
        reset = getattr(self.model, "reset_stats", None)  # GraphedCausalLM (CUDA)
        if reset is not None:
            reset()
        if errors:  # the worker serves on; a long prompt may meet the same error
            raise RuntimeError(f"the prefill warm-up failed: {errors[0]}")
        return tokens

    def _start_generate(self, key: int, req: GenerateRequest, t_arrival: float) -> list[Event]:
        rid = req.id
        name = req.session_id or None
        if name is not None and self.pool.get(name) is None and not self.pool.can_create_named():
            return [_capacity_error(rid, name, self.pool.max_named)]
        try:
            prompt_ids = build_prompt(
                req,
                self.tokenizer,
                self.prefix_ids,
                self._vocab_size(),
                self.config.max_context,
                self.chat_template,
            )
        except PromptError as exc:
            return [_error(rid, str(exc), exc.code, session_id=name)]
        problem = self.structured.open(key, req)  # compile the constraint, if any
        if problem is not None:
            return [_error(rid, str(problem), problem.code, session_id=name)]
        room = self.config.max_context - len(prompt_ids)
        max_new = room if req.max_new_tokens < 0 else min(req.max_new_tokens, room)
        if name is None:
            session = self.pool.borrow()
            plan = ResumePlan(0, NEW)
        else:
            session = self.pool.open_named(name)
            if session.slot is None:
                self._bring_in(session)
            plan = plan_resume(
                session.resident_ids,
                prompt_ids,
                dirty=session.dirty,
                warm_resume=self.config.warm_resume,
                keepable_prefix=self._keepable_prefix(session),
            )
            if plan.keep == 0:
                session.clear()
            else:
                del session.resident_ids[plan.keep :]
        session.last_used = next(self._clock)
        self._rewind_state(session, plan.keep, len(prompt_ids))
        reused, keys = plan.keep, []
        state_points: tuple[int, ...] = ()
        if self.prefix_cache is not None:
            assert session.slot is not None
            keys = block_keys(prompt_ids, self.prefix_cache.block)
            shared = self.prefix_cache.plan(prompt_ids, keys, len(prompt_ids) - 1)
            state_points = self.prefix_cache.state_points(len(prompt_ids), shared)
            if shared.tokens > plan.keep:
                self._settle_slots()
                self.prefix_cache.apply(shared, session.slot, plan.keep)
                reused = shared.tokens
                session.resident_ids.extend(prompt_ids[plan.keep : reused])
            if shared.truncated and shared.tokens >= plan.keep:  # a ring had lost the blocks
                plan = ResumePlan(plan.keep, TRUNCATED)
                self.prefix_cache.truncations += 1
        params = SamplingParams(req.temperature, req.top_k, req.top_p, req.min_p, req.seed)
        generator = None if params.greedy else make_generator(req.seed, self.device)
        eos = frozenset(self.tokenizer.eos_ids) | frozenset(req.stop_token_ids)
        self._active.append(
            _Active(
                key=key,
                request=req,
                session=session,
                prompt_ids=prompt_ids,
                fed=reused,
                plan=plan,
                reused=reused,
                block_keys=keys,
                next_block=0,
                state_points=state_points,
                max_new=max_new,
                params=params,
                generator=generator,
                eos_ids=eos,
                text=TextStream(tuple(req.stop)),
                t_arrival=t_arrival,
                t_start=time.perf_counter(),
            )
        )
        return []

    def _keepable_prefix(self, session: Session) -> Any:
        """The cache's limit on a kept prefix; a cache with per-slot state (a hybrid model's
        recurrent-state snapshots, worker/layers/hybrid_cache.py) answers for the slot."""
        per_slot = getattr(self.kv, "resume_prefix", None)
        if per_slot is not None:
            return functools.partial(per_slot, session.slot)
        return getattr(self.kv, "keepable_prefix", None)

    def _rewind_state(self, session: Session, keep: int, prompt_len: int) -> None:
        """A cache with recurrent state: rewind the slot to `keep` tokens (from a snapshot)
        and, for a named session, snapshot the state before the prompt's last token (a
        regenerate of this prompt resumes there)."""
        truncate = getattr(self.kv, "truncate", None)
        if truncate is None:
            return
        truncate(session.slot, keep)
        if session.name is not None:
            self.kv.snapshot_at(session.slot, prompt_len - 1)

    # --------------------------------------------------------------------- the forward

    def _run_forward(self, decode: Iterable[int], prefill: Any, events: list[Event]) -> None:
        by_key = {a.key: a for a in self._active}
        rows: list[tuple[_Active, list[int]]] = []
        for key in decode:
            a = by_key[key]
            assert a.pending is not None
            rows.append((a, [a.pending]))
        new_blocks = None  # prompt blocks this step completes (worker/engine/prefix_cache.py)
        if prefill is not None:
            a = by_key[prefill.key]
            rows.append((a, a.prompt_ids[a.fed : a.fed + prefill.length]))
            if self.prefix_cache is not None and a.next_block < len(a.block_keys):
                assert a.session.slot is not None
                new_blocks = self.prefix_cache.begin(
                    a.prompt_ids,
                    a.block_keys,
                    a.session.slot,
                    a.next_block,
                    len(a.session.resident_ids),
                    prefill.length,
                    a.state_points,
                )
        flat: list[int] = []
        positions: list[int] = []
        for a, new in rows:
            start = len(a.session.resident_ids)
            flat.extend(new)
            positions.extend(range(start, start + len(new)))
        # rows that sample: every decoder, and a prefill that feeds its last prompt token
        sampling_rows = [
            i
            for i, (a, new) in enumerate(rows)
            if a.pending is not None or (a.fed + len(new) == len(a.prompt_ids) and a.max_new > 0)
        ]
        # constrained rows: their masks are filled on a helper thread while the forward runs
        token_mask = self.structured.token_mask([rows[i][0].key for i in sampling_rows])
        same_rows_next = all(  # no row known to leave or to start decoding after this step
            len(a.generated) + 1 < a.max_new
            if a.pending is not None
            else a.fed + len(new) < len(a.prompt_ids)
            for a, new in rows
        )
        step = StepInput(
            input_ids=torch.tensor(flat, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            slots=[a.session.slot for a, _ in rows],
            cached_lens=[len(a.session.resident_ids) for a, _ in rows],
            new_lens=[len(new) for _, new in rows],
            grammar_masked=token_mask is not None,
            same_rows_next=same_rows_next,
        )
        self._torch_threads_for(len(flat))
        try:
            with torch.inference_mode():
                logits = self.model(step, self.kv)  # [B, vocab] float32
                sampled: list[int] = []
                row_logprobs: list[RowLogprobs | None] = []
                if sampling_rows:
                    picked = logits[sampling_rows] if len(sampling_rows) < len(rows) else logits
                    sampled, row_logprobs = sample_step(  # the one host sync of the step
                        picked,
                        [rows[i][0].params for i in sampling_rows],
                        [rows[i][0].generator for i in sampling_rows],
                        token_mask,
                        self.structured.top_logprobs([rows[i][0].request for i in sampling_rows]),
                    )
                elif logits.is_cuda:
                    # nothing to sample (prefill-only chunks): still wait for the KV writes, so
                    # `done` means the session is ready and prefill_ms is the real time
                    torch.cuda.synchronize(logits.device)
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not us
            if new_blocks is not None and self.prefix_cache is not None:
                self.prefix_cache.finish(new_blocks, -1, 0, ok=False)
            code = ErrorCode.OUT_OF_MEMORY if _is_oom(exc) else ErrorCode.INTERNAL_ERROR
            for a, _ in rows:
                a.session.dirty = True
                events.append(
                    _error(a.request.id, f"step failed: {exc!r}", code, session_id=a.session.name)
                )
                self._release(a)
            return
        self._steps += 1
        now = time.perf_counter()
        for a, new in rows:  # the KV now holds the fed tokens
            a.session.resident_ids.extend(new)
            if a.pending is not None:
                a.pending = None
            else:
                a.fed += len(new)
                if new_blocks is not None and self.prefix_cache is not None:
                    assert a.session.slot is not None
                    a.next_block = self.prefix_cache.finish(
                        new_blocks, a.session.slot, len(a.session.resident_ids), ok=True
                    )
        drawn = zip(sampled, row_logprobs, strict=True)  # (token, its log-probabilities)
        sampled_by_row = dict(zip(sampling_rows, drawn, strict=True))
        for i, (a, _) in enumerate(rows):
            if a.prefill_remaining > 0:
                continue
            if a.t_first is None:
                a.t_first = now
            if i in sampled_by_row:
                token, row_lp = sampled_by_row[i]
                self.structured.accept(a.key, a.request, token, row_lp, a.eos_ids)
                events.extend(self._accept_token(a, token))
            else:  # max_new_tokens == 0: prefill only
                events.extend(self._finish(a, "length"))
        # the constrained rows that go on: their next masks start filling now
        self.structured.fill_ahead([rows[i][0].key for i in sampling_rows])

    def _accept_token(self, a: _Active, token: int) -> list[Event]:
        """Stream one sampled token; finish the request when it ends the turn."""
        if token in a.eos_ids:
            return self._finish(a, "stop")
        self._generated_tokens += 1
        a.generated.append(token)
        a.unreported_ids.append(token)
        out = a.text.push(self.tokenizer.token_bytes(token))
        events: list[Event] = []
        if out.text:
            events.append(self._token_event(a, out.text))
        if out.stopped:
            a.session.dirty = True
            events.extend(self._finish(a, "stop"))
        elif len(a.generated) >= a.max_new:
            events.extend(self._finish(a, "length"))
        else:
            a.pending = token
        return events

    def _token_event(self, a: _Active, text: str) -> TokenEvent:
        ids = None
        if a.request.return_token_ids:
            ids, a.unreported_ids = a.unreported_ids, []
        logprobs = self.structured.take_logprobs(a.key) if a.request.return_logprobs else None
        return TokenEvent(token=text, token_ids=ids, id=a.request.id, logprobs=logprobs)

    def _finish(self, a: _Active, reason: str) -> list[Event]:
        """End `a` with its `done` line; the session keeps exactly the fed tokens."""
        events: list[Event] = []
        stopped_before = a.text.stopped
        tail = a.text.finish()
        if tail.text or (a.request.return_token_ids and a.unreported_ids and not tail.stopped):
            events.append(self._token_event(a, tail.text))
        if tail.stopped and not stopped_before:
            a.session.dirty = True
            reason = "stop"
        now = time.perf_counter()
        t_first = a.t_first if a.t_first is not None else now
        prefill_s = t_first - a.t_start
        decode_s = now - t_first
        prefilled = a.fed - a.reused
        n = len(a.generated)
        trimmed = a.text.stopped
        req = a.request
        done = DoneEvent(
            id=req.id,
            prompt_tokens=len(a.prompt_ids),
            completion_tokens=n,
            finish_reason=reason,  # type: ignore[arg-type]
            reused_prompt_tokens=a.reused,
            prefilled_prompt_tokens=prefilled,
            session_reset_reason=a.plan.reason,  # type: ignore[arg-type]
            prefill_ms=round(prefill_s * 1000, 3),
            decode_ms=round(decode_s * 1000, 3),
            total_ms=round((now - a.t_arrival) * 1000, 3),
            prefill_tok_s=round(prefilled / prefill_s, 3) if prefill_s > 0 else 0.0,
            decode_tok_s=round((n - 1) / decode_s, 3) if n > 1 and decode_s > 0 else 0.0,
            generated_token_ids=None if trimmed else list(a.generated),
            session_id=a.session.name,
            resident_keep=a.plan.keep if req.return_resident else None,
            resident_append=(
                a.session.resident_ids[a.plan.keep :] if req.return_resident else None
            ),
        )
        events.append(done)
        snapshot_at = getattr(self.kv, "snapshot_at", None)
        if snapshot_at is not None and a.session.name is not None and not a.session.dirty:
            snapshot_at(a.session.slot, len(a.session.resident_ids))  # the turn's end
        self._release(a)
        return events

    def _release(self, a: _Active) -> None:
        self._active.remove(a)
        self.structured.close(a.key)
        a.session.last_used = next(self._clock)
        if a.session.name is None:
            self.pool.give_back(a.session)
        elif self.tiers is not None:
            self._unsaved.add(a.session.name)

    # ------------------------------------------------------------------ other requests

    def _cancel(self, rid: RequestId) -> list[Event]:
        for a in self._active:
            if a.request.id == rid:
                a.cancelled = True  # ends at the next step boundary
                return []
        for q in self._queue:
            if (
                q.request is not None
                and q.request.id == rid
                and isinstance(q.request, GenerateRequest)
            ):
                self._queue.remove(q)
                session = self.pool.get(q.request.session_id or "")
                kept = len(session.resident_ids) if session is not None else 0
                return [_unstarted_done(q.request, kept)]
        return [
            _error(
                rid, f"no request with id {rid!r} is in flight", ErrorCode.UNKNOWN_ID, op="cancel"
            )
        ]

    def _run_op(self, req: Request) -> list[Event]:
        rid = req.id
        if isinstance(req, PingRequest):
            return [PongEvent(id=rid)]
        if isinstance(req, InfoRequest):
            return [InfoEvent(info=self.info(), id=rid)]
        if isinstance(req, StatsRequest):
            return [StatsEvent(stats=self.stats(), id=rid)]
        if isinstance(req, TokenizeRequest):
            ids = self.tokenizer.encode(req.text)
            return [TokensEvent(tokens=(self.prefix_ids + ids) if req.add_prefix else ids, id=rid)]
        if isinstance(req, DetokenizeRequest):
            bad = [i for i in req.ids if i >= self._vocab_size()]
            if bad:
                return [
                    _error(
                        rid,
                        f"token id {bad[0]} is not below the vocabulary size {self._vocab_size()}",
                        ErrorCode.INVALID_TOKEN_ID,
                        op=req.op,
                    )
                ]
            return [TextEvent(text=self.tokenizer.decode(req.ids), id=rid)]
        if isinstance(req, OpenRequest):
            name = req.session_id
            if self.pool.get(name) is None and not self.pool.can_create_named():
                return [_capacity_error(rid, name, self.pool.max_named, op="open")]
            self.pool.open_named(name)
            return [OpenedEvent(session_id=name, id=rid)]
        if isinstance(req, CloseRequest):
            self.pool.close_named(req.session_id)
            if self.tiers is not None:
                self.tiers.forget(req.session_id, delete_file=True)
            return [ClosedEvent(session_id=req.session_id, id=rid)]
        if isinstance(req, ResetRequest):
            session = self.pool.get(req.session_id)
            if session is not None:
                session.clear()
                if self.tiers is not None:
                    self.tiers.forget(req.session_id, delete_file=True)
            return [ResetEvent(session_id=req.session_id, id=rid)]
        return [_error(rid, f"op {req.op!r} is not handled here", ErrorCode.INVALID_REQUEST)]

    def _vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def _torch_threads_for(self, tokens: int) -> None:
        """On a multi-thread CPU worker, torch's own ops of a decode-sized step run on one
        thread: their OpenMP regions (over a vocabulary of logits, say) split work statically,
        so one thread preempted by another process held each step for a scheduler slice (2
        threads beside a busy process: 21 tok/s, 1 thread: 36). The matmuls keep every thread
        through the kernels' own pool, which survives preemption. Prefill chunks use them all."""
        if self._cpu_threads <= 1:
            return
        want = 1 if tokens <= SMALL_STEP_TOKENS else self._cpu_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def info(self) -> dict[str, Any]:
        tok = self.tokenizer
        param = next(iter(self.model.parameters()), None)
        return {
            **self.meta,
            "model": self.meta.get("model"),
            "architecture": getattr(self.model_config, "architecture", None),
            "context_length": self.config.max_context,
            "model_context_length": getattr(self.model_config, "context_length", None),
            "vocab_size": self._vocab_size(),
            "bos_id": tok.bos_id,
            "eos_ids": sorted(tok.eos_ids),
            "prefix_ids": list(self.prefix_ids),
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "chat_template": tok.chat_template,
            "max_sessions": self.config.max_sessions,
            "max_named_sessions": self.pool.max_named,
            "bytes_per_session": int(getattr(self.kv, "bytes_per_slot", 0)),
            "kv_cache_dtype": self._kv_dtype(),
            "max_resident": self.pool.max_resident,
            "host_cache_bytes": self.config.host_cache_bytes,
            "host_pool": self.host_pool.stats() if self.host_pool is not None else None,
            "session_dir": self.config.session_dir,
            "prefix_cache_bytes": self.config.prefix_cache_bytes if self.prefix_cache else 0,
            "prefix_block": self.config.prefix_block,
            "prefill_chunk": self.prefill_chunk,
            "warm_resume": self.config.warm_resume,
            "device": str(self.device),
            "dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
            "weights": self._weight_formats(),
        }

    def _kv_dtype(self) -> str | None:
        """The attention layers' cache dtype (--kv-cache-dtype; None: no attention layer)."""
        for layer in getattr(self.kv, "layers", []):
            k = getattr(layer, "k", None)
            if isinstance(k, torch.Tensor) and k.shape[2]:
                return str(k.dtype).removeprefix("torch.")
        return None

    def _weight_formats(self) -> dict[str, dict[str, int]]:
        """Format -> tensors and bytes of the loaded weights (``quantize.summary``), once."""
        if self._formats is None:
            from worker.loading.quantize import summary

            self._formats = summary(getattr(self.model, "inner", self.model))
        return self._formats

    def stats(self) -> dict[str, Any]:
        import psutil

        device_memory: dict[str, Any] = {}
        if self.device.type == "cuda":
            from worker.device import memory

            device_memory.update(memory.figures(self.device))
        graph_stats = getattr(self.model, "graph_stats", None)  # GraphedCausalLM (CUDA)
        if self.device.type == "cpu":
            from worker.device import cpu_gemv

            device_memory["cpu_pool"] = cpu_gemv.pool_stats()  # helpers stalled by other load
        return {
            **device_memory,
            **(graph_stats() if graph_stats is not None else {}),
            "active_requests": len(self._active),
            "queued_requests": len(self._queue),
            "sessions": len(self.pool.named),
            "session_ids": sorted(self.pool.named),
            "free_slots": self.pool.free_slots,
            "max_sessions": self.config.max_sessions,
            "max_resident": self.pool.max_resident,
            "resident_sessions": sum(s.slot is not None for s in self.pool.named.values()),
            "tiers": self._tier_stats(),
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache else None,
            "grammar": self.structured.stats(),
            "steps": self._steps,
            "generated_tokens": self._generated_tokens,
            "rss_bytes": psutil.Process().memory_info().rss,
            "requests": [
                {
                    "id": a.request.id,
                    "session_id": a.session.name,
                    "prompt_tokens": len(a.prompt_ids),
                    "fed_prompt_tokens": a.fed,
                    "completion_tokens": len(a.generated),
                }
                for a in self._active
            ],
        }

    def _tier_stats(self) -> dict[str, Any] | None:
        if self.tiers is None:
            return None
        store = self.tiers.store
        return {
            **self.tiers.stats(),
            **(store.stats() if store is not None else {}),
            "restored_sessions": self.restored_sessions,
        }


def _stderr_log(message: str) -> None:
    print(f"[tokenpipe worker] {message}", file=sys.stderr, flush=True)


def _error(
    rid: RequestId | None,
    message: str,
    code: str,
    *,
    op: str | None = None,
    session_id: str | None = None,
) -> ErrorEvent:
    return ErrorEvent(error=message, code=code, op=op, session_id=session_id, id=rid)


def _capacity_error(
    rid: RequestId | None, name: str, max_named: int, op: str | None = None
) -> ErrorEvent:
    msg = f"all {max_named} named session slots are taken; close one first"
    if max_named == 0:  # nothing to close
        msg = NO_NAMED_SESSIONS
    return _error(rid, msg, ErrorCode.CAPACITY_EXHAUSTED, op=op, session_id=name)


def _unstarted_done(req: GenerateRequest, kept: int) -> DoneEvent:
    """`done` of a generate cancelled while still queued: nothing was fed or generated."""
    resident = req.return_resident
    return DoneEvent(
        id=req.id,
        prompt_tokens=0,
        completion_tokens=0,
        finish_reason="cancelled",
        reused_prompt_tokens=0,
        prefilled_prompt_tokens=0,
        session_reset_reason=NEW,
        prefill_ms=0.0,
        decode_ms=0.0,
        total_ms=0.0,
        prefill_tok_s=0.0,
        decode_tok_s=0.0,
        generated_token_ids=[],
        session_id=req.session_id or None,
        resident_keep=kept if resident else None,
        resident_append=[] if resident else None,
    )


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(exc)
