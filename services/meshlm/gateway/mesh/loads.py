"""The schedulers' load as the router sees it: each serving replica polled with GetLoad every
`interval` seconds, while there are two or more to choose between (with one, the router has
no choice to make, and polling it cost an idle gateway about a third of its event loop's CPU).
A replica that does not answer keeps no report (the router then counts only this gateway's
own requests there)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.tasks import Periodic
from meshlm.gateway.mesh.routing import Load
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc

POLL_INTERVAL = 0.5  # seconds


class LoadPoller:
    def __init__(self, channels: ChannelPool, schedulers: Callable[[], Sequence[str]],
                 interval: float = POLL_INTERVAL) -> None:
        self._channels = channels
        self._schedulers = schedulers
        self.interval = interval
        self.loads: dict[str, Load] = {}
        self._periodic = Periodic("load_poll", self.poll, interval)
        self.start, self.close = self._periodic.start, self._periodic.close

    async def poll(self) -> None:
        addresses = list(self._schedulers())
        if len(addresses) < 2:
            self.loads = {}
            return
        replies = await asyncio.gather(*(self._one(a) for a in addresses))
        self.loads = {a: load for a, load in zip(addresses, replies, strict=True)
                      if load is not None}

    async def _one(self, address: str) -> Load | None:
        stub = scheduler_pb2_grpc.SchedulerStub(self._channels.get(address))
        try:
            reply = await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=self.interval * 2)
        except grpc.aio.AioRpcError:
            return None
        return Load(running=reply.running, waiting=reply.waiting,
                    max_running=max(1, reply.max_running), token_usage=reply.token_usage)
