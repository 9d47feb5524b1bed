"""Faults with every in-flight request accounted for: kill -9 of a scheduler, a tokenizer and a
detokenizer mid-stream (the requests they held end with UNAVAILABLE within 2 s, the others
finish, new requests go to the remaining replicas, a restarted replica rejoins); Redis
restarted mid-load; SIGTERM of a gateway under load (it drains, then exits)."""

from __future__ import annotations

import signal
import time
import uuid

import grpc
import httpx
import pytest
from helpers import (
    Stream,
    collect_text,
    dependencies,
    end_spared,
    finished_in_full,
    recorded_failed,
    routes,
    scheduler_busy,
    server_info,
    serves,
    streaming,
    text_request,
    wait_until,
)
from two_of_each import mesh2, registry, stub  # noqa: F401 (fixtures)

from meshlm.gateway.mesh.registry import key
from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

FAULT_BOUND = 2.0  # seconds from a kill to the end of the requests it held


def replica(mesh2: Mesh, role: str, index: int) -> str:
    return mesh2.replicas(role)[index].name


def serves_again(stub, **fields: object) -> None:
    """Wait until a fresh request completes (the mesh noticed a replica coming back)."""
    wait_until(lambda: serves(stub, **fields), timeout=60,
               what=f"a request with {fields} to succeed")


def assert_ended_unavailable(streams: list[Stream], killed_at: float) -> None:
    for s in streams:
        s.join()
        assert s.code() == grpc.StatusCode.UNAVAILABLE, (
            s.rid, s.code(), dict(s.messages[-1].meta_info))  # how it ended instead
        assert s.ended_at - killed_at <= FAULT_BOUND, (s.rid, s.ended_at - killed_at)


def test_scheduler_killed_mid_stream(mesh2, stub, registry):
    doomed = [Stream(stub, f"on rank 0 #{i}", dp_rank=0, wait_first=False) for i in range(3)]
    spared = [Stream(stub, f"on rank 1 #{i}", dp_rank=1, max_new_tokens=300, wait_first=False)
              for i in range(2)]
    streaming(doomed + spared)
    killed_at = time.monotonic()
    mesh2.kill(replica(mesh2, "scheduler", 0))
    assert_ended_unavailable(doomed, killed_at)
    finished_in_full(spared, 300)
    recorded_failed(registry, doomed)
    # New requests go to the scheduler that is left, unless they insist on the dead one.
    for i in range(4):
        _, msgs = collect_text(stub, text_request(f"after the kill {i}", max_new_tokens=3))
        assert msgs[-1].finished
    pinned = text_request("to the dead one", max_new_tokens=2)
    pinned.routed_dp_rank = 0
    with pytest.raises(grpc.RpcError) as err:
        collect_text(stub, pinned)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Restarted on the same address, it rejoins without a gateway restart.
    mesh2.restart(replica(mesh2, "scheduler", 0))
    serves_again(stub, routed_dp_rank=0)


def test_detokenizer_killed_mid_stream(mesh2, stub, registry):
    streams = streaming([Stream(stub, f"detok {i} {uuid.uuid4().hex}", wait_first=False)
                         for i in range(6)])
    victim = mesh2.replicas("detokenizer")[0]
    # Killed as soon as they stream (their routes are read from the registry after), so none
    # can finish first, however slow the machine is between the steps of this test.
    killed_at = time.monotonic()
    mesh2.kill(victim.name)
    by_route = {s.rid: routes(registry, s.rid)["detokenizer"] for s in streams}
    doomed = [s for s in streams if by_route[s.rid] == victim.address]
    spared = [s for s in streams if by_route[s.rid] != victim.address]
    assert doomed and spared, by_route
    assert_ended_unavailable(doomed, killed_at)
    # The others keep streaming: abort them to end the test quickly, they end cleanly.
    end_spared(stub, spared)
    # The schedulers freed the doomed requests' slots (nobody is left to read them).
    recorded_failed(registry, doomed)
    wait_until(lambda: all(json_load.get("running") == 0 for json_load in loads(stub)),
               what="every scheduler to be idle")
    for i in range(4):
        _, msgs = collect_text(stub, text_request(f"after detok kill {i}", max_new_tokens=3))
        assert msgs[-1].finished
    mesh2.restart(victim.name)
    wait_until(lambda: all(dependencies(stub)["detokenizer"].values()), timeout=60,
               what="the detokenizer to rejoin")


def test_tokenizer_killed(mesh2, stub):
    running = [Stream(stub, f"tok {i}", max_new_tokens=200) for i in range(4)]
    victim = mesh2.replicas("tokenizer")[0]
    mesh2.kill(victim.name)
    # Requests past their tokenizer do not need it any more.
    for s in running:
        assert s.join().finished, (s.rid, s.error)
    for i in range(6):
        _, msgs = collect_text(stub, text_request(f"after tok kill {i}", max_new_tokens=2))
        assert msgs[-1].finished
    mesh2.restart(victim.name)
    wait_until(lambda: all(dependencies(stub)["tokenizer"].values()), timeout=60,
               what="the tokenizer to rejoin")


def test_redis_restarted_mid_load(mesh2, stub, registry):
    # Long (1900 tokens), so still running when Redis is killed: a final state written before
    # the kill would be lost with the Redis that held it (it persists nothing).
    streams = [Stream(stub, f"redis {i}") for i in range(4)]
    mesh2.kill("redis")
    assert not any(s.ended_at for s in streams), "a stream ended before Redis went away"
    during = [Stream(stub, f"without redis {i}", max_new_tokens=20) for i in range(3)]
    info = server_info(stub)
    assert info["registry_degraded"] is True
    assert "meshlm:registry_degraded 1.0" in metrics(mesh2)
    # An abort on another gateway still reaches the request (sent to every scheduler). That
    # gateway starts first: the victim (1900 tokens) could finish while it starts.
    other = mesh2.start_gateway(f"gateway-{uuid.uuid4().hex[:6]}")
    try:
        victim = Stream(stub, "abort me without redis")
        with grpc.insecure_channel(other.grpc_address) as ch:
            reply = sglang_pb2_grpc.SglangServiceStub(ch).Abort(pb.AbortRequest(rid=victim.rid),
                                                               timeout=10)
        assert reply.success
        assert victim.join().finished
        assert victim.messages[-1].meta_info["finish_reason"] == "abort"
    finally:
        other.stop(10)
        del mesh2.services[other.name]
    mesh2.restart("redis")
    for s in streams + during:
        assert s.join().finished, (s.rid, s.error)
    # Consistent again: every request's record says how it ended, including those that ran
    # or ended while Redis was away.
    for s in streams + during:
        wait_until(lambda s=s: registry.hget(key(s.rid), "state") == "finished", timeout=10,
                   what=f"{s.rid}'s record after the restart")
    wait_until(lambda: server_info(stub)["registry_degraded"] is False, what="recovery")
    assert "meshlm:registry_degraded 0.0" in metrics(mesh2)


def test_gateway_sigterm_drains_in_flight_requests(mesh2, registry):
    extra = mesh2.start_gateway("gateway-drain")
    with grpc.insecure_channel(extra.grpc_address) as ch:
        stub = sglang_pb2_grpc.SglangServiceStub(ch)
        streams = [Stream(stub, f"drain {i}", max_new_tokens=150) for i in range(4)]
        extra.send_signal(signal.SIGTERM)
        for s in streams:
            assert s.join().finished, (s.rid, s.error)
            assert s.messages[-1].meta_info["completion_tokens"] == "150"
        wait_until(lambda: extra.returncode is not None, timeout=30, what="the gateway to exit")
        assert extra.returncode == 0
        with pytest.raises(grpc.RpcError) as err:
            collect_text(stub, text_request("too late", max_new_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_gateway_killed_its_requests_end_in_the_mesh(mesh2, stub):
    """A gateway that dies aborts nothing itself: the detokenizers' streams to it fail, and
    they end its requests in the schedulers (no orphaned generation, no outputs piling up for
    a peer that is gone); the other gateway serves on."""
    doomed = mesh2.start_gateway("gateway-doomed")
    with grpc.insecure_channel(doomed.grpc_address) as ch:
        orphans = [Stream(sglang_pb2_grpc.SglangServiceStub(ch), f"orphan {i}")
                   for i in range(4)]  # 1900 tokens each: far longer than the test
        killed_at = time.monotonic()
        mesh2.kill(doomed.name)
        for s in orphans:
            assert s.join().code() == grpc.StatusCode.UNAVAILABLE, (s.rid, s.error)
    schedulers = [p.address for p in mesh2.replicas("scheduler")]
    wait_until(lambda: all(scheduler_busy(mesh2, a) == 0 for a in schedulers), timeout=10,
               what="the schedulers to end the dead gateway's requests")
    assert time.monotonic() - killed_at < 10
    logs = "".join(p.log_path.read_text() for p in mesh2.replicas("detokenizer"))
    assert '"event":"gateway_lost"' in logs
    _, msgs = collect_text(stub, text_request("the other gateway", max_new_tokens=3))
    assert msgs[-1].finished


def loads(stub) -> list[dict]:
    import json

    return json.loads(stub.GetLoad(pb.GetLoadRequest(), timeout=10).json_info)


def metrics(mesh2: Mesh) -> str:
    return httpx.get(f"{mesh2.addresses.gateway_http}/metrics", timeout=10).text
