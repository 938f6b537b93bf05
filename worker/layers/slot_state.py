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


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies on the host: pinned and asynchronous from CUDA (one sync at the end), plain
    clones on the CPU (the slot is reused, so a view would not do)."""
    out: dict[str, torch.Tensor] = {}
    cuda = False
    for name, t in tensors.items():
        if t.is_cuda:
            cuda = True
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out[name] = host
        else:
            out[name] = t.clone()
    if cuda:
        torch.cuda.synchronize()
    return out
