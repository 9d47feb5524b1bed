"""The gateway's view of the services it depends on, kept live with grpc.health.v1 Watch.

Each configured tokenizer, scheduler and detokenizer address gets one watcher; the gateway is
ready while every role has at least one SERVING replica, and `on_change` fires on each flip.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.logs import get_logger

log = get_logger(__name__)

ROLES = ("tokenizer", "scheduler", "detokenizer")


class Dependencies:
    def __init__(self, channels: ChannelPool, addresses: Mapping[str, Sequence[str]],
                 on_change: Callable[[bool], None],
                 on_down: Callable[[str, str], None] | None = None) -> None:
        self._channels = channels
        self.addresses = {role: list(addresses.get(role, ())) for role in ROLES}
        self._serving: dict[str, bool] = {}
        self._on_change = on_change
        self._on_down = on_down
        self._ready = False
        self._tasks: list[asyncio.Task[None]] = []
        self._rr = {role: itertools.count() for role in ROLES}

    def start(self) -> None:
        for role, addrs in self.addresses.items():
            for address in addrs:
                self._tasks.append(asyncio.create_task(self._watch(role, address)))

    @property
    def ready(self) -> bool:
        return self._ready

    def serving(self, role: str) -> list[str]:
        return [a for a in self.addresses[role] if self._serving.get(a)]

    def pick(self, role: str) -> str | None:
        """Round-robin over the serving replicas of a role."""
        live = self.serving(role)
        if not live:
            return None
        return live[next(self._rr[role]) % len(live)]

    def status(self) -> dict[str, dict[str, bool]]:
        return {role: {a: bool(self._serving.get(a)) for a in addrs}
                for role, addrs in self.addresses.items()}

    def _set(self, role: str, address: str, serving: bool) -> None:
        was = self._serving.get(address)
        if was != serving:
            log.info("dependency_health", role=role, address=address, serving=serving)
        self._serving[address] = serving
        if was and not serving and self._on_down is not None:
            self._on_down(role, address)
        ready = all(self.serving(r) for r in ROLES)
        if ready != self._ready:
            self._ready = ready
            self._on_change(ready)

    async def _watch(self, role: str, address: str) -> None:
        stub = health_pb2_grpc.HealthStub(self._channels.get(address))
        backoff = 0.1
        while True:
            try:
                call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
                async for reply in call:
                    self._set(role, address,
                              reply.status == health_pb2.HealthCheckResponse.SERVING)
                    backoff = 0.1
            except grpc.aio.AioRpcError:
                pass
            self._set(role, address, False)
            await asyncio.sleep(backoff)  # reconnect pause, not synchronisation
            backoff = min(backoff * 2, 1.0)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
