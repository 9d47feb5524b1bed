"""Fire-and-forget work that must neither be garbage-collected mid-flight nor outlive shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from meshlm.common.logs import get_logger

log = get_logger(__name__)


class BackgroundTasks:
    """Keeps a reference to each task until it ends; `close()` cancels what is left."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Periodic:
    """Runs `tick()` every `interval` seconds in a task of its own until `close()`; a tick that
    raises is logged (`<name>_failed`) and the next one runs on time."""

    def __init__(self, name: str, tick: Callable[[], Awaitable[None]], interval: float) -> None:
        self.name, self.interval = name, interval
        self._tick = tick
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:  # noqa: BLE001 - one bad tick must not end the loop for good
                log.exception(f"{self.name}_failed")
            await asyncio.sleep(self.interval)  # the period, not synchronisation

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
