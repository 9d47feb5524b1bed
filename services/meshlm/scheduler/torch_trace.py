"""The scheduler's torch profiler for profiling runs: started and stopped on the engine's own
thread (where every forward pass runs, so its operators are the ones recorded), exported as a
Chrome trace (`<prefix>.trace.json`, open in Perfetto or chrome://tracing)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from pathlib import Path

import torch


class EngineTorchTrace:
    """A `meshlm.common.profiling.TorchTrace` over the engine executor's thread."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._profiler: torch.profiler.profile | None = None
        self._path = ""

    @property
    def recording(self) -> bool:
        """A trace is being recorded (the engine's steps must stay on its thread meanwhile)."""
        return self._profiler is not None

    async def start(self, path_prefix: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self.executor, self._start,
                                                         path_prefix)

    async def stop(self) -> list[str]:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._stop)

    def _start(self, path_prefix: str) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        Path(path_prefix).parent.mkdir(parents=True, exist_ok=True)
        self._path = f"{path_prefix}.trace.json"
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()

    def _stop(self) -> list[str]:
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return []
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(self._path)
        return [self._path]
