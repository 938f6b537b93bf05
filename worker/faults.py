"""Fault injection for reliability tests: `TOKENPIPE_FAULT`, read once per process.

The spec is a comma-separated list of `KIND@POINT:WHEN[:ARG]` rules; `@POINT` defaults to
`forward` (the only point today). `WHEN` is a 1-based hit number (`3`), a range (`3-5`), or
`*` (every hit).

    oom@forward:3          the 3rd forward pass raises an out-of-memory error
    sleep@forward:*:0.2    every forward pass sleeps 0.2 s first (widens kill windows)
    exit@forward:5         the 5th forward pass ends the process at once (os._exit(70))
    close_stdout@forward:4 the 4th forward pass closes fd 1 (the worker's protocol stream)
    stop@forward:2         the 2nd forward pass SIGSTOPs the process (a hung worker)

A separate seam that production never pays for: `python -m worker.faults WORKER-ARGS...` runs
`tokenpipe worker` with the engine's model wrapped from the outside (`FaultyModel`), so each
model call (the forward pass at the top of the engine step's `try`, which turns a failed step
into per-request errors) hits `forward` first. `tokenpipe worker` never imports this module.
`OOM` is `torch.OutOfMemoryError` when torch is importable, else `MemoryError`; the engine
maps it to `out_of_memory`.

`TOKENPIPE_FAULT_FILE=PATH` arms faults at run time (one process serving several
scenarios): when PATH exists at a hook call, its rules join those of `TOKENPIPE_FAULT`, every hit
count restarts at 0, and the file is removed (so exactly one process, the first to look, takes it).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

ENV = "TOKENPIPE_FAULT"
FILE_ENV = "TOKENPIPE_FAULT_FILE"
KINDS = frozenset({"oom", "sleep", "exit", "close_stdout", "stop"})
EXIT_STATUS = 70


class FaultSpecError(ValueError):
    """`TOKENPIPE_FAULT` could not be parsed."""


@dataclass(frozen=True)
class FaultRule:
    kind: str
    point: str
    first: int  # 1-based hit number; 0 with last == 0 means every hit
    last: int
    arg: float = 0.0

    def matches(self, hit: int) -> bool:
        if self.first == 0 and self.last == 0:
            return True
        return self.first <= hit <= self.last


def parse_faults(spec: str) -> tuple[FaultRule, ...]:
    """Pure: the rules of a `TOKENPIPE_FAULT` value (empty string: none)."""
    rules: list[FaultRule] = []
    for raw in spec.split(","):
        raw = raw.strip()
        if not raw:
            continue
        parts = raw.split(":")
        if len(parts) not in (2, 3):
            raise FaultSpecError(f"{ENV}: expected KIND[@POINT]:WHEN[:ARG], got {raw!r}")
        kind, _, point = parts[0].partition("@")
        point = point or "forward"
        if kind not in KINDS:
            raise FaultSpecError(f"{ENV}: unknown fault {kind!r} (known: {sorted(KINDS)})")
        when = parts[1]
        try:
            if when == "*":
                first = last = 0
            elif "-" in when:
                lo, hi = when.split("-", 1)
                first, last = int(lo), int(hi)
            else:
                first = last = int(when)
            arg = float(parts[2]) if len(parts) == 3 else 0.0
        except ValueError:
            raise FaultSpecError(f"{ENV}: bad hit number or argument in {raw!r}") from None
        if when != "*" and (first < 1 or last < first):
            raise FaultSpecError(f"{ENV}: hit numbers start at 1, got {raw!r}")
        rules.append(FaultRule(kind, point, first, last, arg))
    return tuple(rules)


def _out_of_memory(point: str, hit: int) -> BaseException:
    message = f"CUDA out of memory (injected by {ENV} at {point} #{hit})"
    try:
        import torch

        return torch.OutOfMemoryError(message)
    except (ImportError, AttributeError):
        return MemoryError(message)


class FaultInjector:
    """Counts hits per point and applies the matching rules."""

    def __init__(self, rules: tuple[FaultRule, ...]) -> None:
        self.rules = rules
        self.hits: Counter[str] = Counter()

    def inject(self, point: str) -> None:
        if not self.rules:
            return
        self.hits[point] += 1
        hit = self.hits[point]
        for rule in self.rules:
            if rule.point != point or not rule.matches(hit):
                continue
            print(f"[tokenpipe faults] {rule.kind} at {point} #{hit}", file=sys.stderr, flush=True)
            if rule.kind == "sleep":
                time.sleep(rule.arg)
            elif rule.kind == "oom":
                raise _out_of_memory(point, hit)
            elif rule.kind == "exit":
                os._exit(EXIT_STATUS)
            elif rule.kind == "close_stdout":
                sys.stdout.flush()
                os.close(1)
            elif rule.kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)


_injector: FaultInjector | None = None
_arm_path: str | None = None


def injector() -> FaultInjector:
    """The process's injector, built from the environment on first use."""
    global _injector, _arm_path
    if _injector is None:
        _injector = FaultInjector(parse_faults(os.environ.get(ENV, "")))
        _arm_path = os.environ.get(FILE_ENV) or None
    return _injector


def _take_armed(path: str) -> FaultInjector | None:
    try:
        taken = f"{path}.{os.getpid()}"
        os.rename(path, taken)  # atomic: one process wins
    except OSError:
        return None
    try:
        with open(taken, encoding="utf-8") as spec:
            rules = parse_faults(spec.read())
    finally:
        os.unlink(taken)
    print(f"[tokenpipe faults] armed: {rules}", file=sys.stderr, flush=True)
    return FaultInjector(parse_faults(os.environ.get(ENV, "")) + rules)


def maybe_inject(point: str) -> None:
    """One hit of `point` (what `FaultyModel` calls before each forward)."""
    global _injector
    current = injector()
    if _arm_path is not None and os.path.exists(_arm_path):
        armed = _take_armed(_arm_path)
        if armed is not None:
            _injector = current = armed
    current.inject(point)


class FaultyModel:
    """The engine's model as `python -m worker.faults` runs it: every call hits the
    `forward` point first, then calls the model. Everything else is the model's."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        maybe_inject("forward")
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _wrap_built_engines() -> None:
    """Make `worker.main.build_engine` hand back engines whose model is a `FaultyModel`."""
    import worker.main as worker_main

    build = worker_main.build_engine

    def build_engine(*args: Any, **kwargs: Any) -> object:
        engine = build(*args, **kwargs)
        engine.model = FaultyModel(engine.model)  # type: ignore[attr-defined]
        return engine

    worker_main.build_engine = build_engine


def main() -> None:
    """`python -m worker.faults ARGS...`: `tokenpipe worker ARGS...` with the forward hook."""
    try:
        injector()  # a bad spec fails before the model loads
    except FaultSpecError as exc:
        print(f"[tokenpipe faults] {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    _wrap_built_engines()
    from worker.main import command

    command.main(args=sys.argv[1:], prog_name="tokenpipe-worker-faults")


if __name__ == "__main__":
    main()
