"""Page-locked host buffers for the session tiers, allocated once at start.

Pinning host memory is slow and stalls the GPU: ``cudaHostAlloc`` ran at ~1.9 GB/s on the H200
host, so a 1.5 GB session state (Gemma 4 31B, 8k tokens) pinned on demand cost ~0.8 s inside
whatever request needed it. ``HostPool`` pins ``--host-cache-gb`` worth of state-sized buffers
once, on the engine thread before the CUDA graphs are captured or after, never concurrently;
offloads, idle saves and session reads then take a buffer and give it back (``release``) when
nobody holds it any more. No path pins memory after start: without a free buffer a copy goes to
pageable memory (slower to move, never a stall).

A buffer is reference counted: one state may be held by the host tier and by the disk writer at
once (an offload that takes an idle save's copy). It goes back to the free list when the count
drops to zero; ``ready`` is the CUDA event of the last device copy that reads it (an import),
waited for before the buffer is written again. On the CPU the buffers are plain memory and the
same logic runs (tested there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch

ALIGN = 256  # bytes: every tensor laid into a buffer starts at a multiple of this


class HostBuffer:
    """One state-sized buffer of the pool: ``data`` is uint8 [nbytes]."""

    def __init__(self, pool: HostPool, data: torch.Tensor, index: int) -> None:
        self.pool = pool
        self.data = data
        self.index = index
        self.holders = 0
        self.ready: torch.cuda.Event | None = None  # the last device copy reading it

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def retain(self) -> None:
        with self.pool.lock:
            if self.holders <= 0:
                raise RuntimeError(f"host buffer {self.index} retained while free")
            self.holders += 1

    def release(self, ready: torch.cuda.Event | None = None) -> None:
        """One holder lets go; ``ready``: the event after a device copy reading the buffer."""
        self.pool._release(self, ready)


class HostPool:
    """``count`` buffers of ``buffer_bytes`` each (0 buffers: every copy is pageable)."""

    def __init__(
        self,
        buffer_bytes: int,
        count: int,
        pinned: bool,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.buffer_bytes = max(0, buffer_bytes)
        self.pinned = pinned
        self.lock = threading.Lock()
        self.buffers: list[HostBuffer] = []
        self._free: list[HostBuffer] = []
        self.misses = 0  # copies that found no free buffer (pageable memory instead)
        started = time.perf_counter()
        for index in range(count if self.buffer_bytes > 0 else 0):
            data = _allocate(self.buffer_bytes, pinned)
            buffer = HostBuffer(self, data, index)
            self.buffers.append(buffer)
            self._free.append(buffer)
            if progress is not None and pinned and (index + 1) % 4 == 0 and index + 1 < count:
                progress(f"host cache: pinned {index + 1} of {count} buffers")
        self.pin_seconds = time.perf_counter() - started

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        buffer_bytes: int,
        pinned: bool,
        progress: Callable[[str], None] | None = None,
    ) -> HostPool:
        """As many buffers of ``buffer_bytes`` (a whole slot's state laid out, ``lay_out``)
        as ``budget_bytes`` holds."""
        count = budget_bytes // buffer_bytes if buffer_bytes > 0 else 0
        return cls(buffer_bytes, count, pinned, progress)

    @property
    def total_bytes(self) -> int:
        return self.buffer_bytes * len(self.buffers)

    @property
    def free(self) -> int:
        with self.lock:
            return len(self._free)

    def take(self, nbytes: int, wait: bool = True, count_miss: bool = True) -> HostBuffer | None:
        """A free buffer of at least ``nbytes`` (held once, safe to write: the last device copy
        that read it has finished), or None (none free, or ``nbytes`` too large). Without
        ``wait`` (threads other than the engine's: no CUDA call, a graph may be capturing)
        only a buffer no device copy has read since it was last waited for. ``count_miss``:
        a None counts in ``misses`` (a copy goes to pageable memory); callers that try again
        or only look for idle work pass False and count with ``miss``."""
        with self.lock:
            free = self._free if wait else [b for b in self._free if b.ready is None]
            if nbytes > self.buffer_bytes or not free:
                self.misses += count_miss
                return None
            buffer = free[-1]
            self._free.remove(buffer)
            buffer.holders = 1
            ready, buffer.ready = buffer.ready, None
        if ready is not None:
            ready.synchronize()
        return buffer

    def miss(self) -> None:
        """A copy that found no buffer after all (``take(count_miss=False)`` and its retries)."""
        with self.lock:
            self.misses += 1

    def _release(self, buffer: HostBuffer, ready: torch.cuda.Event | None) -> None:
        with self.lock:
            if buffer.holders <= 0:
                raise RuntimeError(f"host buffer {buffer.index} released while free")
            if ready is not None:
                buffer.ready = ready
            buffer.holders -= 1
            if buffer.holders == 0:
                self._free.append(buffer)

    def stats(self) -> dict[str, int | float]:
        with self.lock:
            free = len(self._free)
        return {
            "host_pool_buffers": len(self.buffers),
            "host_pool_free": free,
            "host_pool_buffer_bytes": self.buffer_bytes,
            "host_pool_misses": self.misses,
            "host_pool_pin_ms": round(self.pin_seconds * 1000, 1),
        }


def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    """uint8 [nbytes]: page-locked when ``pinned``. Pinned through ``cudaHostRegister`` on
    memory whose pages were first touched by all of torch's threads (the kernel zeroes pages
    on first touch; one thread did ~2 GB/s), falling back to torch's pinned allocator, which
    rounds every block up to a power of two (a 1.52 GB state took 2 GB)."""
    if not pinned:
        return torch.empty(nbytes, dtype=torch.uint8)
    data, registered = registered_buffer(nbytes)
    return data if registered else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def registered_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """uint8 [nbytes] in host memory, its pages first touched by all of torch's threads, and
    whether ``cudaHostRegister`` page-locked it (the owner then unregisters it before it goes:
    ``cudaHostUnregister``)."""
    data = torch.zeros(nbytes, dtype=torch.uint8)  # first touch, in parallel
    cudart = torch.cuda.cudart()
    return data, int(cudart.cudaHostRegister(data.data_ptr(), nbytes, 0)) == 0


def lay_out(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Each tensor's byte offset in a buffer (``ALIGN``-aligned, in order) and the bytes used."""
    at, end = aligned_offsets(t.numel() * t.element_size() for t in tensors.values())
    return dict(zip(tensors, at, strict=True)), end


def aligned_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Byte offsets of pieces of these sizes laid one after another in a buffer, each
    ``ALIGN``-aligned, and the bytes used."""
    at: list[int] = []
    end = 0
    for size in sizes:
        at.append(end)
        end += -(-size // ALIGN) * ALIGN
    return at, end
