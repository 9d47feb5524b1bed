"""Discovery with real processes: backends that announce themselves in Redis join a gateway
started with --discover, leave it at once on SIGTERM and after their heartbeat expires when
killed; a DNS name with two addresses (a real DNS server on loopback) gives a gateway two
schedulers, and an answer that shrinks takes one away."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator

import grpc
import pytest
import redis
from helpers import collect_text, mesh_redis, own_mesh, text_request, wait_until

from meshlm.common.announce import members_key
from meshlm.gateway.mesh.registry import key
from meshlm.launch.dns_server import LoopbackDns
from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

DNS_NAME = "schedulers.meshlm.test"


@pytest.fixture(scope="module")
def discovering(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One of each; the backends announce in Redis, the gateway has no static list."""
    with own_mesh(tmp_path_factory.mktemp("discover"), discover=True) as m:
        yield m


@pytest.fixture(scope="module")
def registry(discovering: Mesh) -> Iterator[redis.Redis]:
    client = mesh_redis(discovering)
    yield client
    client.close()


def gateway_stub(mesh: Mesh, name: str = "gateway") -> sglang_pb2_grpc.SglangServiceStub:
    channel = grpc.insecure_channel(mesh.service(name).grpc_address)
    return sglang_pb2_grpc.SglangServiceStub(channel)


def schedulers_seen(stub: sglang_pb2_grpc.SglangServiceStub) -> dict[str, bool]:
    """The gateway's schedulers in dp-rank order, each with whether it is SERVING."""
    info = json.loads(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).json_info)
    return info["dependencies"]["scheduler"]


def scheduler_of(client: redis.Redis, stub, rank: int | None = None) -> str:
    """Run one short request (on dp rank `rank`, if given); the scheduler that served it."""
    rid = f"disc-{uuid.uuid4().hex[:10]}"
    req = text_request(f"where do I run {rid}", rid=rid, max_new_tokens=2)
    if rank is not None:
        req.routed_dp_rank = rank
    _, msgs = collect_text(stub, req)
    assert msgs[-1].meta_info["finish_reason"] == "length"
    wait_until(lambda: client.hget(key(rid), "state") == "finished",
               what=f"the registry record of {rid}")
    return str(client.hget(key(rid), "scheduler"))


def test_a_scheduler_joins_serves_and_leaves_on_sigterm(discovering, registry):
    stub = gateway_stub(discovering)
    first = discovering.service("scheduler").address
    assert schedulers_seen(stub) == {first: True}

    extra = discovering.start_backend("scheduler")
    wait_until(lambda: schedulers_seen(stub).get(extra.address) is True, timeout=15,
               what="the gateway to use the new scheduler")
    seen = schedulers_seen(stub)
    assert sorted(seen) == sorted([first, extra.address])
    rank = list(seen).index(extra.address)
    assert scheduler_of(registry, stub, rank) == extra.address
    assert scheduler_of(registry, stub, 1 - rank) == first

    # SIGTERM: it takes itself out of Redis before it stops (no waiting for expiry).
    discovering.kill(extra.name, signal.SIGTERM)
    wait_until(lambda: extra.returncode is not None, timeout=30, what="the scheduler to exit")
    assert registry.zscore(members_key("scheduler"), extra.address) is None
    wait_until(lambda: extra.address not in schedulers_seen(stub), timeout=10,
               what="the gateway to drop the scheduler")
    assert all(scheduler_of(registry, stub) == first for _ in range(3))


def test_a_killed_scheduler_drops_out_when_its_heartbeat_expires(discovering, registry):
    stub = gateway_stub(discovering)
    first = discovering.service("scheduler").address
    extra = discovering.start_backend("scheduler")
    wait_until(lambda: schedulers_seen(stub).get(extra.address) is True, timeout=15,
               what="the gateway to use the new scheduler")

    discovering.kill(extra.name)  # SIGKILL: no goodbye
    assert registry.zscore(members_key("scheduler"), extra.address) is not None
    # Its health watch says at once that it is gone; the entry lasts until it expires.
    wait_until(lambda: schedulers_seen(stub).get(extra.address) is not True, timeout=10,
               what="the gateway to stop using the killed scheduler")
    assert scheduler_of(registry, stub) == first
    wait_until(lambda: extra.address not in schedulers_seen(stub), timeout=15,
               what="the expired heartbeat to drop the scheduler")
    wait_until(lambda: registry.zscore(members_key("scheduler"), extra.address) is None,
               timeout=5, what="the other scheduler's next heartbeat to prune the entry")
    assert schedulers_seen(stub) == {first: True}
    assert scheduler_of(registry, stub, 0) == first


def test_a_dns_name_with_two_addresses_gives_two_schedulers(tmp_path):
    with LoopbackDns({DNS_NAME: ["127.0.0.2", "127.0.0.3"]}) as dns, own_mesh(
            tmp_path, sans=(DNS_NAME, "127.0.0.2", "127.0.0.3")) as mesh:
        # Two schedulers on one port, on two loopback addresses: one name's two "pods".
        a = mesh.start_backend("scheduler", host="127.0.0.2")
        port = a.address.rsplit(":", 1)[1]
        b = mesh.start_backend("scheduler", host="127.0.0.3", port=port)
        assert (a.address, b.address) == (f"127.0.0.2:{port}", f"127.0.0.3:{port}")
        mesh.start_gateway("gateway-dns", schedulers=f"dns:///{DNS_NAME}:{port}",
                           dns_server=dns.address)
        stub = gateway_stub(mesh, "gateway-dns")
        client = mesh_redis(mesh)
        try:
            assert schedulers_seen(stub) == {a.address: True, b.address: True}
            assert scheduler_of(client, stub, 0) == a.address
            assert scheduler_of(client, stub, 1) == b.address

            dns.set(DNS_NAME, ["127.0.0.3"])  # one pod left
            wait_until(lambda: list(schedulers_seen(stub)) == [b.address], timeout=10,
                       what="the gateway to drop the address DNS no longer gives")
            assert scheduler_of(client, stub) == b.address
            req = text_request("gone", max_new_tokens=2)
            req.routed_dp_rank = 1
            with pytest.raises(grpc.RpcError) as err:
                collect_text(stub, req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            client.close()
