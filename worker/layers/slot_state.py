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
    # the tiers' pinned buffer (worker/engine/host_pool.py) the tensors are views of, or None
    buffer: Any = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def retain(self) -> None:
        """One more holder of the state's buffer (the host tier and the disk writer)."""
        if self.buffer is not None:
            self.buffer.retain()

    def release(self, ready: Any = None) -> None:
        """A holder is done with the state; ``ready``: the CUDA event after the last copy
        that reads it. Its tensors must not be used by that holder afterwards."""
        if self.buffer is not None:
            self.buffer.release(ready)


def to_host(
    tensors: dict[str, torch.Tensor], buffer: Any = None
) -> tuple[dict[str, torch.Tensor], Any]:
    """Copies on the host and the buffer they are views of: laid into ``buffer`` (a
    ``HostBuffer`` the caller holds) when it is big enough, else into fresh pageable memory
    (None; the caller still holds ``buffer``). Asynchronous from CUDA with one sync at the end;
    plain copies on the CPU (the slot is reused, so a view would not do)."""
    from worker.engine.host_pool import lay_out

    offsets, used = lay_out(tensors)
    if buffer is not None and used > buffer.nbytes:
        buffer = None
    out: dict[str, torch.Tensor] = {}
    cuda = False
    for name, t in tensors.items():
        if buffer is not None:
            nbytes = t.numel() * t.element_size()
            raw = buffer.data[offsets[name] : offsets[name] + nbytes]
            host = raw.view(t.dtype).view(t.shape)
        else:
            host = torch.empty(t.shape, dtype=t.dtype)
        cuda = cuda or t.is_cuda
        host.copy_(t, non_blocking=t.is_cuda)
        out[name] = host
    if cuda:
        torch.cuda.synchronize()
    return out, buffer
