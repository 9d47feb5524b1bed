"""Ending requests in their schedulers: the Abort call on one replica, and the check that every
replica that had to answer did."""

from __future__ import annotations

import grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.logs import get_logger
from meshlm.gateway.mesh.fanout import on_every
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc

log = get_logger(__name__)

ABORT_TIMEOUT = 10.0  # seconds


def abort_call(channel: grpc.aio.Channel, rids: list[str], all_: bool
               ) -> grpc.aio.UnaryUnaryCall[scheduler_pb2.AbortRequest,
                                            scheduler_pb2.AbortResponse]:
    return scheduler_pb2_grpc.SchedulerStub(channel).Abort(
        scheduler_pb2.AbortRequest(rids=rids, all=all_, reason="abort"), timeout=ABORT_TIMEOUT)


def all_answered(schedulers: list[str], replies: list[object], what: str,
                 required: list[str] | None = None) -> bool:
    """True when every scheduler in `required` (default: all) acknowledged; the ones that did
    not are logged."""
    ok = True
    for address, reply in zip(schedulers, replies, strict=True):
        if isinstance(reply, grpc.aio.AioRpcError):
            log.warning("abort_failed", scheduler=address, what=what, error=reply.details())
            ok = ok and required is not None and address not in required
    return ok


async def abort_in_scheduler(channels: ChannelPool, scheduler: str, rids: list[str]) -> None:
    """End requests of this gateway in their scheduler (client gone, a sibling failed)."""
    replies = await on_every(channels, [scheduler], lambda ch: abort_call(ch, rids, False))
    all_answered([scheduler], replies, ",".join(rids))
