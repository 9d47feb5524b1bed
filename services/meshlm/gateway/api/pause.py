"""PauseGeneration and ContinueGeneration (SGLang's /pause_generation, /continue_generation).

The pause lives in the schedulers, not in the gateway: each RPC fans out to every scheduler
replica (`Scheduler.Pause` / `Continue`), whose engine loop applies it between two steps. So a
pause holds for requests from every gateway, and requests sent while paused are accepted as
usual and wait in the schedulers' queues until ContinueGeneration. Modes, as SGLang's:
"abort" (the default) aborts every request in flight, "retract" moves the running ones back to
the waiting queue with their KV freed (recomputed on continue; their outputs go on without a
lost or repeated token), "in_place" just stops stepping, KV kept. Both calls are idempotent.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import Message

from meshlm.common.errors import MeshError, invalid
from meshlm.common.logs import get_logger
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.core import GatewayCore
from meshlm.gateway.mesh.fanout import failures, on_every, partial_failure
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
DEFAULT_MODE = "abort"  # SGLang's PauseGenerationReqInput.mode default
_DONE = {"abort": "aborted", "retract": "retracted", "in_place": "kept in place"}
PAUSE_TIMEOUT = 40.0  # seconds; a scheduler waits up to 30 s for its engine loop's step boundary


class PauseRPCs:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def PauseGeneration(self, req: pb.PauseGenerationRequest,
                              ctx: CallContext) -> pb.PauseGenerationResponse:
        """Pause every scheduler in `req.mode` (empty: "abort"); pausing again applies the
        new mode and says it was paused already."""
        mode = req.mode or DEFAULT_MODE
        if mode not in PAUSE_MODES:
            raise invalid("mode", f"must be one of {', '.join(PAUSE_MODES)}; got {req.mode!r}")
        replies = await self._every_scheduler("Pause", scheduler_pb2.PauseRequest(mode=mode))
        n, touched = len(replies), sum(r.requests for r in replies)
        already = sum(r.already_paused for r in replies)
        done = f"{touched} request(s) {_DONE[mode]}"
        if already == n:
            message = (f"Generation was already paused on {n} scheduler(s); mode {mode} "
                       f"applied: {done}.")
        else:
            message = f"Generation paused (mode {mode}) on {n} scheduler(s): {done}."
            if already:
                message += f" {already} of them were paused already."
        log.info("generation_paused", mode=mode, schedulers=n, requests=touched, already=already)
        return pb.PauseGenerationResponse(message=message)

    async def ContinueGeneration(self, req: pb.ContinueGenerationRequest,
                                 ctx: CallContext) -> pb.ContinueGenerationResponse:
        """Let every scheduler step again; harmless when none was paused."""
        replies = await self._every_scheduler("Continue", scheduler_pb2.ContinueRequest())
        n, was = len(replies), sum(r.was_paused for r in replies)
        if not was:
            message = f"Generation was not paused on any of {n} scheduler(s); nothing to continue."
        else:
            message = f"Generation continued on {n} scheduler(s)."
            if was < n:
                message += f" {n - was} of them were not paused."
        log.info("generation_continued", schedulers=n, were_paused=was)
        return pb.ContinueGenerationResponse(message=message)

    async def _every_scheduler(self, rpc: str, request: Message) -> list[Any]:
        """`rpc` on every scheduler replica at once, their replies in order. UNAVAILABLE
        naming the replicas that failed (the others did it; calling again is harmless)."""
        schedulers = list(self.core.deps.addresses["scheduler"])
        if not schedulers:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "no scheduler is configured")
        results = await on_every(self.core.channels, schedulers, lambda ch: getattr(
            scheduler_pb2_grpc.SchedulerStub(ch), rpc)(request, timeout=PAUSE_TIMEOUT))
        failed = failures(schedulers, results)
        if failed:
            log.warning("scheduler_control_failed", rpc=rpc, failed=failed)
            raise partial_failure(rpc, failed, len(schedulers))
        return results
