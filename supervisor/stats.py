"""The `stats` answer: every worker's own stats plus what the supervisor sees of each process
(state, pid, queue, sessions, restarts, uptime, RSS, GPU memory), and the totals."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from typing import Any

import psutil

from supervisor.flight import ClientSink, Inflight
from supervisor.router import WorkerState
from supervisor.state import SupervisorState


async def answer_stats(state: SupervisorState, channel: ClientSink, flight: Inflight) -> None:
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[dict[str, Any]]] = []
    for slot in state.slots:
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        futures.append(future)
        if slot.state is WorkerState.READY and slot.process is not None:
            internal = state.internal(
                slot,
                {"op": "stats"},
                "",
                lambda ev, f=future: f.done() or f.set_result(ev.get("stats") or {}),
            )
            state.send(slot, internal, {"op": "stats"})
        else:
            future.set_result({})
    try:
        answers = await asyncio.wait_for(asyncio.gather(*futures), 10.0)
    except asyncio.TimeoutError:
        answers = [f.result() if f.done() else {} for f in futures]
    gpu = (
        await loop.run_in_executor(None, gpu_memory_by_pid)
        if any(s.spec.device != "cpu" for s in state.slots)
        else {}
    )
    now = time.monotonic()
    workers = []
    totals = {
        "active_requests": 0,
        "queued_requests": 0,
        "sessions": 0,
        "free_slots": 0,
        "rss_bytes": 0,
    }
    for slot, worker_stats in zip(state.slots, answers, strict=True):
        pid = slot.process.pid if slot.process is not None and slot.process.alive else None
        rss = process_rss(pid)
        entry: dict[str, Any] = {
            "index": slot.index,
            "state": slot.state.value,
            "pid": pid,
            "device": slot.spec.device,
            "queue_depth": len(slot.inflight),
            "named_sessions": sorted(slot.named),
            "restarts": slot.restarts,
            "uptime_s": round(now - slot.process.started_at, 3)
            if pid is not None and slot.process is not None
            else 0.0,
            "rss_bytes": rss,
            "worker": worker_stats,
        }
        if pid is not None and pid in gpu:
            entry["gpu_memory_bytes"] = gpu[pid]
        workers.append(entry)
        for key in ("active_requests", "queued_requests", "sessions", "free_slots"):
            value = worker_stats.get(key)
            if isinstance(value, int):
                totals[key] += value
        totals["rss_bytes"] += rss
    stats = {
        **totals,
        "workers": workers,
        "supervisor": {
            "pid": os.getpid(),
            "rss_bytes": process_rss(os.getpid()),
            "uptime_s": round(now - state.started_at, 3),
            "event_loop": "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio",
            # client requests taken and not yet answered, queued id-less ones included (not
            # counting this stats request)
            "requests_in_flight": sum(
                len(c.by_client_id) + len(c.anonymous) + c.anonymous_busy for c in state.channels
            )
            - 1,
            "sessions": len(state.placements)
            + len([s for s in state.needs_rebuild if s not in state.placements]),
        },
    }
    if flight.worker < 0:
        state.answer(channel, flight, {"event": "stats", "stats": stats})


def process_rss(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, OSError):
        return 0


def gpu_memory_by_pid() -> dict[int, int]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run(
            [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    usage: dict[int, int] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            usage[int(parts[0])] = int(parts[1]) * 1024 * 1024
    return usage
