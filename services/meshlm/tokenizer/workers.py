"""Where the tokenizer service's CPU work runs.

Tiny inputs (under `inline_chars` characters: a few dozen microseconds of encoding, less than
handing the job to a thread and back costs) run on the event loop itself. Small inputs (under
`big_chars`) run on a small pool; bigger ones on a thread of their own, so one client's huge
prompt never holds up another client's small one (the two share only the GIL, which the
`tokenizers` library releases while it encodes). After a big job the heap it freed is handed
back to the operating system (glibc's malloc_trim): an encoding's scratch memory is large, and
the allocator would otherwise keep it for the process's life.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from meshlm.common.memory import release_memory

T = TypeVar("T")

INLINE_CHARS = 1024  # about 0.1 ms of encoding: below this a job runs on the event loop
BIG_CHARS = 16384  # about 5 ms of encoding: from here a job gets the big-input thread
SMALL_THREADS = 2


class Workers:
    def __init__(self, big_chars: int = BIG_CHARS, small_threads: int = SMALL_THREADS,
                 inline_chars: int = INLINE_CHARS) -> None:
        self.big_chars = big_chars
        self.inline_chars = inline_chars
        self._small = ThreadPoolExecutor(small_threads, thread_name_prefix="tokenize")
        self._big = ThreadPoolExecutor(1, thread_name_prefix="tokenize-big")

    def is_big(self, chars: int) -> bool:
        return chars >= self.big_chars

    async def run(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the pool for an input of `chars` characters (about)."""
        if chars < self.inline_chars:
            return fn(*args)
        loop = asyncio.get_running_loop()
        if self.is_big(chars):
            return await loop.run_in_executor(self._big, functools.partial(_trimmed, fn, *args))
        return await loop.run_in_executor(self._small, functools.partial(fn, *args))

    def close(self) -> None:
        for pool in (self._small, self._big):
            pool.shutdown(wait=False, cancel_futures=True)


def _trimmed(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    finally:
        release_memory()
