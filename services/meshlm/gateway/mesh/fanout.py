"""One control call on many replicas at once (pause, continue, profiling), and the error that
names the replicas where it failed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.errors import MeshError

T = TypeVar("T")


async def on_every(channels: ChannelPool, addresses: Sequence[str],
                   call: Callable[[grpc.aio.Channel], Awaitable[T]]
                   ) -> list[T | grpc.aio.AioRpcError]:
    """`call` on each address's channel, concurrently: each reply or RPC error, in order. A
    call cancelled because its channel closed (the replica left while it ran) is a CANCELLED
    error. Any other exception is a bug and propagates."""
    results = await asyncio.gather(*(call(channels.get(a)) for a in addresses),
                                   return_exceptions=True)
    # gather returned, so this task was not cancelled: a CancelledError is the call's own.
    results = [left() if isinstance(r, asyncio.CancelledError) else r for r in results]
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, grpc.aio.AioRpcError):
            raise result
    return results  # type: ignore[return-value]


def left() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), details="the replica left the mesh")


def failures(addresses: Sequence[str], results: Sequence[object]) -> list[str]:
    """'address: CODE details' for each result that is an RPC error."""
    return [f"{address}: {r.code().name} {r.details()}"
            for address, r in zip(addresses, results, strict=True)
            if isinstance(r, grpc.aio.AioRpcError)]


def partial_failure(rpc: str, failed: list[str], total: int) -> MeshError:
    return MeshError(grpc.StatusCode.UNAVAILABLE, (
        f"{rpc} failed on {len(failed)} of {total} replica(s) ({'; '.join(failed)}); "
        "the others did it, and calling again is harmless"))
