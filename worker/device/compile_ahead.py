"""Triton kernel variants compiled on every host core before the start-up launches them.

On a machine whose Triton cache is cold, a CUDA start compiles ~50 kernel variants (the GEMV
candidates, the attention and norm kernels of each graph bucket): each is Triton's passes,
LLVM, ptxas and a C build of its launcher, about half a second, one after another as each
first launches. A `CompilePool` compiles them side by side instead:

    pool = start_compile_pool()    # before the load: its processes import meanwhile
    compile_ahead(pool, warm_up)   # warm_up runs with its Triton launches recorded, not run
    warm_up()                      # the real pass: every variant is in Triton's disk cache
    pool.close()

Inside `compile_ahead`, a launch of a kernel variant this process has not compiled is
skipped (Triton's ``jit_cache_hook``) and its specialisation, in Triton's own serialised form,
goes to the pool. Each pool process compiles it and builds its launcher into Triton's on-disk
cache (``TRITON_CACHE_DIR``); the call returns when all are done, and the real pass loads each
variant from there. So the traced code must not depend on what the skipped kernels would have
written: the warm-up passes qualify (shapes and control flow come from the host; their
outputs are thrown away). A variant that fails ahead (an unexpected specialisation, a lost
process) is compiled as before when the real pass launches it: this changes how long a start
takes, never what runs. TOKENPIPE_COMPILE_AHEAD=0 turns it off.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, wait
from typing import Any

MAX_PROCESSES = 16
WAIT_SECONDS = 120.0  # a compile still running then is left to the start-up's own pass


class CompilePool:
    """Processes (any Executor) that compile recorded Triton specialisations into the cache."""

    def __init__(self, executor: Executor, processes: int) -> None:
        self._executor = executor
        self.processes = processes

    def compile_launches(self, trace: Callable[[], object]) -> tuple[int, int]:
        """Run `trace` with the launches of uncompiled kernel variants skipped; compile those
        variants on the pool. -> (variants, failed), once every compile has ended."""
        import torch
        import triton
        from triton import knobs

        recorded: dict[str, None] = {}  # serialised specialisations, in launch order

        def record(*, compile: dict[str, Any], **_: Any) -> bool:
            spec = compile.get("specialization_data")
            if not isinstance(spec, str):
                return False  # compile it now, as without the hook
            recorded[spec] = None
            return True  # skip the compile and the launch

        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = record
        # the trace leaves the random state as it found it (a timing run draws its inputs)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            try:
                trace()
            except Exception as exc:  # noqa: BLE001 - the real pass runs the same code and says
                _log(f"compile_ahead: the trace stopped early ({exc!r})")
            finally:
                knobs.runtime.jit_cache_hook = previous
        target = triton.runtime.driver.active.get_current_target()
        futures = [self._executor.submit(compile_variant, spec, target) for spec in recorded]
        done, late = wait(futures, timeout=WAIT_SECONDS)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors or late:
            first = repr(errors[0]) if errors else f"{len(late)} still compiling"
            _log(f"compile_ahead: {len(errors) + len(late)} variants left to the start-up: {first}")
        return len(recorded), len(errors) + len(late)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


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
    # spawn: the worker has CUDA and threads, which a forked child must not inherit
    executor = ProcessPoolExecutor(
        processes, mp_context=multiprocessing.get_context("spawn"), initializer=_prepare_process
    )
    for _ in range(processes):  # processes start on demand: one per task waiting
        executor.submit(_ready)
    return CompilePool(executor, processes)


def compile_ahead(pool: CompilePool | None, trace: Callable[[], object], what: str) -> None:
    """`pool.compile_launches(trace)`, logged; nothing without a pool (`trace` is not run)."""
    if pool is None:
        return
    started = time.perf_counter()
    variants, failed = pool.compile_launches(trace)
    _log(
        f"compile_ahead: {variants} Triton kernel variants of the {what} compiled on "
        f"{pool.processes} processes in {time.perf_counter() - started:.1f}s"
        + (f" ({failed} failed)" if failed else "")
    )


# -- in a pool process --------------------------------------------------------------------------


def _prepare_process() -> None:
    """Imports, and the once-per-process part of a compile (hashing Triton's own files for
    its cache keys: ~0.4 s), before the first task."""
    os.nice(5)  # the worker's own start-up goes first
    import torch  # noqa: F401 - the kernel modules import it
    import triton.compiler.code_generator  # noqa: F401

    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception:  # noqa: BLE001 - a Triton without it: the first compile pays
        pass


def _ready() -> None:
    """A task that only waits for its process to be up."""


def compile_variant(spec: str, target: Any) -> str:
    """Compile one specialisation recorded by `CompilePool.compile_launches` for `target` (a
    triton GPUTarget) and build its launcher, both into Triton's on-disk cache; -> the
    kernel's name. The specialisation is decoded as Triton's ``JITFunction.preload`` does,
    without touching a device."""
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

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
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options
    )
    if target.backend == "cuda":
        try:  # a C build per signature (cached by its source); needs libcuda to link
            from triton.backends.nvidia.driver import CudaLauncher

            CudaLauncher(kernel.src, kernel.metadata)
        except Exception:  # noqa: BLE001 - the worker builds it at the first launch
            pass
    return str(fn.__name__)


def _tuples(value: Any) -> Any:
    """JSON's lists back into the tuples Triton wrote."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
