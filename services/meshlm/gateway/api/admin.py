"""Abort and FlushCache, mixed into GatewayAPI: the RPCs that reach into the schedulers.

Abort finds a request wherever it runs: in this gateway's own table, else in the RID registry
(the scheduler that runs it, how many samples it has), so an abort on any gateway ends it.
With the registry unreachable it fails open: the abort goes to every scheduler this gateway
knows, each of which ends the request if it has it, or remembers its rid for 60 s in case the
request is still on its way (so an abort that overtakes its request still wins). Aborts are
idempotent: aborting a request that already ended succeeds.
"""

from __future__ import annotations

import grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.common.rpc import CallContext
from meshlm.gateway.mesh.dependencies import Dependencies
from meshlm.gateway.mesh.fanout import on_every
from meshlm.gateway.mesh.inbox import RequestTable
from meshlm.gateway.mesh.registry import RidRegistry
from meshlm.gateway.protocol.choices import child_rids
from meshlm.gateway.protocol.validation import MAX_N
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

ABORT_TIMEOUT = 10.0  # seconds
FLUSH_TIMEOUT = 40.0  # seconds; a scheduler waits up to 30 s for its engine loop


class AdminRPCs:
    deps: Dependencies
    channels: ChannelPool
    table: RequestTable
    registry: RidRegistry

    async def Abort(self, req: pb.AbortRequest, ctx: CallContext) -> pb.AbortResponse:
        # Broadcasts go to every known scheduler, not only those this gateway has seen SERVING
        # yet (a gateway that just started may not have heard from all); only a SERVING one
        # that does not answer makes the abort fail.
        known = list(self.deps.addresses["scheduler"])
        if req.abort_all:
            replies = await on_every(self.channels, known, lambda ch: _abort(ch, [], True))
            return pb.AbortResponse(success=_all_answered(known, replies, "abort_all",
                                                          self.deps.serving("scheduler")))
        if not req.rid:
            raise MeshError(grpc.StatusCode.INVALID_ARGUMENT, "rid: give a rid or abort_all")
        # A request with n > 1 samples is its children: aborting it aborts them all.
        members = self.table.members(req.rid)
        if members:  # this gateway's: the children share one scheduler
            schedulers, rids = [members[0].scheduler], [m.rid for m in members]
        else:
            record = await self.registry.get(req.rid)
            if record is None and self.registry.degraded:
                # Fail-open: every scheduler this gateway knows, every child the rid may have.
                replies = await on_every(self.channels, known, lambda ch: _abort(
                    ch, sorted({req.rid, *child_rids(req.rid, MAX_N)}), False))
                return pb.AbortResponse(success=_all_answered(known, replies, req.rid,
                                                              self.deps.serving("scheduler")))
            elif record is None or not record.get("scheduler"):
                return pb.AbortResponse(success=False)
            elif record.get("state") not in ("queued", "running"):
                return pb.AbortResponse(success=True)  # already over: nothing to do
            else:
                schedulers = [record["scheduler"]]
                rids = child_rids(req.rid, int(record.get("n") or 1))
        replies = await on_every(self.channels, schedulers, lambda ch: _abort(ch, rids, False))
        return pb.AbortResponse(success=_all_answered(schedulers, replies, req.rid))

    async def abort_in_scheduler(self, scheduler: str, rids: list[str]) -> None:
        """End requests of this gateway in their scheduler (client gone, a sibling failed)."""
        replies = await on_every(self.channels, [scheduler], lambda ch: _abort(ch, rids, False))
        _all_answered([scheduler], replies, ",".join(rids))

    async def FlushCache(self, req: pb.FlushCacheRequest,
                         ctx: CallContext) -> pb.FlushCacheResponse:
        """Empty the prefix cache of every scheduler replica; success only if all did. A
        scheduler refuses while it has requests running or waiting."""
        schedulers = list(self.deps.addresses["scheduler"])
        replies = await on_every(self.channels, schedulers, lambda ch: scheduler_pb2_grpc.
                                 SchedulerStub(ch).FlushCache(scheduler_pb2.FlushCacheRequest(),
                                                              timeout=FLUSH_TIMEOUT))
        refused = []
        for address, reply in zip(schedulers, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError):
                log.warning("flush_cache_failed", scheduler=address, error=reply.details())
                refused.append(f"{address}: unreachable ({reply.code().name})")
            elif not reply.success:
                refused.append(f"{address}: {reply.message}")
        if refused:
            return pb.FlushCacheResponse(success=False, message=(
                f"not flushed on {len(refused)} of {len(schedulers)} scheduler(s): "
                + "; ".join(refused)))
        return pb.FlushCacheResponse(
            success=True, message=f"flushed the prefix cache of {len(schedulers)} scheduler(s)")


def _abort(channel: grpc.aio.Channel, rids: list[str],
           all_: bool) -> grpc.aio.UnaryUnaryCall[scheduler_pb2.AbortRequest,
                                                  scheduler_pb2.AbortResponse]:
    return scheduler_pb2_grpc.SchedulerStub(channel).Abort(
        scheduler_pb2.AbortRequest(rids=rids, all=all_, reason="abort"), timeout=ABORT_TIMEOUT)


def _all_answered(schedulers: list[str], replies: list[object], what: str,
                  required: list[str] | None = None) -> bool:
    """True when every scheduler in `required` (default: all) acknowledged; the ones that did
    not are logged."""
    ok = True
    for address, reply in zip(schedulers, replies, strict=True):
        if isinstance(reply, grpc.aio.AioRpcError):
            log.warning("abort_failed", scheduler=address, what=what, error=reply.details())
            ok = ok and required is not None and address not in required
    return ok
