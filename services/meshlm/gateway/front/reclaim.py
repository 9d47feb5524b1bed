"""The memory of a big request, given back to the operating system once the request is over,
rather than kept by the process.

Two things keep it. grpc aborts a call that fails and keeps the abort's exception on the call's
state, whose traceback holds the call's frames and so its request message: a reference cycle,
freed only by Python's cycle collector, which runs by counts of objects, not bytes. And glibc's
allocator keeps freed memory for reuse (after one 10 MB block is freed it serves the next ones
from its heap, not fresh mappings). Ten-megabyte prompts refused one after another would hold
hundreds of megabytes. So after a request of BIG_REQUEST_BYTES or more, a collection runs
shortly after (one at a time), and malloc_trim on a worker thread at most every TRIM_INTERVAL
(pages handed back must be faulted in again by the next big request: trimming after each one of
a stream of them would cost each a few more milliseconds of the event loop). The gateway
freezes the objects it made while starting (`common/memory.py`), so a collection only walks what
requests made: about a millisecond, not tens.
"""

from __future__ import annotations

import asyncio
import gc
import time

from meshlm.common.logs import get_logger
from meshlm.common.memory import release_memory

log = get_logger(__name__)

BIG_REQUEST_BYTES = 1 << 20
DELAY = 0.05  # seconds: the call has been torn down by then
TRIM_INTERVAL = 1.0  # seconds between two malloc_trims


class Reclaimer:
    def __init__(self, big_bytes: int = BIG_REQUEST_BYTES, delay: float = DELAY,
                 trim_interval: float = TRIM_INTERVAL) -> None:
        self.big_bytes = big_bytes
        self.delay = delay
        self.trim_interval = trim_interval
        self.collections = 0
        self.trims = 0
        self.trimmed_at: list[float] = []  # loop times of the last trims (a few)
        self._pending: asyncio.TimerHandle | None = None
        self._trim_pending: asyncio.TimerHandle | None = None
        self._last_trim = -trim_interval
        self._changed = asyncio.Event()

    @property
    def scheduled(self) -> bool:
        """A collection or a trim is waiting to run."""
        return self._pending is not None or self._trim_pending is not None

    def trim_due(self) -> float | None:
        """The loop time the waiting trim runs at; None if none waits."""
        return self._trim_pending.when() if self._trim_pending is not None else None

    async def reached(self, collections: int = 0, trims: int = 0) -> None:
        """Return once at least this many collections and trims have run."""
        while self.collections < collections or self.trims < trims:
            self._changed.clear()
            await self._changed.wait()

    def after(self, request_bytes: int) -> None:
        """A request of this size is over (answered or refused): reclaim soon if it was big."""
        if request_bytes < self.big_bytes or self._pending is not None:
            return
        self._pending = asyncio.get_running_loop().call_later(self.delay, self._collect)

    def _collect(self) -> None:
        self._pending = None
        started = time.perf_counter()
        found = gc.collect()
        self.collections += 1
        log.debug("memory_reclaimed", objects=found,
                  ms=round((time.perf_counter() - started) * 1000, 2))
        if self._trim_pending is None:
            loop = asyncio.get_running_loop()
            wait = max(0.0, self._last_trim + self.trim_interval - loop.time())
            self._trim_pending = loop.call_later(wait, self._trim)
        self._changed.set()

    def _trim(self) -> None:
        self._trim_pending = None
        loop = asyncio.get_running_loop()
        self._last_trim = loop.time()
        self.trims += 1
        self.trimmed_at = [*self.trimmed_at[-3:], self._last_trim]
        loop.run_in_executor(None, release_memory)
        self._changed.set()
