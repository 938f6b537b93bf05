"""Safetensors -> device parameters through reused (pinned) staging buffers, reads overlapped
with copies: the CUDA load path.

    for name, param in staged_tensors(entries, targets, StagingConfig()):
        ...  # `param` is the target itself; its bytes may still be in flight on the stream

The byte ranges of the tensors, in file order, are cut into batches of at most
`buffer_bytes` (`plan_batches`, pure). Reader threads fill staging buffer `i % buffers` with
batch `i` (`os.preadv`, no memory map, nothing on the host but the staging buffers) while
the calling thread issues batch `i - 1`'s copies, `non_blocking`, straight into the bytes of
each parameter. A buffer is read into again only after the CUDA event recorded behind its
last copies has completed (on the CPU a copy is finished when `copy_` returns), so at most
`buffers` batches are in flight and peak host memory is the staging buffers plus Python.

A tensor whose target has another dtype (an fp32 checkpoint into a bf16 model) goes through
a device temporary of the piece's bytes and a cast there; one without a target (a tied
`lm_head`, names the model ignores) is yielded as a meta tensor of its shape, so the model's
`load_weights` can skip or report it without reading its bytes.

Where a load's time goes (`StagingStats`, filled when one is passed): the calling thread's
waits for a batch's bytes, its wait at the end for the device's last work, the model's own
time with each tensor it was handed (a quantizing load's fits are launched there), and the
readers' time in `preadv` and waiting for the device to finish with a buffer. The loader
prints them, so a slow load says whether the disk, the device's copies and fits, or the
host's own work bounds it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from worker.loading.checkpoint import SAFETENSORS_DTYPES, ModelLoadError, TensorEntry

# Every cut inside a tensor falls on a multiple of this many bytes (the widest element), so a
# piece of a tensor that is cast on the device holds whole elements.
CUT_ALIGN = 8


@dataclass(frozen=True)
class StagingConfig:
    """How the CUDA load stages its reads. Host memory: `buffers * buffer_bytes` pinned."""

    buffer_bytes: int = 64 << 20
    buffers: int = 6
    readers: int = 3

    def __post_init__(self) -> None:
        if self.buffer_bytes < CUT_ALIGN or self.buffer_bytes % CUT_ALIGN:
            raise ValueError(f"buffer_bytes must be a positive multiple of {CUT_ALIGN}")
        if self.buffers < 2:
            raise ValueError("at least 2 staging buffers are needed to overlap reads and copies")
        if not 1 <= self.readers <= self.buffers:
            raise ValueError("readers must be between 1 and the number of buffers")

    @classmethod
    def from_env(cls, value: str | None = None) -> StagingConfig:
        """TOKENPIPE_LOAD_STAGING="MiB,buffers,readers" (e.g. "64,6,3"), else the defaults."""
        value = os.environ.get("TOKENPIPE_LOAD_STAGING") if value is None else value
        if not value:
            return cls()
        try:
            mib, buffers, readers = (int(part) for part in value.split(","))
        except ValueError:
            raise ValueError(
                f"TOKENPIPE_LOAD_STAGING={value!r}: expected MiB,buffers,readers"
            ) from None
        return cls(buffer_bytes=mib << 20, buffers=buffers, readers=readers)


@dataclass
class StagingStats:
    """Seconds a staged load spent, by where (see the module docstring). `reading` and
    `device_wait` are summed over the reader threads, so they may exceed the wall time."""

    batch_wait: float = 0.0  # the calling thread, waiting for a batch's bytes to be read
    model: float = 0.0  # the calling thread, inside the consumer between two tensors
    reading: float = 0.0  # readers in os.preadv
    device_wait: float = 0.0  # readers waiting for a buffer's copies (and the work before them)
    drain: float = 0.0  # the calling thread, at the end: the device's last copies and work
    readers: int = 0  # set by `staged_tensors` from its config

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add_reader(self, reading: float, device_wait: float) -> None:
        with self._lock:
            self.reading += reading
            self.device_wait += device_wait

    def as_dict(self) -> dict[str, float]:
        return {field.name: round(getattr(self, field.name), 3) for field in fields(self)}

    def describe(self) -> str:
        return (
            f"waited {self.batch_wait:.1f}s for reads, the model's own work {self.model:.1f}s, "
            f"the device's last work {self.drain:.1f}s; {self.readers} readers: "
            f"{self.reading:.1f}s reading, {self.device_wait:.1f}s waiting for the device to "
            "free a buffer"
        )


@dataclass(frozen=True)
class Piece:
    """A byte range of one tensor: `length` bytes from `file_offset` in its file land at
    `staging_offset` in the staging buffer and go to `tensor_offset` in the tensor."""

    tensor: int  # index into the list of entries being loaded
    file_offset: int
    tensor_offset: int
    staging_offset: int
    length: int
    last: bool  # the tensor's last piece: once issued, the tensor can be yielded


def plan_batches(entries: Sequence[TensorEntry], buffer_bytes: int) -> list[list[Piece]]:
    """Cut `entries` (in the order given) into batches whose pieces fill at most
    `buffer_bytes` of a staging buffer, back to back. A tensor larger than the room left is
    cut at multiples of CUT_ALIGN bytes. Empty tensors get one empty piece."""
    batches: list[list[Piece]] = []
    batch: list[Piece] = []
    fill = 0
    for index, entry in enumerate(entries):
        size = entry.end - entry.begin
        done = 0
        while True:
            room = buffer_bytes - fill
            take = size - done
            if take > room:
                take = room // CUT_ALIGN * CUT_ALIGN
                if take == 0:  # no whole aligned piece fits: start a fresh buffer
                    batches.append(batch)
                    batch, fill = [], 0
                    continue
            last = done + take == size
            batch.append(Piece(index, entry.begin + done, done, fill, take, last))
            fill += take
            done += take
            if last:
                break
        if fill >= buffer_bytes:
            batches.append(batch)
            batch, fill = [], 0
    if batch:
        batches.append(batch)
    return batches


def _read_runs(pieces: Sequence[Piece], entries: Sequence[TensorEntry]) -> list[Piece]:
    """Pieces merged where they are back to back both in one file and in the staging buffer,
    so a run of small tensors is one read (the merged piece's `tensor` names its file)."""
    runs: list[Piece] = []
    for piece in pieces:
        if runs:
            prev = runs[-1]
            if (
                entries[prev.tensor].file == entries[piece.tensor].file
                and prev.file_offset + prev.length == piece.file_offset
                and prev.staging_offset + prev.length == piece.staging_offset
            ):
                runs[-1] = Piece(
                    prev.tensor, prev.file_offset, 0, prev.staging_offset,
                    prev.length + piece.length, False,
                )  # fmt: skip
                continue
        runs.append(piece)
    return runs


class _Files:
    """One read-only descriptor per file, shared by the reader threads (pread needs no seek)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _read_batch(
    pieces: Sequence[Piece],
    entries: Sequence[TensorEntry],
    staging: memoryview,
    files: _Files,
    reusable: torch.cuda.Event | None,
    stats: StagingStats | None = None,
) -> None:
    """Reader thread: wait until the buffer's previous copies are done, then fill it."""
    started = time.perf_counter()
    if reusable is not None:
        reusable.synchronize()
    waited = time.perf_counter()
    for run in _read_runs(pieces, entries):
        path = entries[run.tensor].file
        fd = files.fd(path)
        filled = 0
        while filled < run.length:
            start = run.staging_offset + filled
            count = os.preadv(fd, [staging[start : run.staging_offset + run.length]],
                              run.file_offset + filled)  # fmt: skip
            if count <= 0:
                raise ModelLoadError(f"{path}: truncated while reading at byte {run.file_offset}")
            filled += count
    if stats is not None:
        device_wait = waited - started if reusable is not None else 0.0
        stats.add_reader(time.perf_counter() - waited, device_wait)


def _issue_copies(
    pieces: Sequence[Piece],
    entries: Sequence[TensorEntry],
    targets: Sequence[torch.Tensor | None],
    staging: torch.Tensor,
) -> None:
    """Copy every piece from the staging buffer into its target (asynchronous on CUDA)."""
    for piece in pieces:
        if piece.length == 0:
            continue
        target = targets[piece.tensor]
        assert target is not None
        source = staging[piece.staging_offset : piece.staging_offset + piece.length]
        stored = SAFETENSORS_DTYPES[entries[piece.tensor].dtype][0]
        if target.dtype == stored:
            flat = target.view(-1).view(torch.uint8)
            flat[piece.tensor_offset : piece.tensor_offset + piece.length].copy_(
                source, non_blocking=True
            )
            continue
        # another dtype: the piece's bytes to the device, then cast there (whole elements)
        on_device = source.to(target.device, non_blocking=True, copy=True).view(stored)
        first = piece.tensor_offset // stored.itemsize
        target.view(-1)[first : first + on_device.numel()].copy_(on_device)


def _usable(entry: TensorEntry, target: torch.Tensor | None) -> bool:
    return (
        target is not None
        and not target.is_meta
        and target.is_contiguous()
        and tuple(target.shape) == entry.shape
    )


def staged_tensors(
    entries: Mapping[str, TensorEntry],
    targets: Mapping[str, torch.Tensor],
    config: StagingConfig | None = None,
    transient: Mapping[str, torch.dtype] | None = None,
    device: torch.device | None = None,
    stats: StagingStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, target)` for every entry (name -> where its bytes are), after its bytes
    were issued into `targets[name]` (all on one device). See the module docstring.

    Entries without a usable target (none, or another shape) are yielded as meta tensors of
    the stored dtype and shape, except the names in `transient` (name -> dtype): each of
    those gets a tensor of its own on `device` when its first bytes are issued, dropped here
    once yielded (a weight quantized as it streams in: only the tensors in flight are ever
    float on the device). On CUDA the copies are ordered on the current stream, and the
    generator synchronises it before it finishes. `stats`, when given, is filled as it goes.
    """
    config = config or StagingConfig.from_env()
    transient = transient or {}
    if stats is not None:
        stats.readers = config.readers
    ordered = sorted(entries.items(), key=lambda kv: (str(kv[1].file), kv[1].begin))

    def loads(name: str, entry: TensorEntry) -> bool:
        return _usable(entry, targets.get(name)) or (name in transient and name not in targets)

    names = [name for name, entry in ordered if loads(name, entry)]
    skipped = [(name, entry) for name, entry in ordered if not loads(name, entry)]
    for name, entry in skipped:
        stored = SAFETENSORS_DTYPES[entry.dtype][0]
        yield name, torch.empty(entry.shape, dtype=stored, device="meta")
    if not names:
        return
    load_entries = [entries[name] for name in names]
    load_targets: list[torch.Tensor | None] = [
        None if name in transient and name not in targets else targets[name].detach()
        for name in names
    ]
    known = next((t.device for t in load_targets if t is not None), None)
    device = known or device
    if device is None:
        raise ValueError("staged_tensors: transient targets need a device")
    on_cuda = device.type == "cuda"
    batches = plan_batches(load_entries, config.buffer_bytes)
    largest = max(sum(p.length for p in batch) for batch in batches)
    size = max(CUT_ALIGN, min(config.buffer_bytes, largest))
    buffer_count = min(config.buffers, len(batches))
    staging = [
        torch.empty(size, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(buffer_count)
    ]
    views = [memoryview(buffer.numpy()) for buffer in staging]
    copied: list[torch.cuda.Event | None] = [None] * buffer_count
    stream = torch.cuda.current_stream(device) if on_cuda else None
    files = _Files()
    pool = ThreadPoolExecutor(max_workers=config.readers, thread_name_prefix="load-reader")
    reads: list[Future[None]] = []
    try:
        for index, batch in enumerate(batches):
            # keep `buffer_count` reads in flight; batch j reuses the buffer of batch j - count,
            # whose copies were issued (j - count < index) and recorded in `copied`
            while len(reads) < len(batches) and len(reads) < index + buffer_count:
                slot = len(reads) % buffer_count
                reads.append(
                    pool.submit(
                        _read_batch,
                        batches[len(reads)],
                        load_entries,
                        views[slot],
                        files,
                        copied[slot],
                        stats,
                    )  # fmt: skip
                )
            waiting = time.perf_counter()
            reads[index].result()
            if stats is not None:
                stats.batch_wait += time.perf_counter() - waiting
            slot = index % buffer_count
            for piece in batch:
                if load_targets[piece.tensor] is None:  # a transient target's first bytes
                    entry, name = load_entries[piece.tensor], names[piece.tensor]
                    load_targets[piece.tensor] = torch.empty(
                        entry.shape, dtype=transient[name], device=device
                    )
            _issue_copies(batch, load_entries, load_targets, staging[slot])
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                copied[slot] = event
            for piece in batch:
                if piece.last:
                    name = names[piece.tensor]
                    if name in targets:
                        tensor: torch.Tensor | None = targets[name]
                    else:  # a transient: dropped here once the consumer is done with it
                        tensor, load_targets[piece.tensor] = load_targets[piece.tensor], None
                    assert tensor is not None
                    handed = time.perf_counter()
                    yield name, tensor
                    if stats is not None:
                        stats.model += time.perf_counter() - handed
        if stream is not None:
            draining = time.perf_counter()
            stream.synchronize()
            if stats is not None:
                stats.drain = time.perf_counter() - draining
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        files.close()
        del staging, views
        if on_cuda:
            _release_pinned_cache()


def _release_pinned_cache() -> None:
    """Give the staging buffers back to the OS: torch's pinned-memory allocator otherwise
    keeps them cached for the life of the process (they would stay in its resident set)."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        empty = getattr(torch._C, name, None)
        if empty is not None:
            empty()
            return
