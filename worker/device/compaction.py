"""A loaded model's device tensors moved out through the host and back, so they lie end to end.

Loading a quantized model leaves holes between its weights: the merged projections are
concatenated while their parts are alive, and ``pack_for_device`` writes each weight's K-major
copy before it drops the canonical one. After a Gemma 4 31B Q4_K_M loaded under a 23.5 GiB
limit, 271 MiB lay free in ~140 pieces, the largest 14.6 MiB: 9 MiB after the chunked GGUF
repack, 177 after the merge, 271 after the packing (BENCHMARKS.md, sessions 40-41).
``empty_cache`` does not return them (measured): they sit in pages of the expandable segment
that live tensors share. A KV cache or a 64 MiB prefill scratch fits in none of them.

``compact`` copies every storage the model's modules hold on the device into one host buffer,
frees the device copies, and copies them back one after another into the emptied segment. A
storage some other object also holds (``torch._C._storage_Use_Count`` says so) stays where it
is: moving it would leave two copies. The worker runs it where ``TOKENPIPE_COMPACT=1``
(``wanted``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

SETTING = "TOKENPIPE_COMPACT"
"""1: move a quantized model's weights end to end after packing them (off by default:
``wanted``)."""

MIN_HOLES_BYTES = 64 << 20
"""Holes below this are not worth a trip through the host (the prefill scratch's size)."""

HOST_HEADROOM = 1.25
"""The host must have this many times the moved bytes available, or nothing moves."""


def holes(device: Any) -> int:
    """Bytes the allocator has mapped on `device` that no tensor holds, after ``empty_cache``
    returned whatever it could."""
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors_in(getattr(value, field.name), depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth + 1)


def device_tensors(model: torch.nn.Module, device: torch.device) -> list[torch.Tensor]:
    """Every tensor object `model`'s modules hold on `device`, each once: parameters, buffers,
    and tensors in plain attributes, in dataclasses there (the packed weights) and in lists or
    tuples of them; and the base a view keeps alive (``_base``), which holds its storage too."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values()]
        held += [v for k, v in vars(module).items() if k not in ("_parameters", "_buffers")]
        for value in held:
            for tensor in _tensors_in(value):
                while tensor is not None and tensor.device == device and tensor.numel() > 0:
                    found.setdefault(id(tensor), tensor)
                    tensor = tensor._base
    return list(found.values())


def _viewed(tensor: torch.Tensor, storage: torch.UntypedStorage, at: int = 0) -> torch.Tensor:
    """`tensor`'s view (offset, shape, strides, dtype) over `storage` from byte `at` on."""
    out = torch.empty(0, dtype=tensor.dtype, device=storage.device)
    offset = at // tensor.element_size() + tensor.storage_offset()
    return out.set_(storage, offset, tensor.shape, tensor.stride())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


Group = tuple[torch.UntypedStorage, list[torch.Tensor]]
"""A storage and the tensor objects that view it."""


def movable(model: torch.nn.Module, device: torch.device) -> tuple[list[Group], int]:
    """`model`'s storages on `device` with the tensor objects viewing them, and how many
    storages stay because something else also holds them. None of them stays where this torch
    cannot count a storage's users (``torch._C._storage_Use_Count``): all are kept."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    groups: dict[int, list[torch.Tensor]] = {}
    for tensor in device_tensors(model, device):
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    if use_count is None:
        return [], len(groups)
    found: list[Group] = []
    for tensors in groups.values():
        storage = tensors[0].untyped_storage()
        # one use a tensor object, one this handle: anything more is a holder we cannot see
        if use_count(storage._cdata) == len(tensors) + 1:
            found.append((storage, tensors))
    return found, len(groups) - len(found)


def offsets(groups: list[Group]) -> tuple[list[int], int]:
    """Each storage's byte offset in one buffer (``host_pool.ALIGN``-aligned, in order) and the
    buffer's size."""
    from worker.engine.host_pool import aligned_offsets

    return aligned_offsets(storage.nbytes() for storage, _ in groups)


def into_buffer(
    groups: list[Group], buffer: torch.Tensor, at: list[int], pinned: bool = False
) -> None:
    """Every storage copied into uint8 `buffer` at its offset (asynchronously where the buffer
    is `pinned`, then waited for), and its tensor objects pointed there (so every reference to
    them follows); the old storages go once `groups` does."""
    for (storage, _), start in zip(groups, at, strict=True):
        buffer[start : start + storage.nbytes()].copy_(_bytes(storage), non_blocking=pinned)
    if pinned:
        torch.cuda.synchronize()
    whole = buffer.untyped_storage()
    for (_, tensors), start in zip(groups, at, strict=True):
        for tensor in tensors:
            tensor.data = _viewed(tensor, whole, start + buffer.storage_offset())


def out_of_buffer(
    placed: list[tuple[int, list[torch.Tensor]]], buffer: torch.Tensor, at: list[int],
    device: torch.device, pinned: bool = False,
) -> None:  # fmt: skip
    """The reverse of ``into_buffer``, for each storage's size and tensor objects: its bytes
    copied from `buffer` into a storage of its own on `device`, one after another, its tensor
    objects pointed at it."""
    for (nbytes, tensors), start in zip(placed, at, strict=True):
        copy = torch.empty(nbytes, dtype=torch.uint8, device=device)
        copy.copy_(buffer[start : start + nbytes], non_blocking=pinned)
        for tensor in tensors:  # its offset counted from the buffer's storage until now
            tensor.data = _viewed(tensor, copy.untyped_storage(), -start - buffer.storage_offset())


@dataclasses.dataclass
class Compaction:
    moved_bytes: int  # the storages that went through the host
    storages: int
    kept: int  # storages another object also holds, left in place
    holes_before: int
    holes_after: int
    seconds: float
    pinned: bool  # the host buffer was page-locked (copies at the bus's speed)


def compact(model: torch.nn.Module, device: Any) -> Compaction | None:
    """Move the device storages of `model`'s tensors into one host buffer (page-locked where
    ``cudaHostRegister`` takes it: ``host_pool.registered_buffer``) and back, in order; None
    where the host lacks the room."""
    import psutil

    from worker.engine.host_pool import registered_buffer

    device = torch.device(device)
    started = time.monotonic()
    before = holes(device)
    groups, kept = movable(model, device)
    at, total = offsets(groups)
    if total * HOST_HEADROOM > psutil.virtual_memory().available:
        return None
    buffer, pinned = registered_buffer(total)
    into_buffer(groups, buffer, at, pinned)
    placed = [(storage.nbytes(), tensors) for storage, tensors in groups]
    del groups  # the last handles on the device copies
    torch.cuda.empty_cache()
    out_of_buffer(placed, buffer, at, device, pinned)
    torch.cuda.synchronize(device)
    if pinned:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    del buffer
    seconds = round(time.monotonic() - started, 3)
    return Compaction(total, len(placed), kept, before, holes(device), seconds, pinned)


def wanted(device: Any) -> tuple[bool, str | None]:
    """Whether to compact after the weights are packed (``TOKENPIPE_COMPACT=1``), and a line
    for the start-up's log: where it is off but the holes are at least ``MIN_HOLES_BYTES`` and
    memory is tight (what tensors could still get, under ``--gpu-memory-gb`` its limit's, is
    less than the weights hold, as on a 24-32 GB card), what the setting would return. Off by
    default: the trip through the host takes 4.1-4.8 s for 20.5 GB of a 31B GGUF's weights
    (page-locked; 18.9 s pageable) to win 0.26 GiB (BENCHMARKS.md, session 41)."""
    setting = os.environ.get(SETTING, "")
    if setting == "1":
        return True, f"{SETTING}=1"
    if setting == "0":
        return False, None
    from worker.device import memory

    gaps = holes(device)
    held, free = torch.cuda.memory_allocated(device), memory.unallocated_bytes(device)
    if gaps < MIN_HOLES_BYTES or free >= held:
        return False, None
    return False, (
        f"{gaps / memory.GIB:.2f} GiB lie in holes between the {held / memory.GIB:.2f} GiB of "
        f"weights ({free / memory.GIB:.2f} GiB free beside them): {SETTING}=1 returns them, "
        "moving the weights end to end through host memory at start-up"
    )
