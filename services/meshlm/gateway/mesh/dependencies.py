"""The gateway's view of the services it depends on, kept live with grpc.health.v1 Watch.

Each tokenizer, scheduler and detokenizer address gets one watcher; the gateway is ready while
every role has at least one SERVING replica, and `on_change` fires on each flip. Static
addresses come from the configuration; discovery (`mesh/discovery.py`) `add`s and `remove`s
others while the gateway runs. `addresses[role]` is the role's list in dp-rank order: static
entries as configured, then discovered ones sorted (`membership.ordered`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.logs import get_logger
from meshlm.gateway.mesh.membership import ordered

log = get_logger(__name__)

ROLES = ("tokenizer", "scheduler", "detokenizer")


class Dependencies:
    def __init__(self, channels: ChannelPool, addresses: Mapping[str, Sequence[str]],
                 on_change: Callable[[bool], None],
                 on_down: Callable[[str, str], None] | None = None) -> None:
        self._channels = channels
        self._static = {role: list(dict.fromkeys(addresses.get(role, ()))) for role in ROLES}
        self._discovered: dict[str, dict[str, str | None]] = {role: {} for role in ROLES}
        self.addresses = {role: list(self._static[role]) for role in ROLES}
        self._serving: dict[str, bool] = {}
        self._on_change = on_change
        self._on_down = on_down
        self._ready = False
        self._started = False
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._rr = {role: itertools.count() for role in ROLES}
        for role, addrs in self.addresses.items():
            for address in addrs:
                channels.for_role(role, address)  # its certificate is checked against the role

    def start(self) -> None:
        self._started = True
        for role, addrs in self.addresses.items():
            for address in addrs:
                self._start_watch(role, address)

    def discovered(self, role: str) -> list[str]:
        """The role's replicas that discovery added (not the static ones)."""
        return list(self._discovered[role])

    def add(self, role: str, address: str, server_name: str | None = None) -> bool:
        """A replica joins: watch its health (it is used once SERVING). `server_name` is the
        name its certificate is checked against (a DNS name it was resolved from). False if
        the role has it already. With --peer-tls-name the role's name wins."""
        if address in self.addresses[role]:
            return False
        server_name = self._channels.name_for(role) or server_name
        self._discovered[role][address] = server_name
        self.addresses[role] = ordered(self._static[role], self._discovered[role])
        log.info("dependency_added", role=role, address=address, server_name=server_name,
                 rank=self.addresses[role].index(address))
        if server_name is not None:
            self._channels.get(address, server_name)
        if self._started:
            self._start_watch(role, address)
        return True

    def remove(self, role: str, address: str) -> bool:
        """A discovered replica leaves: stop watching it and treat it as down (`on_down`
        ends its requests at once, as for a health flip). Static replicas never leave."""
        if address not in self._discovered[role]:
            return False
        task = self._tasks.pop((role, address), None)
        if task is not None:
            task.cancel()
        self._set(role, address, False)
        del self._discovered[role][address]
        self._serving.pop(address, None)
        self.addresses[role] = ordered(self._static[role], self._discovered[role])
        log.info("dependency_removed", role=role, address=address)
        return True

    def _start_watch(self, role: str, address: str) -> None:
        self._tasks[(role, address)] = asyncio.create_task(
            self._watch(role, address), name=f"health:{role}:{address}")

    @property
    def ready(self) -> bool:
        return self._ready

    def serving(self, role: str) -> list[str]:
        return [a for a in self.addresses[role] if self._serving.get(a)]

    def pick(self, role: str, usable: Callable[[str], bool] | None = None) -> str | None:
        """Round-robin over the serving replicas of a role (those `usable` allows)."""
        live = self.serving(role)
        if usable is not None:
            live = [a for a in live if usable(a)]
        if not live:
            return None
        return live[next(self._rr[role]) % len(live)]

    def status(self) -> dict[str, dict[str, bool]]:
        return {role: {a: bool(self._serving.get(a)) for a in addrs}
                for role, addrs in self.addresses.items()}

    def _set(self, role: str, address: str, serving: bool) -> None:
        if address not in self.addresses[role]:
            return  # removed meanwhile
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
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
