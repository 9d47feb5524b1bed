"""Discovery: replicas that come and go while the gateway runs, found two ways and applied
every `interval` seconds.

- Redis heartbeats (`--discover`): the members of `meshlm:members:<role>` in `--redis-url`
  whose heartbeat has not expired (`common/announce.py` writes them).
- DNS names in a role list (`dns:///<name>:<port>`): every A and AAAA address of the name,
  e.g. a Kubernetes headless service, asked of the system resolver (search domains included,
  so short names work) or of `--dns-server`.

Each round diffs what these say against what discovery added before (`membership.diff`) and
adds or removes the difference; static entries are never touched. A source that fails keeps
its last known answer (logged once, and again when it recovers): a DNS or Redis blip must not
empty the gateway, while a replica that really died is dropped by its health watch at once and
by its expired heartbeat or its absence from DNS later.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Mapping, Sequence
from typing import Protocol

import dns.asyncresolver
import dns.exception
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from meshlm.common.announce import members_key
from meshlm.common.logs import get_logger
from meshlm.common.redis_client import NO_AUTH, RedisAuth
from meshlm.common.tasks import Periodic
from meshlm.gateway.mesh.dependencies import ROLES
from meshlm.gateway.mesh.membership import DnsName, diff, live_members, replica_address, wanted

log = get_logger(__name__)

DNS_TIMEOUT = 2.0  # seconds one resolution may take in all (retries included)


class Members(Protocol):
    """Where discovery applies its changes (`mesh/replicas.py`)."""

    def discovered(self, role: str) -> list[str]: ...

    async def add(self, role: str, address: str, server_name: str | None) -> None: ...

    async def remove(self, role: str, address: str) -> None: ...


def make_resolver(dns_server: str) -> dns.asyncresolver.Resolver:
    """The system resolver (/etc/resolv.conf, search domains), or one that asks only
    `dns_server` (host:port, [v6]:port, or a host on port 53)."""
    if not dns_server:
        resolver = dns.asyncresolver.Resolver()
    else:
        host, port = dns_server, 53
        if dns_server.rpartition(":")[2].isdigit() and (
                dns_server.startswith("[") or dns_server.count(":") == 1):
            host, _, port_text = dns_server.rpartition(":")
            port = int(port_text)
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host.strip("[]")]
        resolver.port = port
    resolver.lifetime = DNS_TIMEOUT
    return resolver


class Discovery:
    def __init__(self, members: Members, names: Mapping[str, Sequence[DnsName]], *,
                 redis_url: str = "", interval: float = 1.0, dns_server: str = "",
                 redis_auth: RedisAuth = NO_AUTH) -> None:
        self._members = members
        self._names = {role: list(names.get(role, ())) for role in ROLES}
        self.interval = interval
        self._redis = redis_auth.connect(
            redis_url, socket_timeout=1.0, socket_connect_timeout=1.0) if redis_url else None
        self._resolver = make_resolver(dns_server) if any(self._names.values()) else None
        self._heartbeats: dict[str, set[str]] = {role: set() for role in ROLES}
        self._answers: dict[DnsName, list[str]] = {}
        self._failing: set[str] = set()  # sources whose failure was logged
        self._periodic = Periodic("discovery", self.poll, interval)

    @property
    def enabled(self) -> bool:
        return self._redis is not None or self._resolver is not None

    def start(self) -> None:
        self._periodic.start()

    async def poll(self) -> None:
        """One round: ask every source, then add and remove the difference per role."""
        if self._redis is not None:
            await self._poll_heartbeats(self._redis)
        names = [n for role in ROLES for n in self._names[role]]
        await asyncio.gather(*(self._resolve(n) for n in dict.fromkeys(names)))
        for role in ROLES:
            if self._redis is None and not self._names[role]:
                continue
            want = wanted(self._heartbeats[role],
                          {n: self._answers.get(n, []) for n in self._names[role]})
            add, remove = diff(self._members.discovered(role), want)
            for address in remove:
                await self._members.remove(role, address)
            for address, server_name in add.items():
                await self._members.add(role, address, server_name)

    async def _poll_heartbeats(self, client: aioredis.Redis) -> None:
        try:
            async with client.pipeline(transaction=False) as pipe:
                pipe.time()
                for role in ROLES:
                    pipe.zrange(members_key(role), 0, -1, withscores=True)
                (seconds, micros), *entries = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("redis", exc)
            return
        self._recovered("redis")
        now = seconds + micros / 1e6
        for role, members in zip(ROLES, entries, strict=True):
            self._heartbeats[role] = live_members(dict(members), now)

    async def _resolve(self, name: DnsName) -> None:
        try:
            ips = await self._lookup(name.name)
        except dns.exception.DNSException as exc:
            self._failed(f"dns:{name.name}", exc)
            return
        self._recovered(f"dns:{name.name}")
        self._answers[name] = [replica_address(ip, name.port) for ip in ips]

    async def _lookup(self, name: str) -> list[str]:
        """Every A and AAAA address of `name`; a name with neither is an empty answer, a
        failure (NXDOMAIN, timeout, no server) raises."""
        with contextlib.suppress(ValueError):
            return [str(ipaddress.ip_address(name))]
        assert self._resolver is not None
        answers = await asyncio.gather(*(
            self._resolver.resolve(name, rdtype, search=True, raise_on_no_answer=False)
            for rdtype in ("A", "AAAA")))
        return [rdata.address for answer in answers if answer.rrset is not None
                for rdata in answer.rrset]

    def _failed(self, source: str, exc: Exception) -> None:
        if source not in self._failing:
            self._failing.add(source)
            log.warning("discovery_degraded", source=source, error=repr(exc),
                        keeping="the last known answer")

    def _recovered(self, source: str) -> None:
        if source in self._failing:
            self._failing.discard(source)
            log.info("discovery_restored", source=source)

    async def close(self) -> None:
        await self._periodic.close()
        if self._redis is not None:
            await self._redis.aclose()
