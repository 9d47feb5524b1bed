"""UpdateWeightsFromDisk (and SGLang's /update_weights_from_disk).

New weights without restarting the mesh: the gateway checks the arguments and calls
`Scheduler.UpdateWeights` on every scheduler replica at once. Each checks the checkpoint (same
architecture, config, vocabulary and tensor shapes) while it goes on stepping, then, between two
steps, retracts its running requests to its waiting queue, empties its prefix cache, copies the
weights in and steps again: requests in flight finish on the new weights, no token lost or
repeated. A refused checkpoint leaves the old weights serving everywhere. GetModelInfo names the
new model_path afterwards: on this gateway at once, on the others within FOLLOW_INTERVAL
(`follow_checkpoint`). Updates from this gateway run one at a time, so every scheduler sees them
in the same order.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import PurePosixPath

import grpc

from meshlm.common.errors import MeshError, invalid
from meshlm.common.logs import get_logger
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.core import GatewayCore
from meshlm.gateway.mesh.fanout import failures, on_every, partial_failure
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
UPDATE_TIMEOUT = 600.0  # seconds; a scheduler waits for a step boundary, then loads
FOLLOW_INTERVAL = 2.0  # seconds between checks for an update made through another gateway
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass
class WeightsUpdate:
    model_path: str
    load_format: str
    schedulers: int
    retracted: int  # running requests moved back to the queue and recomputed (all schedulers)
    aborted: int
    seconds: float  # the slowest scheduler's

    @property
    def message(self) -> str:
        done = (f"Weights updated from {self.model_path} (load_format {self.load_format}) on "
                f"{self.schedulers} scheduler(s) in {self.seconds:.2f} s; "
                f"{self.retracted} running request(s) retracted and recomputed")
        return done + (f", {self.aborted} aborted." if self.aborted else ".")


class WeightsRPCs:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.lock = asyncio.Lock()  # one update at a time from this gateway

    async def UpdateWeightsFromDisk(self, req: pb.UpdateWeightsRequest,
                                    ctx: CallContext) -> pb.UpdateWeightsResponse:
        """New weights from `model_path` (absolute; the schedulers' filesystem) in
        `load_format` (auto | safetensors | dummy; default auto)."""
        update = await self.update_weights(
            req.model_path, req.load_format if req.HasField("load_format") else "")
        return pb.UpdateWeightsResponse(success=True, message=update.message)

    async def update_weights(self, model_path: str, load_format: str,
                             abort_all: bool = False) -> WeightsUpdate:
        """Update every scheduler; the error of a refusal (the same from every scheduler: its
        code and message), UNAVAILABLE naming the replicas that failed otherwise."""
        if not model_path:
            raise invalid("model_path", "must not be empty")
        if not PurePosixPath(model_path).is_absolute():
            raise invalid("model_path", f"must be an absolute path, got {model_path!r}")
        load_format = load_format or "auto"
        if load_format not in LOAD_FORMATS:
            raise invalid("load_format", f"must be one of {', '.join(LOAD_FORMATS)}; "
                                         f"got {load_format!r}")
        schedulers = list(self.core.deps.addresses["scheduler"])
        if not schedulers:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "no scheduler is configured")
        request = scheduler_pb2.UpdateWeightsRequest(model_path=model_path,
                                                     load_format=load_format,
                                                     abort_all=abort_all)
        async with self.lock:
            results = await on_every(self.core.channels, schedulers, lambda ch: (
                scheduler_pb2_grpc.SchedulerStub(ch).UpdateWeights(request,
                                                                   timeout=UPDATE_TIMEOUT)))
        replies = [r for r in results if isinstance(r, scheduler_pb2.UpdateWeightsResponse)]
        failed = failures(schedulers, results)
        if failed:
            log.warning("weights_update_failed", model_path=model_path, failed=failed,
                        updated=len(replies))
            errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            codes = {e.code() for e in errors}
            if not replies and len(codes) == 1 and not codes & _UNREACHABLE:  # refused everywhere
                raise MeshError(errors[0].code(), errors[0].details() or errors[0].code().name)
            raise partial_failure("UpdateWeightsFromDisk", failed, len(schedulers))
        self._note_checkpoint(replies[0].info)
        update = WeightsUpdate(
            model_path=model_path, load_format=load_format, schedulers=len(replies),
            retracted=sum(r.retracted for r in replies), aborted=sum(r.aborted for r in replies),
            seconds=max(r.seconds for r in replies))
        log.info("weights_updated", model_path=model_path, load_format=load_format,
                 schedulers=update.schedulers, retracted=update.retracted,
                 aborted=update.aborted, seconds=round(update.seconds, 3),
                 load_seconds=round(max(r.load_seconds for r in replies), 3))
        return update

    async def follow_checkpoint(self) -> None:
        """Notice an update made through another gateway: ask one serving scheduler (in turn)
        which checkpoint it serves and, if it is not the one this gateway names, take it."""
        address, model = self.core.deps.pick("scheduler"), self.core.model
        if address is None or model is None:
            return
        try:
            info = await scheduler_pb2_grpc.SchedulerStub(self.core.channels.get(address)).GetInfo(
                common_pb2.GetInfoRequest(), timeout=FOLLOW_INTERVAL)
        except grpc.aio.AioRpcError:
            return  # its health watch deals with a scheduler that does not answer
        if info.model_path and info.model_path != model.model_path:
            log.info("checkpoint_changed", model_path=info.model_path, was=model.model_path,
                     scheduler=address)
            self._note_checkpoint(info)

    def _note_checkpoint(self, scheduler_info: common_pb2.ModelInfo) -> None:
        """GetModelInfo names the new checkpoint: its path and config.json (the limits, from the
        tokenizer, do not change: the checkpoint had to match)."""
        model = self.core.model
        if model is None:
            return
        facts = json.loads(model.json_info) if model.json_info else {}
        new = json.loads(scheduler_info.json_info) if scheduler_info.json_info else {}
        if "config" in new:
            facts["config"] = new["config"]
        model.model_path = scheduler_info.model_path
        model.json_info = json.dumps(facts)
