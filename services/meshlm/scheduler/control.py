"""Control calls on the scheduler, run by the engine loop at a step boundary (no plan in
flight): FlushCache, Pause, Continue and UpdateWeights. The servicer calls `EngineControl`;
calls run in arrival order, and one whose caller gives up before it started is left unrun."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc

from meshlm.common.errors import MeshError, invalid
from meshlm.common.logs import get_logger
from meshlm.common.service import model_info_json
from meshlm.scheduler.engine.engine import Engine
from meshlm.scheduler.engine.policy import PAUSE_MODES
from meshlm.scheduler.engine.weights import WeightsLoadError
from meshlm.scheduler.loop import EngineLoop
from meshlm.scheduler.models.reload import CheckpointNotFound, IncompatibleCheckpoint
from meshlm.v1 import common_pb2, scheduler_pb2

log = get_logger(__name__)

CONTROL_TIMEOUT = 30.0  # seconds a control call waits for the engine loop to reach a step boundary

T = TypeVar("T")


class EngineControl:
    """The control calls over `engine`, queued on `loop` for a step boundary. `info` is the
    ModelInfo GetInfo answers with; a weight update names its new checkpoint there."""

    def __init__(self, engine: Engine, loop: EngineLoop, info: common_pb2.ModelInfo) -> None:
        self.engine = engine
        self.loop = loop
        self.info = info
        self._updating = asyncio.Lock()  # one weight update at a time, in arrival order

    async def flush_cache(self) -> scheduler_pb2.FlushCacheResponse:
        """Queue a flush for the engine loop, which runs it between two steps."""
        try:
            flushed = await self.loop.between_steps(self.engine.flush_cache, CONTROL_TIMEOUT)
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

    async def pause(self, mode: str) -> scheduler_pb2.PauseResponse:
        """Pause the engine at the next step boundary (see the proto for the modes)."""
        if mode not in PAUSE_MODES:
            raise invalid("mode", f"must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")

        def pause() -> tuple[bool, int]:
            already = self.engine.paused is not None
            return already, self.engine.pause(mode)

        already, touched = await self._control(pause)
        log.info("paused", mode=mode, requests=touched, already_paused=already)
        return scheduler_pb2.PauseResponse(already_paused=already, requests=touched)

    async def resume(self) -> scheduler_pb2.ContinueResponse:
        was_paused = await self._control(self.engine.resume)
        log.info("continued", was_paused=was_paused)
        return scheduler_pb2.ContinueResponse(was_paused=was_paused)

    async def update_weights(self, request: scheduler_pb2.UpdateWeightsRequest
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

            async def swap() -> scheduler_pb2.UpdateWeightsResponse:
                # Runs to its end once started, even if the caller goes away meanwhile.
                boundary = time.perf_counter()
                aborted = self.engine.abort_all() if request.abort_all else 0
                retracted = self.engine.drop_kv()
                tensors = await self.loop.on_engine_thread(self.engine.load_weights, checkpoint)
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
                return await self.loop.at_step_boundary(swap, None)
            except WeightsLoadError as exc:
                raise MeshError(grpc.StatusCode.INTERNAL, str(exc)) from None

    def _set_model_path(self, model_path: str) -> None:
        """GetInfo names the checkpoint now served (config.json and the same engine facts)."""
        facts = json.loads(self.info.json_info) if self.info.json_info else {}
        facts.pop("config", None)
        self.info.model_path = model_path
        self.info.json_info = model_info_json(model_path, facts)

    async def _control(self, action: Callable[[], T]) -> T:
        """`action` between two steps, a timeout becoming UNAVAILABLE."""
        try:
            return await self.loop.between_steps(action, CONTROL_TIMEOUT)
        except TimeoutError:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "the engine loop did not reach a "
                            f"step boundary within {CONTROL_TIMEOUT} s") from None


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)
