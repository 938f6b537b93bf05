"""One slot's cache taken off the device: what the tiers keep in host memory and on disk.

A ``SlotState`` is produced by a cache's ``export_slot(slot, tokens)`` and put back, into any
free slot of a cache of the same geometry, by ``import_slot(slot, state)``. It holds exactly
the entries that describe the slot's first ``tokens`` tokens (a full layer's first ``tokens``
positions, a sliding layer's whole ring in ring order, a DeltaNet layer's live state and
snapshots), so export, import and a forward continue bit for bit where the slot stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SlotState:
    """Named tensors (on the host after an export) and plain JSON-able metadata."""

    tokens: int  # the slot's cached length it describes
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


_ALIGN = 64  # bytes: every tensor of a state starts aligned in its shared buffer


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies on the host: from CUDA, views of one pinned buffer filled asynchronously (one
    sync at the end; one allocation per state, so the allocator's cached blocks serve the next
    state of a similar size: pinning fresh memory costs ~0.55 s a GB); on the CPU, plain clones
    (the slot is reused, so a view would not do)."""
    on_cuda = [t for t in tensors.values() if t.is_cuda]
    if not on_cuda:
        return {name: t.clone() for name, t in tensors.items()}
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes.values())
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, t in tensors.items():
        host = buffer[offset : offset + sizes[name]].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        out[name] = host
        offset += -(-sizes[name] // _ALIGN) * _ALIGN
    torch.cuda.synchronize()
    return out


def warm_pinned(nbytes: int, count: int) -> None:
    """Pin ``count`` buffers of ``nbytes`` and free them: the CUDA host allocator keeps them,
    so the first offloads (``to_host``) of states up to that size find pinned memory ready.
    Meant for a background thread at start."""
    buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    del buffers
