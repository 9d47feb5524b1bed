"""Control calls on the scheduler that the engine loop runs at a step boundary (no plan in
flight): FlushCache, Pause, Continue and UpdateWeights, mixed into the SchedulerServicer.
They run in arrival order; a caller that gives up before its call started leaves it unrun."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc

from meshlm.common.errors import MeshError, invalid
from meshlm.common.logs import get_logger
from meshlm.common.service import model_info_json
from meshlm.scheduler.engine.engine import Engine
from meshlm.scheduler.engine.policy import PAUSE_MODES
from meshlm.scheduler.engine.weights import WeightsLoadError
from meshlm.scheduler.models.reload import CheckpointNotFound, IncompatibleCheckpoint
from meshlm.v1 import common_pb2, scheduler_pb2

log = get_logger(__name__)

CONTROL_TIMEOUT = 30.0  # seconds a control call waits for the engine loop to reach a step boundary

T = TypeVar("T")


class ControlRPCs:
    engine: Engine
    info: common_pb2.ModelInfo
    wake: asyncio.Event
    _executor: ThreadPoolExecutor
    # Control calls awaiting a step boundary, in arrival order.
    _controls: list[tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any]]]
    _updating: asyncio.Lock  # one weight update at a time, in arrival order

    async def FlushCache(self, request: scheduler_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.FlushCacheResponse:
        """Queue a flush for the engine loop, which runs it between two steps."""
        try:
            flushed = await self._between_steps(self.engine.flush_cache)
        except TimeoutError:
            return scheduler_pb2.FlushCacheResponse(
                success=False, message=f"the engine loop did not answer within {CONTROL_TIMEOUT} s")
        if flushed:
            log.info("prefix_cache_flushed")
            return scheduler_pb2.FlushCacheResponse(success=True)
        s = self.engine.stats()
        return scheduler_pb2.FlushCacheResponse(
            success=False, message=f"requests are running ({s['running']} running, "
                                   f"{s['waiting']} waiting); retry when idle")

    async def Pause(self, request: scheduler_pb2.PauseRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.PauseResponse:
        """Pause the engine at the next step boundary (see the proto for the modes)."""
        if request.mode not in PAUSE_MODES:
            raise invalid("mode", f"must be one of {', '.join(PAUSE_MODES)}; got {request.mode!r}")
        def pause() -> tuple[bool, int]:
            already = self.engine.paused is not None
            return already, self.engine.pause(request.mode)

        already, touched = await self._control(pause)
        log.info("paused", mode=request.mode, requests=touched, already_paused=already)
        return scheduler_pb2.PauseResponse(already_paused=already, requests=touched)

    async def Continue(self, request: scheduler_pb2.ContinueRequest,
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.ContinueResponse:
        was_paused = await self._control(self.engine.resume)
        log.info("continued", was_paused=was_paused)
        return scheduler_pb2.ContinueResponse(was_paused=was_paused)

    async def UpdateWeights(self, request: scheduler_pb2.UpdateWeightsRequest,
                            context: grpc.aio.ServicerContext
                            ) -> scheduler_pb2.UpdateWeightsResponse:
        """New weights from `model_path` (see the proto). The checkpoint is checked while the
        engine goes on stepping; then, at a step boundary, the running requests are retracted,
        the prefix cache emptied and the weights copied in on the engine thread, and stepping
        resumes. Updates run one at a time, in arrival order."""
        path, load_format = request.model_path, request.load_format or "auto"
        if not path or not Path(path).is_absolute():
            raise invalid("model_path", f"must be an absolute directory path, got {path!r}")
        async with self._updating:
            start = time.perf_counter()
            try:
                checkpoint = await asyncio.to_thread(self.engine.check_weights, path,
                                                     load_format)
            except CheckpointNotFound as exc:
                raise MeshError(grpc.StatusCode.NOT_FOUND, f"model_path: {exc}") from None
            except IncompatibleCheckpoint as exc:
                raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            except ValueError as exc:  # unknown load_format
                raise invalid("load_format", str(exc)) from None
            checked = time.perf_counter()
            loop = asyncio.get_running_loop()

            async def swap() -> scheduler_pb2.UpdateWeightsResponse:
                # Runs to its end once started, even if the caller goes away meanwhile.
                boundary = time.perf_counter()
                aborted = self.engine.abort_all() if request.abort_all else 0
                retracted = self.engine.drop_kv()
                tensors = await loop.run_in_executor(self._executor, self.engine.load_weights,
                                                     checkpoint)
                end = time.perf_counter()
                self._set_model_path(str(checkpoint.path))
                log.info("weights_updated", model_path=str(checkpoint.path),
                         load_format=checkpoint.load_format, aborted=aborted,
                         retracted=retracted, tensors=tensors, check_ms=_ms(checked - start),
                         wait_ms=_ms(boundary - checked), load_ms=_ms(end - boundary),
                         total_ms=_ms(end - start))
                return scheduler_pb2.UpdateWeightsResponse(
                    info=self.info, aborted=aborted, retracted=retracted, seconds=end - start,
                    load_seconds=end - boundary)

            try:
                return await self._at_step_boundary(swap, None)
            except WeightsLoadError as exc:
                raise MeshError(grpc.StatusCode.INTERNAL, str(exc)) from None

    def _set_model_path(self, model_path: str) -> None:
        """GetInfo names the checkpoint now served (config.json and the same engine facts)."""
        facts = json.loads(self.info.json_info) if self.info.json_info else {}
        facts.pop("config", None)
        self.info.model_path = model_path
        self.info.json_info = model_info_json(model_path, facts)

    async def _control(self, action: Callable[[], T]) -> T:
        """`_between_steps`, a timeout becoming UNAVAILABLE."""
        try:
            return await self._between_steps(action)
        except TimeoutError:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "the engine loop did not reach a "
                            f"step boundary within {CONTROL_TIMEOUT} s") from None

    async def _between_steps(self, action: Callable[[], T]) -> T:
        """Run `action` on the engine loop between two steps (no plan in flight), after the
        control calls queued before it; TimeoutError if the loop does not get there in time."""
        async def run() -> T:
            return action()

        return await self._at_step_boundary(run, CONTROL_TIMEOUT)

    async def _at_step_boundary(self, action: Callable[[], Awaitable[T]],
                                timeout: float | None) -> T:
        """`_between_steps` for an async action: the engine loop awaits it before planning the
        next step (so no step runs meanwhile), and `timeout` (None: none) covers the wait and
        the action. An action not yet started when its caller gives up does not run; one
        started runs to its end."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._controls.append((action, done))
        self.wake.set()
        return await asyncio.wait_for(done, timeout)

    async def _run_controls(self) -> None:
        """Run the queued control calls (loop thread, no plan in flight)."""
        controls, self._controls = self._controls, []
        for action, done in controls:
            if done.done():  # its caller gave up
                continue
            try:
                result = await action()
            except Exception as exc:  # noqa: BLE001 - the caller's error, not the loop's
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(result)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)
