"""Abort and FlushCache: the RPCs that reach into the schedulers.

Abort finds a request wherever it runs: in this gateway's own table, else in the RID registry
(the scheduler that runs it, how many samples it has), so an abort on any gateway ends it.
With the registry unreachable it fails open: the abort goes to every scheduler this gateway
knows, each of which ends the request if it has it, or remembers its rid for 60 s in case the
request is still on its way (so an abort that overtakes its request still wins). Aborts are
idempotent, as SGLang's: aborting a request that already ended, or a rid nobody knows,
succeeds; the `meshlm-aborted` trailer (gRPC) or header and "aborted" field (HTTP) says how many
requests were ended, 0 when there was nothing to abort.
"""

from __future__ import annotations

import grpc

from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.core import GatewayCore
from meshlm.gateway.mesh.aborts import abort_call, all_answered
from meshlm.gateway.mesh.fanout import on_every
from meshlm.gateway.protocol.choices import child_rids
from meshlm.gateway.protocol.validation import MAX_N
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

ABORTED_KEY = "meshlm-aborted"  # how many requests an Abort ended
FLUSH_TIMEOUT = 40.0  # seconds; a scheduler waits up to 30 s for its engine loop


class AdminRPCs:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def Abort(self, req: pb.AbortRequest, ctx: CallContext) -> pb.AbortResponse:
        # Broadcasts go to every known scheduler, not only those this gateway has seen SERVING
        # yet (a gateway that just started may not have heard from all); only a SERVING one
        # that does not answer makes the abort fail.
        deps, channels = self.core.deps, self.core.channels
        known = list(deps.addresses["scheduler"])
        if req.abort_all:
            replies = await on_every(channels, known, lambda ch: abort_call(ch, [], True))
            return _answer(ctx, replies, all_answered(known, replies, "abort_all",
                                                      deps.serving("scheduler")))
        if not req.rid:
            raise MeshError(grpc.StatusCode.INVALID_ARGUMENT, "rid: give a rid or abort_all")
        # A request with n > 1 samples is its children: aborting it aborts them all.
        members = self.core.table.members(req.rid)
        if members:  # this gateway's: the children share one scheduler
            schedulers, rids = [members[0].scheduler], [m.rid for m in members]
        else:
            registry = self.core.registry
            record = await registry.find(req.rid)
            if record is None and registry.degraded:
                # Fail-open: every scheduler this gateway knows, every child the rid may have.
                replies = await on_every(channels, known, lambda ch: abort_call(
                    ch, sorted({req.rid, *child_rids(req.rid, MAX_N)}), False))
                return _answer(ctx, replies, all_answered(known, replies, req.rid,
                                                          deps.serving("scheduler")))
            if (record is None or not record.get("scheduler")
                    or record.get("state") not in ("queued", "running")):
                return _answer(ctx, [], True)  # unknown, or already over: nothing to do
            schedulers = [record["scheduler"]]
            rids = child_rids(req.rid, int(record.get("n") or 1))
        replies = await on_every(channels, schedulers, lambda ch: abort_call(ch, rids, False))
        return _answer(ctx, replies, all_answered(schedulers, replies, req.rid))

    async def FlushCache(self, req: pb.FlushCacheRequest,
                         ctx: CallContext) -> pb.FlushCacheResponse:
        """Empty the prefix cache of every scheduler replica; success only if all did. A
        scheduler refuses while it has requests running or waiting."""
        schedulers = list(self.core.deps.addresses["scheduler"])
        replies = await on_every(self.core.channels, schedulers, lambda ch: scheduler_pb2_grpc.
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


def _answer(ctx: CallContext, replies: list[object], success: bool) -> pb.AbortResponse:
    """Success (idempotent, as SGLang: true for a rid with nothing to abort); how many
    requests the schedulers ended goes back as `meshlm-aborted` (gRPC trailing metadata,
    an HTTP header)."""
    aborted = sum(r.aborted for r in replies if isinstance(r, scheduler_pb2.AbortResponse))
    ctx.trailers[ABORTED_KEY] = str(aborted)
    return pb.AbortResponse(success=success)
