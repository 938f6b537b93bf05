"""Triton kernel variants compiled on every host core before the start-up launches them.

On a machine whose Triton cache is cold, a CUDA start compiles ~50 kernel variants (the GEMV
candidates, the attention and norm kernels of each graph bucket): each is Triton's passes,
LLVM, ptxas and a C build of its launcher, about half a second, one after another as each
first launches. A `CompilePool` compiles them side by side instead:

    pool = start_compile_pool()              # before the load: its processes import meanwhile
    compile_ahead(pool, [bucket_64, ...])    # each stage runs with its Triton launches skipped
    warm_up()                                # the real pass: every variant in the disk cache
    pool.close()

Inside `compile_ahead`, a launch of a kernel variant this process has not compiled is
skipped (Triton's ``jit_cache_hook``) and its specialisation, in Triton's own serialised form,
goes to the pool at once, so compiling overlaps the rest of the trace. Each pool process
compiles it and builds its launcher into Triton's on-disk cache (``TRITON_CACHE_DIR``); the
call returns when all are done, and the real pass loads each variant from there. So the
traced code must not depend on what the skipped kernels would have written: the warm-up
passes qualify (shapes and control flow come from the host; their outputs are thrown away).

A warm cache (a restart) gains nothing from the trace (its first stage, the first eager step,
costs seconds), so tracing stops once the cache shows it is warm: before each stage after the
first, when every variant this call sent has come back already in the cache; and for whole
calls after one whose variants all came back cached (on a restart the GEMV candidates, traced
first, answer for the graph kernels). The real pass then loads the rest itself; a variant it
does not find is compiled there, as without a pool.

The pool's processes are forked from a server that imports torch and Triton once (the
kernel modules import torch), not spawned each with its own imports: 15 processes importing
at once slowed the worker's own load, and were not up in time for the first trace.

A variant that fails ahead (an unexpected specialisation, a lost process) is compiled as
before when the real pass launches it: this changes how long a start takes, never what runs.
`close` logs the variants the start-up still compiled itself. TOKENPIPE_COMPILE_AHEAD=0 turns
it off.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

MAX_PROCESSES = 16
WAIT_SECONDS = 120.0  # a compile still running then is left to the start-up's own pass


@dataclass(frozen=True)
class Compiled:
    """One variant compiled (or found in the cache) by a pool process."""

    name: str
    seconds: float
    cache_hit: bool


@dataclass
class AheadReport:
    """What one `compile_launches` did."""

    variants: int = 0
    cache_hits: int = 0
    failed: int = 0
    stages_traced: int = 0
    trace_seconds: float = 0.0
    slowest: Compiled | None = None
    errors: list[str] = field(default_factory=list)


class CompilePool:
    """Processes (any Executor) that compile recorded Triton specialisations into the cache."""

    def __init__(self, executor: Executor, processes: int) -> None:
        self._executor = executor
        self.processes = processes
        self._compiled_here: list[str] | None = None  # the start-up's own compiles, from then
        self._listener: Any = None
        self.warm = False  # the last call that sent variants found them all in the cache

    def compile_launches(self, stages: Sequence[Callable[[], object]]) -> AheadReport:
        """Run the stages in order with the launches of uncompiled kernel variants skipped,
        each variant compiled on the pool as soon as it is seen; -> the report, once every
        compile has ended. Stops before a stage when the cache looks warm (module doc)."""
        import torch
        import triton
        from triton import knobs

        self._watch_compiles_here()
        target = triton.runtime.driver.active.get_current_target()
        sent: dict[str, Future[Compiled]] = {}  # serialised specialisation -> its compile

        def record(*, compile: dict[str, Any], **_: Any) -> bool:
            spec = compile.get("specialization_data")
            if not isinstance(spec, str):
                return False  # compile it now, as without the hook
            if spec not in sent:
                sent[spec] = self._executor.submit(compile_variant, spec, target)
            return True  # skip the compile and the launch

        report = AheadReport()
        if self.warm:
            return report  # traced nothing: see the module doc
        started = time.perf_counter()
        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = record
        # the trace leaves the random state as it found it (a timing run draws its inputs)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            try:
                for stage in stages:
                    if report.stages_traced and _all_cache_hits(sent.values()):
                        break
                    stage()
                    report.stages_traced += 1
            except Exception as exc:  # noqa: BLE001 - the real pass runs the same code and says
                report.errors.append(f"the trace stopped early: {exc!r}")
            finally:
                knobs.runtime.jit_cache_hook = previous
        report.trace_seconds = time.perf_counter() - started
        done, late = wait(sent.values(), timeout=WAIT_SECONDS)
        report.variants = len(sent)
        report.failed = len(late)
        for future in done:
            if future.exception() is not None:
                report.failed += 1
                report.errors.append(repr(future.exception()))
                continue
            compiled = future.result()
            report.cache_hits += compiled.cache_hit
            if report.slowest is None or compiled.seconds > report.slowest.seconds:
                report.slowest = compiled
        if report.variants:
            self.warm = report.cache_hits == report.variants
        return report

    def _watch_compiles_here(self) -> None:
        """From the first trace on, note each kernel this process compiles itself (not found
        in the disk cache): the variants no trace saw, for `close` to log."""
        from triton import knobs

        if self._compiled_here is not None or knobs.compilation.listener is not None:
            return
        compiled_here: list[str] = []

        def listen(*, src: Any, cache_hit: bool, **_: Any) -> None:
            if not cache_hit:
                compiled_here.append(str(getattr(src, "name", src)))

        knobs.compilation.listener = self._listener = listen
        self._compiled_here = compiled_here

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._compiled_here is None:
            return
        from triton import knobs

        if knobs.compilation.listener is self._listener:
            knobs.compilation.listener = None
        if self._compiled_here:
            names = ", ".join(sorted(set(self._compiled_here)))
            _log(f"compile_ahead: the start-up compiled {len(self._compiled_here)} variants "
                 f"itself: {names}")  # fmt: skip


def _all_cache_hits(futures: Any) -> bool:
    """Every compile sent so far has ended, each one finding its variant in the cache."""
    return all(f.done() and f.exception() is None and f.result().cache_hit for f in futures)


def start_compile_pool(processes: int | None = None) -> CompilePool | None:
    """A pool of `processes` (default: every core but one, at most MAX_PROCESSES), started
    now; None where it would not help: fewer than 3 cores, no Triton, or
    TOKENPIPE_COMPILE_AHEAD=0."""
    if os.environ.get("TOKENPIPE_COMPILE_AHEAD") == "0":
        return None
    from worker.device.kernels import triton_available

    if processes is None:
        processes = min(MAX_PROCESSES, len(os.sched_getaffinity(0)) - 1)
    if processes < 2 or not triton_available():
        return None
    # forked from a fresh server process, never from the worker (CUDA and threads there)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "triton.compiler.code_generator"])
    executor = ProcessPoolExecutor(processes, mp_context=context, initializer=_prepare_process)
    # processes start on demand, one per task waiting; the first waits for the server's
    # imports (seconds), so they are asked for off the worker's thread
    threading.Thread(
        target=lambda: [executor.submit(_ready) for _ in range(processes)],
        name="compile-pool-start", daemon=True,
    ).start()  # fmt: skip
    return CompilePool(executor, processes)


def compile_ahead(
    pool: CompilePool | None, stages: Sequence[Callable[[], object]], what: str
) -> None:
    """`pool.compile_launches(stages)`, logged; nothing without a pool (no stage runs)."""
    if pool is None:
        return
    started = time.perf_counter()
    report = pool.compile_launches(stages)
    seconds = time.perf_counter() - started
    if not report.stages_traced and not report.errors:
        _log(f"compile_ahead: {what}: not traced (the Triton cache answered as warm before)")
        return
    compiled = report.variants - report.cache_hits - report.failed
    slowest = report.slowest
    _log(
        f"compile_ahead: {what}: {report.variants} Triton kernel variants ({compiled} compiled, "
        f"{report.cache_hits} already in the cache, {report.failed} failed) on "
        f"{pool.processes} processes in {seconds:.1f}s; traced {report.stages_traced} of "
        f"{len(stages)} stages in {report.trace_seconds:.1f}s"
        + (f"; slowest {slowest.name} {slowest.seconds:.1f}s" if slowest else "")
        + (f"; {report.errors[0]}" if report.errors else "")
    )


# -- in a pool process --------------------------------------------------------------------------


def _prepare_process() -> None:
    """The once-per-process part of a compile (hashing Triton's own files for its cache
    keys: ~0.4 s), before the first task."""
    os.nice(10)  # the worker's own start-up goes first
    os.dup2(2, 1)  # the worker's stdout carries its protocol: nothing of ours goes there

    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception:  # noqa: BLE001 - a Triton without it: the first compile pays
        pass


def _ready() -> None:
    """A task that only waits for its process to be up."""


def compile_variant(spec: str, target: Any) -> Compiled:
    """Compile one specialisation recorded by `CompilePool.compile_launches` for `target` (a
    triton GPUTarget) and build its launcher, both into Triton's on-disk cache. The
    specialisation is decoded as Triton's ``JITFunction.preload`` does, without a device."""
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    started = time.perf_counter()
    data = json.loads(spec)
    module, _, name = data["name"].rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    while not isinstance(fn, JITFunction):  # unwrap autotune / heuristics
        fn = fn.fn

    def constant(value: Any) -> Any:
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(_tuples(value["constexpr"]))
        if isinstance(value, dict) and "jit_function" in value:
            path, _, qualname = value["jit_function"].partition(":")
            return getattr(importlib.import_module(path), qualname)
        return _tuples(value)

    keys = data["constant_keys"]
    constexprs = {tuple(k): constant(v) for k, v in zip(keys, data["constant_vals"], strict=True)}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"], strict=True)}
    signature = {k: _tuples(v) for k, v in data["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    source = ASTSource(fn, signature, constexprs, attrs)
    hits: list[bool] = []
    previous = knobs.compilation.listener
    knobs.compilation.listener = lambda *, src, cache_hit, **_: (
        hits.append(cache_hit) if src is source else None
    )
    try:
        kernel = triton.compile(source, target=target, options=options)
    finally:
        knobs.compilation.listener = previous
    if target.backend == "cuda":
        try:  # a C build per signature (cached by its source); needs libcuda to link
            from triton.backends.nvidia.driver import CudaLauncher

            CudaLauncher(kernel.src, kernel.metadata)
        except Exception:  # noqa: BLE001 - the worker builds it at the first launch
            pass
    return Compiled(str(fn.__name__), time.perf_counter() - started, all(hits) and bool(hits))


def _tuples(value: Any) -> Any:
    """JSON's lists back into the tuples Triton wrote."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
