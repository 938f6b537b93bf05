"""Named sessions on disk (``--session-dir``): one file per session, written off the step loop.

File layout (little endian)::

    b"TPSESS1\\n"  u64 header length  header (JSON, UTF-8)  u32 crc32 of the header  payload

The header holds the session id, the model fingerprint, the resident ids, the slot state's
metadata, each tensor's name, dtype, shape, byte range and crc32, and the payload's length
(format 1 files, still read, have one crc32 of the whole payload instead). A file is used only
when every check passes (magic, lengths, all checksums, fingerprint, session id); any other
file is ignored with one log line naming it, and the session is rebuilt the slow way (its next
prompt prefilled).

Reads are parallel: the tensors are read and checked by a pool of threads (file reads and
crc32 both leave the GIL). ``prefetch`` reads the sessions found at start, newest first and
within a byte budget, on a thread of its own, into the tiers' pinned buffers (``buffers``:
worker/engine/host_pool.py; the copy to the device is then a DMA at 54 GB/s: 28 ms for a
1.5 GB session of Gemma 4 31B at 8k tokens), so a restored session's first turn finds its cache
in memory. The prefetch makes no CUDA call (the buffers were pinned before), so it may run
while the CUDA graphs are captured. A read without a free buffer goes to pageable memory; no
read pins memory (~0.55 s a GB on an H200 host, stalling the GPU).

A state given to ``write`` is the writer's to ``release`` once written (or superseded, or
failed); a state ``read`` returns is the caller's. A state in a pinned pool buffer is first
copied to pageable memory by a spill thread, which gives the buffer back at once (the disk,
~0.75 GB/s with fsync on the H200 host, would hold it for seconds, and a request's offload
needs it); ``pending_state`` offers no spilled copy.

Writes go through one writer thread, in the order they were asked for (a ``close`` after a
write deletes the file the write made). Each write goes to ``<file>.tmp``, is fsynced and then
renamed over the old file, so a crash while writing leaves the previous good copy. A write
that fails (read-only or full disk) logs one line and leaves the previous copy; the engine
never waits for the disk except to read a session back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.layers.slot_state import SlotState

MAGIC = b"TPSESS1\n"
SUFFIX = ".tpsession"
FORMAT_VERSION = 2  # 2: a crc32 per tensor (1: one of the whole payload)
READ_THREADS = 8
_SAMPLE = 1024  # elements hashed at each end of every weight tensor


def model_fingerprint(model: torch.nn.Module, tokenizer: Any, geometry: Any) -> str:
    """What a cache depends on: every parameter and buffer's name, dtype and shape and a
    sample of its values (quantized weights are buffers of their own format), the tokenizer
    (size, special ids, the bytes of a spread of ids) and the cache's layout."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(geometry).encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel() and flat.device.type != "meta":
            sample = torch.cat([flat[:_SAMPLE], flat[-_SAMPLE:]]).cpu().contiguous()
            h.update(sample.view(torch.uint8).numpy().tobytes())
    vocab = int(tokenizer.vocab_size)
    h.update(f"{vocab}:{tokenizer.bos_id}:{sorted(tokenizer.eos_ids)}".encode())
    for token_id in range(0, vocab, max(1, vocab // 4096)):
        h.update(tokenizer.token_bytes(token_id) + b"\0")
    return h.hexdigest()


@dataclass
class StoredSession:
    session_id: str
    resident_ids: list[int]
    state: SlotState


@dataclass
class _Write:
    name: str
    state: SlotState  # the writer's hold; swapped for a pageable copy by the spill thread
    resident_ids: list[int]
    version: int
    writing: bool = False  # the writer took it: its state is not swapped any more
    spilled: bool = False  # its state was swapped for a pageable copy


@dataclass
class _Delete:
    name: str


_STOP = object()


class SessionStore:
    """One directory of session files for one model (``fingerprint``)."""

    def __init__(
        self,
        directory: str | Path,
        fingerprint: str,
        log: Callable[[str], None],
        buffers: Callable[[int], Any] | None = None,
    ):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.log = log
        # a held HostBuffer of at least n bytes for a prefetch, or None (pageable)
        self.buffers = buffers
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--session-dir {self.directory}: cannot create it: {exc}") from exc
        if not self.directory.is_dir():
            raise ValueError(f"--session-dir {self.directory}: not a directory")
        self.writable = self._probe()
        self._lock = threading.Lock()
        self._pending: dict[str, _Write] = {}  # asked for, not yet on disk
        self._versions: dict[str, int] = {}  # name -> version on disk (or pending)
        self._on_disk: set[str] = set()
        self.writes = self.write_errors = self.read_errors = self.bytes_written = 0
        self.prefetched = 0
        self.last_read: tuple[int, float] = (0, 0.0)  # bytes, seconds of the last file read
        self._prefetched: dict[str, Future[StoredSession | None]] = {}
        self._read: set[str] = set()  # read since start: no prefetch of it any more
        self._readers: ThreadPoolExecutor | None = None
        self._closing = False
        self._prefetching = False
        self._found: list[tuple[str, list[int], float]] | None = None  # scan()'s answer
        self._queue: queue.Queue[Any] = queue.Queue()
        self._spiller = ThreadPoolExecutor(1, "session-spill")
        self._thread = threading.Thread(target=self._writer, name="session-writer", daemon=True)
        self._thread.start()

    def _probe(self) -> bool:
        probe = self.directory / f".probe-{os.getpid()}.tmp"
        try:
            probe.write_bytes(b"")
            probe.unlink()
            return True
        except OSError as exc:
            self.log(
                f"session dir {self.directory} is not writable ({exc}): sessions are read "
                "from it but not saved"
            )
            return False

    def path_for(self, name: str) -> Path:
        return self.directory / (hashlib.sha256(name.encode()).hexdigest()[:32] + SUFFIX)

    # -- start-up ------------------------------------------------------------------------------

    def scan(self) -> list[tuple[str, list[int], float]]:
        """(session id, resident ids, mtime) of every valid file, newest first; stale temporary
        files are removed; invalid ones are logged once each and left alone. Once: later calls
        answer the same."""
        if self._found is not None:
            return list(self._found)
        found: list[tuple[str, list[int], float]] = []
        for path in sorted(self.directory.iterdir()):
            if path.name.endswith(SUFFIX + ".tmp") and self.writable:
                path.unlink(missing_ok=True)  # a write that a crash interrupted
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                with path.open("rb") as f:
                    header, _ = self._read_header(f, path)
            except (OSError, ValueError) as exc:
                self.log(f"ignoring session file {path}: {exc}")
                continue
            name = header["session_id"]
            if self.path_for(name) != path:
                self.log(f"ignoring session file {path}: named for another session id")
                continue
            found.append((name, [int(i) for i in header["resident_ids"]], path.stat().st_mtime))
            self._on_disk.add(name)
            self._versions[name] = 0
        found.sort(key=lambda item: -item[2])
        self._found = found
        return list(found)

    # -- what is where -------------------------------------------------------------------------

    def holds(self, name: str) -> bool:
        with self._lock:
            return name in self._pending or name in self._on_disk

    def has_version(self, name: str, version: int) -> bool:
        with self._lock:
            return self._versions.get(name) == version

    def set_version(self, name: str, version: int) -> None:
        """A session restored from its file: that file is its copy at ``version``."""
        with self._lock:
            if name in self._on_disk:
                self._versions[name] = version

    # -- writes (asynchronous) -----------------------------------------------------------------

    def write(self, name: str, state: SlotState, resident_ids: list[int], version: int) -> None:
        """Save ``state`` (the caller's hold on it passes to the writer)."""
        if not self.writable:
            state.release()
            return
        item = _Write(name, state, list(resident_ids), version)
        with self._lock:
            self._drop_prefetched(name)
            self._pending[name] = item
            self._versions[name] = version
        if state.buffer is not None:
            self._spiller.submit(self._spill, item)
        self._queue.put(item)

    def _spill(self, item: _Write) -> None:
        """Swap a queued write's pinned state for a pageable copy and give the buffer back
        (unless the writer has started on it)."""
        with self._lock:
            pinned = item.state
            if item.writing or pinned.buffer is None:
                return
        copy = {name: t.clone() for name, t in pinned.tensors.items()}
        with self._lock:
            if item.writing:
                return
            item.state = SlotState(pinned.tokens, copy, pinned.meta)
            item.spilled = True
        pinned.release()

    def pending_state(self, name: str, version: int) -> SlotState | None:
        """The host copy of ``name`` at ``version`` that a write not yet done holds (held once
        more for the caller), or None."""
        with self._lock:
            item = self._pending.get(name)
            if item is None or item.version != version or item.spilled:
                return None  # (spilled: a fresh copy into a pool buffer is faster)
            item.state.retain()
            return item.state

    def _drop_prefetched(self, name: str) -> None:
        """A prefetched copy no longer wanted (lock held); one still being read is released
        by the prefetcher when it finds its future gone."""
        future = self._prefetched.pop(name, None)
        if future is not None and future.done():
            stored = future.result()
            if stored is not None:
                stored.state.release()

    def prefetched_buffers(self) -> int:
        """Pool buffers that prefetched copies hold (until read, written over or deleted)."""
        with self._lock:
            done = [f.result() for f in self._prefetched.values() if f.done()]
        return sum(1 for stored in done if stored is not None and stored.state.buffer)

    def drop_a_prefetch(self) -> bool:
        """Let go of the prefetched copy read last (its file stays); False if none is done."""
        with self._lock:
            for name in reversed(list(self._prefetched)):
                future = self._prefetched[name]
                if future.done() and future.result() is not None:
                    self._drop_prefetched(name)
                    return True
        return False

    def delete(self, name: str) -> None:
        with self._lock:
            self._drop_prefetched(name)
            self._pending.pop(name, None)
            self._versions.pop(name, None)
            self._on_disk.discard(name)
        self._queue.put(_Delete(name))

    def flush(self) -> None:
        """Wait until every write asked for so far is on disk (or failed), and every spill of
        one has given its buffer back (a spill releases it after the copy, outside the lock,
        so a write of the copy can end first)."""
        self._queue.join()
        with contextlib.suppress(RuntimeError):  # (closed: the spill thread has ended)
            self._spiller.submit(lambda: None).result()  # one thread: the spills before it ended

    def close(self) -> None:
        self._closing = True  # no more prefetching
        self.flush()
        self._queue.put(_STOP)
        self._thread.join(timeout=60)
        self._spiller.shutdown(wait=True)
        with self._lock:
            for name in list(self._prefetched):
                self._drop_prefetched(name)
        if self._readers is not None:
            self._readers.shutdown(wait=True)

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, _Delete):
                    self.path_for(item.name).unlink(missing_ok=True)
                    continue
                with self._lock:
                    item.writing = True
                    if self._pending.get(item.name) is not item:
                        item.state.release()
                        continue  # superseded by a newer write or a delete
                try:
                    self.bytes_written += self._write_file(item)
                    self.writes += 1
                    with self._lock:
                        if self._pending.get(item.name) is item:
                            self._on_disk.add(item.name)
                except Exception as exc:  # noqa: BLE001 - a full or read-only disk, logged
                    self.write_errors += 1
                    with self._lock:
                        if self._versions.get(item.name) == item.version:
                            self._versions.pop(item.name, None)
                    self.log(
                        f"could not save session {item.name!r} to {self.path_for(item.name)}: {exc}"
                    )
                finally:
                    with self._lock:
                        if self._pending.get(item.name) is item:
                            del self._pending[item.name]
                    item.state.release()
            finally:
                self._queue.task_done()

    def _write_file(self, item: _Write) -> int:
        chunks: list[memoryview] = []
        specs: list[dict[str, Any]] = []
        offset = 0
        for name, t in item.state.tensors.items():
            raw = memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            specs.append(
                {
                    "name": name,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "offset": offset,
                    "nbytes": raw.nbytes,
                    "crc32": zlib.crc32(raw),
                }
            )
            chunks.append(raw)
            offset += raw.nbytes
        header = json.dumps(
            {
                "format": FORMAT_VERSION,
                "session_id": item.name,
                "fingerprint": self.fingerprint,
                "tokens": item.state.tokens,
                "resident_ids": item.resident_ids,
                "meta": item.state.meta,
                "tensors": specs,
                "payload_bytes": offset,
            }
        ).encode()
        path = self.path_for(item.name)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with tmp.open("wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                f.write(struct.pack("<I", zlib.crc32(header)))
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return len(header) + offset

    # -- reads ---------------------------------------------------------------------------------

    def _read_header(self, f: Any, path: Path) -> tuple[dict[str, Any], int]:
        """The checked header and the payload's start; ValueError names what is wrong."""
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a tokenpipe session file")
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError("truncated header")
        (length,) = struct.unpack("<Q", raw_len)
        size = path.stat().st_size
        if length > size:
            raise ValueError("truncated header")
        raw = f.read(length)
        raw_crc = f.read(4)
        if len(raw) != length or len(raw_crc) != 4:
            raise ValueError("truncated header")
        if struct.unpack("<I", raw_crc)[0] != zlib.crc32(raw):
            raise ValueError("header checksum mismatch")
        header = json.loads(raw)
        if header.get("format") not in (1, FORMAT_VERSION):
            raise ValueError(f"format {header.get('format')!r}, expected {FORMAT_VERSION}")
        if header.get("fingerprint") != self.fingerprint:
            raise ValueError("written for another model, dtype, quantization or tokenizer")
        start = len(MAGIC) + 8 + length + 4
        if size != start + int(header["payload_bytes"]):
            raise ValueError(
                f"size {size} bytes, expected {start + int(header['payload_bytes'])} (truncated)"
            )
        return header, start

    def read(self, name: str) -> StoredSession | None:
        """The session's newest copy (a pending write's state, a prefetched copy, else its
        file), or None. The caller holds the state it returns (``release``)."""
        with self._lock:
            pending = self._pending.get(name)
            if pending is not None:
                pending.state.retain()
                return StoredSession(name, list(pending.resident_ids), pending.state)
            if name not in self._on_disk:
                return None
            future = self._prefetched.get(name)
            mine = future is None
            if future is None:  # read it here (a prefetch of it now would skip it)
                future = self._prefetched[name] = Future()
            self._read.add(name)
        if mine:  # a pool buffer if one is free, else pageable (never pinned here)
            future.set_result(self._load(name))
        stored = future.result()  # None: the file failed its checks (logged once)
        with self._lock:
            if self._prefetched.get(name) is future:
                del self._prefetched[name]
        return stored

    def prefetch(self, names: list[str], budget_bytes: int) -> None:
        """Read these sessions' files (in this order, within ``budget_bytes``) on a thread of
        its own; ``read`` takes a prefetched copy instead of the file (waiting for one still
        being read). A write or a delete drops the copy."""
        if not names or budget_bytes <= 0 or self._prefetching:
            return
        self._prefetching = True
        threading.Thread(
            target=self._prefetcher, args=(list(names), budget_bytes), name="session-prefetch",
            daemon=True,
        ).start()  # fmt: skip

    def _prefetcher(self, names: list[str], budget_bytes: int) -> None:
        for name in names:
            try:
                size = self.path_for(name).stat().st_size
            except OSError:
                continue
            if size > budget_bytes or self._closing:
                return
            future: Future[StoredSession | None] = Future()
            with self._lock:
                if (
                    name in self._pending
                    or name not in self._on_disk
                    or name in self._prefetched
                    or name in self._read
                ):
                    continue  # newer in memory, gone, being read or read already
                self._prefetched[name] = future
            budget_bytes -= size
            try:
                stored = self._load(name)
            except BaseException as exc:  # noqa: BLE001 - a reader waiting must not hang
                stored = None
                self.log(f"prefetching session {name!r} failed: {exc!r}")
            with self._lock:
                wanted = self._prefetched.get(name) is future
                if stored is not None and not wanted:  # a write or delete came meanwhile
                    stored.state.release()
                    stored = None
                future.set_result(stored)
            self.prefetched += stored is not None

    def _load(self, name: str) -> StoredSession | None:
        """Read and check the session's file, tensors in parallel, into a pool buffer when one
        is free; None (logged) if bad."""
        started = time.perf_counter()
        stored = self._load_file(name)
        if stored is not None:
            self.last_read = (stored.state.nbytes, time.perf_counter() - started)
        return stored

    def _load_file(self, name: str) -> StoredSession | None:
        path = self.path_for(name)
        buffer: Any = None
        try:
            with path.open("rb") as f:
                header, start = self._read_header(f, path)
                size = int(header["payload_bytes"])
                buffer = self.buffers(size) if self.buffers is not None else None
                if buffer is not None:
                    payload = buffer.data[:size]
                else:
                    payload = torch.empty(size, dtype=torch.uint8)
                specs = header["tensors"]
                for spec in specs:
                    if spec["offset"] < 0 or spec["offset"] + spec["nbytes"] > size:
                        raise ValueError(f"tensor {spec['name']!r} outside the payload")
                view = payload.numpy()
                fd = f.fileno()
                if self._readers is None:
                    self._readers = ThreadPoolExecutor(READ_THREADS, "session-read")
                parts = list(
                    self._readers.map(
                        lambda spec: _read_part(fd, view, start, spec), specs + [_tail(specs, size)]
                    )
                )
            if "payload_crc32" in header:  # format 1
                if zlib.crc32(view) != header["payload_crc32"]:
                    raise ValueError("payload checksum mismatch")
            elif not all(parts):
                raise ValueError("payload checksum mismatch")
            if header["session_id"] != name:
                raise ValueError(f"holds session {header['session_id']!r}")
            tensors: dict[str, torch.Tensor] = {}
            for spec in specs:
                dtype = getattr(torch, spec["dtype"])
                raw = payload[spec["offset"] : spec["offset"] + spec["nbytes"]]
                if spec["offset"] % dtype.itemsize:  # a view needs an aligned start
                    raw = raw.clone()
                tensors[spec["name"]] = raw.view(dtype).reshape(spec["shape"])
            state = SlotState(int(header["tokens"]), tensors, dict(header["meta"]), buffer)
            return StoredSession(name, [int(i) for i in header["resident_ids"]], state)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            if buffer is not None:
                buffer.release()
            self.read_errors += 1
            self.log(f"ignoring session file {path} ({name!r}): {exc}; rebuilding it")
            with self._lock:
                self._on_disk.discard(name)
                self._versions.pop(name, None)
            return None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            on_disk = len(self._on_disk | set(self._pending))
        return {
            "disk_sessions": on_disk,
            "disk_writes": self.writes,
            "disk_write_errors": self.write_errors,
            "disk_read_errors": self.read_errors,
            "disk_prefetched": self.prefetched,
            "disk_last_read_bytes": self.last_read[0],
            "disk_last_read_ms": round(self.last_read[1] * 1000, 1),
            "disk_bytes_written": self.bytes_written,
            "disk_writable": self.writable,
        }


def _tail(specs: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """The payload bytes after the last tensor (none in a file this module wrote)."""
    end = max((spec["offset"] + spec["nbytes"] for spec in specs), default=0)
    return {"offset": end, "nbytes": size - end}


def _read_part(fd: int, view: Any, start: int, spec: dict[str, Any]) -> bool:
    """Read one tensor's bytes into ``view`` (the payload) at its offset; True if it matches
    its crc32 (or has none). OSError / ValueError for a short or failed read."""
    offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
    target = memoryview(view)[offset : offset + nbytes]
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [target[done:]], start + offset + done)
        if n <= 0:
            raise ValueError("truncated payload")
        done += n
    return "crc32" not in spec or zlib.crc32(target) == spec["crc32"]
