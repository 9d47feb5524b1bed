"""Long-lived batched streams between services.

A `BatchedStream` is one client stream to one peer. Producers `put()` items (one request's
news); a sender coalesces whatever is queued into one batch message, so one engine step becomes
one message per peer however many requests it touched. The queue is bounded: `put()` waits when
the peer falls behind (backpressure), and the stream reconnects after a failure.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Generic, TypeVar

import grpc

from meshlm.common.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

OpenCall = Callable[[AsyncIterator[Any]], Any]


class BatchedStream(Generic[T]):
    """Client stream to `address`: `open_call(messages)` starts the RPC (e.g. `stub.Push`);
    `make_batch(items)` wraps queued items into one message; `on_reply(message)` receives the
    reply stream of a bidi RPC. Items already handed to a call that then fails may be lost:
    the owners of requests learn of a dead peer from its health (see gateway/dependencies.py)."""

    def __init__(
        self, name: str, address: str, open_call: OpenCall,
        make_batch: Callable[[list[T]], Any], *, capacity: int = 65536, max_batch: int = 4096,
        on_reply: Callable[[Any], None] | None = None,
    ) -> None:
        self.name, self.address = name, address
        self._open_call, self._make_batch = open_call, make_batch
        self._on_reply = on_reply
        self._capacity, self._max_batch = capacity, max_batch
        self._queue: collections.deque[T] = collections.deque()
        self._has_items = asyncio.Event()
        self._has_room = asyncio.Event()
        self._has_room.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._epoch = 0
        self.connected = False
        self.messages_sent = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"stream:{self.name}:{self.address}")

    async def put(self, items: Iterable[T]) -> None:
        """Queue items; waits while the queue is full."""
        while len(self._queue) >= self._capacity and not self._closed:
            self._has_room.clear()
            await self._has_room.wait()
        self._queue.extend(items)
        self._has_items.set()

    def put_nowait(self, items: Iterable[T]) -> None:
        """Queue items without waiting (callers that must never block, e.g. control messages)."""
        self._queue.extend(items)
        self._has_items.set()

    async def _messages(self, epoch: int) -> AsyncIterator[Any]:
        # A call that failed may still be pulling from its iterator; `epoch` retires it so it
        # never takes (and loses) items meant for the next connection.
        while not self._closed and epoch == self._epoch:
            if not self._queue:
                self._has_items.clear()
                await self._has_items.wait()
                continue
            n = min(len(self._queue), self._max_batch)
            items = [self._queue.popleft() for _ in range(n)]
            if len(self._queue) < self._capacity:
                self._has_room.set()
            yield self._make_batch(items)
            self.messages_sent += 1

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            call = self._open_call(self._messages(self._epoch))
            try:
                self.connected = True
                if self._on_reply is not None:
                    async for reply in call:
                        self._on_reply(reply)
                        backoff = 0.05
                else:
                    await call
                if self._closed:
                    return
                error = "stream ended by peer"
            except asyncio.CancelledError:
                call.cancel()
                raise
            except grpc.aio.AioRpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            finally:
                self.connected = False
                self._epoch += 1
                self._has_items.set()  # wake the retired iterator so it sees the epoch and ends
            log.warning("stream_lost", stream=self.name, peer=self.address, error=error)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def close(self) -> None:
        self._closed = True
        self._has_items.set()
        self._has_room.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass


class StreamPool(Generic[T]):
    """BatchedStreams keyed by peer address, created on first use (addresses come in-band)."""

    def __init__(self, factory: Callable[[str], BatchedStream[T]]) -> None:
        self._factory = factory
        self.streams: dict[str, BatchedStream[T]] = {}

    def get(self, address: str) -> BatchedStream[T]:
        stream = self.streams.get(address)
        if stream is None:
            stream = self._factory(address)
            stream.start()
            self.streams[address] = stream
        return stream

    async def close(self) -> None:
        for stream in self.streams.values():
            await stream.close()
        self.streams.clear()
