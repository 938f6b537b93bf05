"""A front end's long-lived connections to the replicas' JSONL ports (endpoints.py): one per
replica, opened on first use, every request to that replica multiplexed on it by id.

When a connection breaks (the replica died, or its node went away) every request waiting on it
gets `LOST`, the replica is marked down in the directory, and the next request opens a new
connection to whatever replica the directory then names.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

import orjson

from supervisor.lines import LineSplitter, TooLong

from .directory import Directory, Endpoint

LOST: dict[str, Any] = {"event": "tp_link_lost"}
"""Put in a request's queue when the connection it was waiting on broke."""
READ_SIZE = 1 << 16
MAX_LINE_BYTES = 64 << 20
CONNECT_TIMEOUT_S = 5.0


class Link:
    """One connection to one replica's JSONL port."""

    def __init__(
        self,
        endpoint: Endpoint,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_lost: Callable[[Link], None],
    ) -> None:
        self.endpoint = endpoint
        self.lost = False
        self._reader = reader
        self._writer = writer
        self._on_lost = on_lost
        self._queues: dict[Any, asyncio.Queue[dict[str, Any]]] = {}
        self._task = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, endpoint: Endpoint, on_lost: Callable[[Link], None]) -> Link:
        host, port = endpoint.jsonl_address
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=READ_SIZE), CONNECT_TIMEOUT_S
        )
        with contextlib.suppress(OSError):
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(orjson.dumps({"call": "hello", "secret": endpoint.secret}) + b"\n")
        return cls(endpoint, reader, writer, on_lost)

    def send(self, envelope: dict[str, Any]) -> asyncio.Queue[dict[str, Any]]:
        """Send a call (its `id` unique on this link); its answer lines arrive in the queue,
        or `LOST`."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        if self.lost:
            queue.put_nowait(LOST)
            return queue
        self._queues[envelope["id"]] = queue
        self._writer.write(orjson.dumps(envelope) + b"\n")
        return queue

    def cancel(self, request_id: Any) -> None:
        """Cancel a generate sent on this link (its `done` still comes, cancelled)."""
        if not self.lost and request_id in self._queues:
            self._writer.write(orjson.dumps({"call": "cancel", "id": request_id}) + b"\n")

    def forget(self, request_id: Any) -> None:
        self._queues.pop(request_id, None)

    async def _read(self) -> None:
        splitter = LineSplitter(MAX_LINE_BYTES)
        try:
            while data := await self._reader.read(READ_SIZE):
                for line in splitter.feed(data):
                    if isinstance(line, TooLong) or not line.strip():
                        continue
                    event = orjson.loads(line)
                    queue = self._queues.get(event.get("id"))
                    if queue is not None:
                        queue.put_nowait(event)
        except (ConnectionError, OSError, orjson.JSONDecodeError):
            pass
        finally:
            self._lose()

    def _lose(self) -> None:
        if self.lost:
            return
        self.lost = True
        self._writer.close()
        for queue in self._queues.values():
            queue.put_nowait(LOST)
        self._queues.clear()
        self._on_lost(self)

    def close(self) -> None:
        self._task.cancel()


class Links:
    """The open links of a front end, one per replica, kept in step with its directory."""

    def __init__(self, directory: Directory) -> None:
        self._directory = directory
        self._links: dict[str, Link] = {}  # replica id -> its link
        self._opening: dict[str, asyncio.Future[Link]] = {}
        self._closed = False

    async def get(self, endpoint: Endpoint) -> Link:
        """The link to `endpoint`, opened if needed; OSError (and the replica marked down)
        when it cannot be reached."""
        link = self._links.get(endpoint.replica_id)
        if link is not None and not link.lost:
            return link
        opening = self._opening.get(endpoint.replica_id)
        if opening is None:
            opening = asyncio.ensure_future(Link.open(endpoint, self._lost))
            self._opening[endpoint.replica_id] = opening
            opening.add_done_callback(lambda _: self._opened(endpoint, opening))
        try:
            return await asyncio.shield(opening)
        except (OSError, asyncio.TimeoutError) as exc:
            self._directory.mark_down(endpoint.replica_id)
            raise OSError(f"replica {endpoint.name} at {endpoint.jsonl}: {exc}") from exc

    def _opened(self, endpoint: Endpoint, opening: asyncio.Future[Link]) -> None:
        if self._opening.get(endpoint.replica_id) is opening:
            del self._opening[endpoint.replica_id]
        if not opening.cancelled() and opening.exception() is None:
            self._links[endpoint.replica_id] = opening.result()

    def _lost(self, link: Link) -> None:
        if self._links.get(link.endpoint.replica_id) is link:
            del self._links[link.endpoint.replica_id]
        if not self._closed:
            self._directory.mark_down(link.endpoint.replica_id)

    def close(self) -> None:
        self._closed = True
        for link in list(self._links.values()):
            link.close()
