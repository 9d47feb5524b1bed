"""Long-lived batched streams between services.

A `BatchedStream` is one client stream to one peer. Producers `put()` items (one request's
news); a sender coalesces whatever is queued into one batch message, so one engine step becomes
one message per peer however many requests it touched. The queue is bounded: `put()` waits when
the peer falls behind (backpressure), and the stream reconnects after a failure.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

import grpc

from meshlm.common.channels import MESH_MESSAGE_BYTES, MessageTooLarge
from meshlm.common.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

OpenCall = Callable[[], Any]


class BatchedStream(Generic[T]):
    """Client stream to `address`: `open_call()` starts the RPC (e.g. `stub.Push`);
    `make_batch(items)` wraps queued items into one message; `on_reply(message)` receives the
    reply stream of a bidi RPC; `ready()` (the channel's `channel_ready`) returns once the
    channel to the peer is READY.

    When the call fails, what is still queued is dropped, not kept for the next connection:
    the owners of those requests learn of the dead peer from its health
    (gateway/mesh/dependencies.py) and have ended them already, so a restarted peer must not start
    work nobody waits for. Items already handed to the failed call are lost the same way.

    So a call is opened only on a READY channel. After a peer restarts, its channel stays in
    TRANSIENT_FAILURE for up to its reconnect backoff (1 s) although the peer serves again,
    and a call opened then fails at once (mesh calls are not wait_for_ready): with the drop
    above, it threw away items put after the peer was back, whose requests then waited for
    ever (the fault tests' flake; it looked like a call that neither fails nor delivers, but
    the call failed and took the items with it). Items put while the channel reconnects wait
    in the queue and go out on the new call. No write needs a timer of its own: a peer that
    stops answering has its connection closed by keepalive within `DOWN_BOUND`
    (common/channels.py), which fails the call and every write on it.

    Nothing ends the stream but `close()`: an unexpected error in one call is logged and the
    stream reconnects, so its queue is never left without a sender. `on_lost(address)` runs
    after each failed call, once its queue was dropped: a sender whose peer owns requests (the
    detokenizer's stream to a gateway) ends them there, since nobody else will; one that owns
    the requests itself (the gateway's Submit) ends those that may have been lost. `lost` is
    True from then until the next call is open.

    A batch the call refuses as over the mesh's message limit (`MessageTooLarge`, before any
    of it is sent: the peer would fail the call for it) goes out split in halves instead, down
    to single items; an item too large alone is dropped and handed to `on_too_large(item,
    error)`, whose owner ends its request. The call, and all else queued, goes on."""

    def __init__(
        self, name: str, address: str, open_call: OpenCall,
        make_batch: Callable[[list[T]], Any], *, capacity: int = 65536, max_batch: int = 4096,
        on_reply: Callable[[Any], None] | None = None,
        ready: Callable[[], Awaitable[None]] | None = None,
        on_lost: Callable[[str], None] | None = None,
        on_too_large: Callable[[T, MessageTooLarge], None] | None = None,
        weight: Callable[[T], int] | None = None,
        write_through: bool = False, quiet: float = 0.0,
    ) -> None:
        self.name, self.address = name, address
        # write_through: a put that finds the sender idle and the call able to take a message
        # at once (`write_nowait`, the native client's calls) writes its batch itself, a task
        # switch and a loop turn sooner; for producers that put once per step (a put's items
        # are then its one message, as the sender would have made them). With `quiet`, only a
        # put at least that many seconds after the one before: for producers that put an item
        # at a time (a lone one leaves at once, a burst is gathered, a message a loop turn).
        self._write_through = write_through
        self._quiet = quiet
        self._last_put = 0.0  # time.monotonic() of the last put, with `quiet`
        self._direct: Callable[[Any], bool] | None = None  # the open call's write_nowait
        self._idle = False  # the sender waits for items
        self._weight = weight  # what an item counts against capacity and max_batch (else 1)
        self._load = 0  # the queue's items, weighed
        self._open_call, self._make_batch = open_call, make_batch
        self._on_reply = on_reply
        self._on_lost = on_lost
        self._on_too_large = on_too_large
        self._ready = ready
        self._capacity, self._max_batch = capacity, max_batch
        self._queue: collections.deque[T] = collections.deque()
        self._has_items = asyncio.Event()
        self._has_room = asyncio.Event()
        self._has_room.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.connected = False
        self.lost = False  # from a failed call until the next one is open
        self.messages_sent = 0

    @property
    def queued(self) -> int:
        """Items waiting for the next batch, weighed (they pile up while the peer pushes
        back)."""
        return self._load

    def _weigh(self, items: list[T]) -> int:
        return len(items) if self._weight is None else sum(map(self._weight, items))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"stream:{self.name}:{self.address}")

    async def put(self, items: Iterable[T]) -> None:
        """Queue items; waits while the queue is full."""
        while self._load >= self._capacity and not self._closed:
            self._has_room.clear()
            await self._has_room.wait()
        self.put_nowait(items)

    def put_nowait(self, items: Iterable[T]) -> None:
        """Queue items without waiting (callers that must never block, e.g. control messages)."""
        if not isinstance(items, list):
            items = list(items)
        lone = True
        if self._quiet:
            now = time.monotonic()
            lone, self._last_put = now - self._last_put >= self._quiet, now
        if self._direct is not None and self._idle and not self._queue and items and lone:
            try:
                if self._direct(self._make_batch(items)):
                    self.messages_sent += 1
                    return
            except Exception:  # noqa: BLE001 - queued instead: the sender meets it and says
                pass
        self._queue.extend(items)
        self._load += self._weigh(items)
        self._has_items.set()

    async def _watch(self, call: Any) -> None:
        """Read the reply stream (bidi) or wait for the call's end (client stream)."""
        if self._on_reply is not None:
            async for reply in call:
                self._on_reply(reply)
        else:
            await call

    async def _send(self, call: Any, watcher: asyncio.Task[None]) -> None:
        """Write batches with `call.write` until the call ends (its error propagates)."""
        while not self._closed:
            if watcher.done():
                watcher.result()  # raises the call's error, if any
                return
            if not self._queue:
                self._has_items.clear()
                self._idle = True
                try:
                    await self._has_items.wait()
                finally:
                    self._idle = False
                continue
            if self._load <= self._max_batch:  # the common case: take all at once
                items = list(self._queue)
                self._queue.clear()
                self._load = 0
            else:
                items = self._take(self._max_batch)
            if self._load < self._capacity:
                self._has_room.set()
            await self._write(call, items)

    async def _write(self, call: Any, items: list[T]) -> None:
        """One message of `items`; in halves if it is over the mesh's limit (the native
        client's `write` says so; a grpc.aio call's message is measured here, as grpc would
        fail the call for it)."""
        message = self._make_batch(items)
        try:
            if isinstance(call, grpc.aio.Call) and message.ByteSize() > MESH_MESSAGE_BYTES:
                raise MessageTooLarge(message.ByteSize())
            await call.write(message)
        except MessageTooLarge as exc:
            if len(items) > 1:
                half = len(items) // 2
                await self._write(call, items[:half])
                await self._write(call, items[half:])
                return
            log.error("message_too_large", stream=self.name, peer=self.address, size=exc.size)
            if self._on_too_large is not None:
                self._on_too_large(items[0], exc)
            return
        self.messages_sent += 1

    def _take(self, most: int) -> list[T]:
        """Items from the queue's head up to `most` in weight (one at least)."""
        items = [self._queue.popleft()]
        taken = self._weigh(items)
        while self._queue and taken + (w := self._weigh([self._queue[0]])) <= most:
            items.append(self._queue.popleft())
            taken += w
        self._load -= taken
        return items

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            sent_before = self.messages_sent
            try:
                error = await self._connection()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - no error may leave the queue unsent
                log.exception("stream_failed", stream=self.name, peer=self.address)
                error = f"{type(exc).__name__}: {exc}"
            if self._closed:
                return
            dropped = self._load
            self._queue.clear()
            self._load = 0
            self._has_room.set()
            self.lost = True
            log.warning("stream_lost", stream=self.name, peer=self.address, error=error,
                        dropped=dropped)
            if self._on_lost is not None:
                try:
                    self._on_lost(self.address)
                except Exception:  # noqa: BLE001 - the stream must go on reconnecting
                    log.exception("on_lost_failed", stream=self.name, peer=self.address)
            if self.messages_sent > sent_before:
                backoff = 0.05  # this connection worked: the next try starts quickly again
            await asyncio.sleep(backoff)  # reconnect pause, not synchronisation
            backoff = min(backoff * 2, 1.0)

    async def _connection(self) -> str:
        """One call: wait until the channel is READY, open the call, send until it ends.
        Returns why it ended."""
        if self._ready is not None:
            await self._ready()  # waits (reconnecting with backoff) while the peer is down
        call = self._open_call()
        watcher = asyncio.create_task(self._watch(call))
        watcher.add_done_callback(lambda _: self._has_items.set())
        error = "stream ended by peer"
        if self._write_through:
            self._direct = getattr(call, "write_nowait", None)
        try:
            self.connected, self.lost = True, False
            await self._send(call, watcher)
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        except asyncio.InvalidStateError as exc:  # wrote to a call that had just ended
            error = str(exc)
        finally:
            self.connected = False
            self._direct = None
            if watcher.done() and not watcher.cancelled():
                failure = watcher.exception()
                if isinstance(failure, grpc.aio.AioRpcError):
                    error = f"{failure.code().name}: {failure.details()}"
            call.cancel()
            watcher.cancel()
        return error

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
