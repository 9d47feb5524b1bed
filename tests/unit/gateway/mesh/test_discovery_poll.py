"""Discovery's rounds against a real Redis (heartbeats written by the real Announcer) and a real
DNS server on loopback, applied to a recording stand-in for the gateway's replicas."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from meshlm.common.announce import Announcer, members_key
from meshlm.gateway.mesh.discovery import Discovery
from meshlm.gateway.mesh.membership import DnsName
from meshlm.launch.dns_server import LoopbackDns
from meshlm.launch.redis_server import RedisServer

NAME = DnsName("schedulers.meshlm.test", 7000)


class Recorder:
    """The gateway side of discovery: what it holds per role, and every change in order."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, str | None]] = {}
        self.changes: list[tuple[str, str, str]] = []

    def discovered(self, role: str) -> list[str]:
        return list(self.held.get(role, {}))

    async def add(self, role: str, address: str, server_name: str | None) -> None:
        self.held.setdefault(role, {})[address] = server_name
        self.changes.append(("add", role, address))

    async def remove(self, role: str, address: str) -> None:
        del self.held[role][address]
        self.changes.append(("remove", role, address))


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture
def dns() -> Iterator[LoopbackDns]:
    with LoopbackDns({NAME.name: ["127.0.0.3", "127.0.0.2", "::1"]}) as d:
        yield d


async def test_heartbeats_join_leave_and_expire(server):
    members = Recorder()
    discovery = Discovery(members, {}, redis_url=server.url)
    a = Announcer(server.url, "scheduler", "127.0.0.1:2", interval=1.0)
    b = Announcer(server.url, "tokenizer", "127.0.0.1:3", interval=1.0)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        await a.beat()
        await b.beat()
        client.zadd(members_key("scheduler"), {"127.0.0.1:9": 1.0})  # a stale heartbeat
        await discovery.poll()
        assert members.held == {"scheduler": {"127.0.0.1:2": None},
                                "tokenizer": {"127.0.0.1:3": None}}
        await a.leave()  # graceful: gone at the next round
        await discovery.poll()
        assert members.held["scheduler"] == {}
        # An entry whose expiry passed (a replica killed without a word) drops out as well.
        seconds, _ = client.time()
        client.zadd(members_key("tokenizer"), {"127.0.0.1:3": seconds - 1})
        await discovery.poll()
        assert members.held["tokenizer"] == {}
        assert members.changes == [("add", "tokenizer", "127.0.0.1:3"),
                                   ("add", "scheduler", "127.0.0.1:2"),
                                   ("remove", "scheduler", "127.0.0.1:2"),
                                   ("remove", "tokenizer", "127.0.0.1:3")]
    finally:
        client.close()
        await b.leave()
        await discovery.close()


async def test_redis_away_keeps_what_was_known(server, caplog):
    members = Recorder()
    discovery = Discovery(members, {}, redis_url=server.url)
    announcer = Announcer(server.url, "detokenizer", "127.0.0.1:4", interval=1.0)
    await announcer.beat()
    await discovery.poll()
    server.stop()
    try:
        await discovery.poll()
        await discovery.poll()
        assert members.held == {"detokenizer": {"127.0.0.1:4": None}}
        assert [r.getMessage() for r in caplog.records].count("discovery_degraded") == 1
    finally:
        await announcer.leave()
        await discovery.close()


async def test_dns_answers_become_replicas_checked_against_the_name(dns):
    members = Recorder()
    discovery = Discovery(members, {"scheduler": [NAME]}, dns_server=dns.address)
    try:
        await discovery.poll()
        assert members.held == {"scheduler": {"127.0.0.2:7000": NAME.name,
                                              "127.0.0.3:7000": NAME.name,
                                              "[::1]:7000": NAME.name}}
        assert [c[2] for c in members.changes] == ["127.0.0.2:7000", "127.0.0.3:7000",
                                                   "[::1]:7000"]  # in rank order
        dns.set(NAME.name, ["127.0.0.2"])  # two pods went away
        await discovery.poll()
        assert list(members.held["scheduler"]) == ["127.0.0.2:7000"]
        # Failures keep the last answer: a server error, then a name that is gone (NXDOMAIN).
        dns.failing = True
        await discovery.poll()
        dns.failing = False
        dns.remove(NAME.name)
        await discovery.poll()
        assert list(members.held["scheduler"]) == ["127.0.0.2:7000"]
        dns.set(NAME.name, [])  # the name exists and has no address: nothing left
        await discovery.poll()
        assert members.held["scheduler"] == {}
    finally:
        await discovery.close()


async def test_ip_literals_need_no_dns():
    members = Recorder()
    discovery = Discovery(members, {"tokenizer": [DnsName("127.0.0.5", 1)]},
                          dns_server="127.0.0.1:1")
    await discovery.poll()
    assert members.held == {"tokenizer": {"127.0.0.5:1": "127.0.0.5"}}
    await discovery.close()
