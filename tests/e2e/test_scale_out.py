"""Two of everything: 2 gateways, 2 tokenizers, 2 schedulers, 2 detokenizers and Redis, all real
processes on loopback. Requests spread over the schedulers, a routing_key or session_id sticks,
routed_dp_rank picks a replica, and an abort on either gateway ends a request wherever it runs."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator

import grpc
import httpx
import pytest
import redis
from helpers import (
    TWO_OF_EACH,
    collect_text,
    mesh_credentials,
    mesh_redis,
    own_mesh,
    text_request,
    wait_until,
)

from meshlm.gateway.mesh.registry import key
from meshlm.launch.mesh import Mesh
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

LONG = {"max_new_tokens": 1900, "ignore_eos": True}


@pytest.fixture(scope="module")
def mesh2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with own_mesh(tmp_path_factory.mktemp("mesh2"), replicas=TWO_OF_EACH) as m:
        yield m


@pytest.fixture(scope="module")
def stubs(mesh2: Mesh) -> Iterator[list[sglang_pb2_grpc.SglangServiceStub]]:
    channels = [grpc.insecure_channel(g.grpc_address) for g in mesh2.replicas("gateway")]
    yield [sglang_pb2_grpc.SglangServiceStub(ch) for ch in channels]
    for ch in channels:
        ch.close()


@pytest.fixture(scope="module")
def registry(mesh2: Mesh) -> Iterator[redis.Redis]:
    client = mesh_redis(mesh2)
    yield client
    client.close()


def schedulers(mesh2: Mesh) -> list[str]:
    return [p.address for p in mesh2.replicas("scheduler")]


def load(mesh2: Mesh, address: str) -> scheduler_pb2.Load:
    with grpc.secure_channel(address, mesh_credentials(mesh2)) as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(scheduler_pb2.GetLoadRequest(),
                                                            timeout=10)


def record(registry: redis.Redis, rid: str) -> dict[str, str]:
    """The registry record once its writer has flushed it (writes leave the request path)."""
    wait_until(lambda: registry.hget(key(rid), "state") in ("finished", "aborted", "error"),
               what=f"the registry record of {rid}")
    return registry.hgetall(key(rid))


class Stream:
    """A long streaming request, drained in a thread so that it can be ended from elsewhere."""

    def __init__(self, stub, text: str, **fields: object) -> None:
        self.rid = f"s-{uuid.uuid4().hex[:10]}"
        sampling = {**LONG, **fields.pop("sampling", {})}  # type: ignore[dict-item]
        req = text_request(text, rid=self.rid, **sampling)
        for name, value in fields.items():
            setattr(req, name, value)
        self.call = stub.TextGenerate(req, timeout=120)
        self.first = next(self.call)
        self.messages = [self.first]
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        try:
            self.messages.extend(self.call)
        except grpc.RpcError as e:
            self.error = e

    def finish_reasons(self) -> list[str]:
        self.thread.join(60)
        assert not self.thread.is_alive(), f"{self.rid}: the stream did not end"
        assert self.error is None, self.error
        return [m.meta_info["finish_reason"] for m in self.messages if m.finished]


def test_every_replica_is_serving_and_listed(mesh2, stubs):
    for stub in stubs:
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    loads = [load(mesh2, a) for a in schedulers(mesh2)]
    assert len(loads) == 2 and all(x.max_running > 0 for x in loads)


def test_requests_spread_over_schedulers_and_the_registry_says_where(mesh2, stubs, registry):
    rids = []
    for i in range(16):
        rid = f"spread-{uuid.uuid4().hex[:8]}"
        text, msgs = collect_text(stubs[i % 2], text_request(f"prompt number {i} about {i * 7}",
                                                             rid=rid, max_new_tokens=3))
        assert msgs[-1].meta_info["finish_reason"] == "length" and text
        rids.append(rid)
    records = [record(registry, rid) for rid in rids]
    used = Counter(r["scheduler"] for r in records)
    assert set(used) == set(schedulers(mesh2)), used
    inboxes = {p.address for p in mesh2.replicas("gateway")}
    assert {r["gateway"] for r in records} == inboxes
    assert {r["tokenizer"] for r in records} <= {p.address for p in mesh2.replicas("tokenizer")}
    assert all(r["state"] == "finished" for r in records)


def test_same_routing_key_sticks_to_one_scheduler(mesh2, stubs, registry):
    for routing_key in ("user-a", "user-b", "user-c"):
        rids = []
        for i in range(6):
            rid = f"key-{uuid.uuid4().hex[:8]}"
            req = text_request(f"different prompt {i} {uuid.uuid4().hex}", rid=rid,
                               max_new_tokens=2)
            req.routing_key = routing_key
            collect_text(stubs[i % 2], req)
            rids.append(rid)
        assert len({record(registry, rid)["scheduler"] for rid in rids}) == 1, routing_key


def test_same_session_id_sticks_to_one_scheduler_over_grpc_and_http(mesh2, stubs, registry):
    """Upstream's session_id keys affinity when no routing_key is given: TextGenerate,
    Generate, native /generate and the transcoded route, on either gateway, each request with
    a prompt of its own."""
    bases = [g.http_address for g in mesh2.replicas("gateway")]

    def send(i: int, rid: str, session: str) -> None:
        way, gateway = i % 4, i // 4 % 2
        fresh = uuid.uuid4().bytes
        sampling = {"max_new_tokens": 2}
        if way == 0:
            req = text_request(f"a new turn {fresh.hex()}", rid=rid, **sampling)
            req.session_id = session
            collect_text(stubs[gateway], req)
        elif way == 1:
            req = pb.GenerateRequest(input_ids=list(fresh[:8]), rid=rid, session_id=session,
                                     sampling_params=pb.SamplingParams(**sampling))
            assert list(stubs[gateway].Generate(req, timeout=60))[-1].finished
        else:
            path = "/generate" if way == 2 else "/v1/runtime/text_generate"
            r = httpx.post(f"{bases[gateway]}{path}", timeout=60, json={
                "text": f"a new turn {fresh.hex()}", "rid": rid, "session_id": session,
                "sampling_params": sampling})
            assert r.status_code == 200, r.text

    for session in ("conv-a", "conv-b", "conv-c"):
        rids = [f"conv-{uuid.uuid4().hex[:8]}" for _ in range(8)]
        for i, rid in enumerate(rids):
            send(i, rid, session)
        assert len({record(registry, rid)["scheduler"] for rid in rids}) == 1, session


def test_routed_dp_rank_picks_the_replica(mesh2, stubs, registry):
    for rank, address in enumerate(schedulers(mesh2)):
        rid = f"rank-{uuid.uuid4().hex[:8]}"
        req = text_request("pinned", rid=rid, max_new_tokens=2)
        req.routed_dp_rank = rank
        collect_text(stubs[1 - rank], req)
        assert record(registry, rid)["scheduler"] == address
    req = text_request("nowhere", max_new_tokens=2)
    req.routed_dp_rank = 2
    with pytest.raises(grpc.RpcError) as err:
        collect_text(stubs[0], req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "routed_dp_rank: must be in [0, 2)" in err.value.details()


def test_abort_on_the_other_gateway_ends_the_stream_and_frees_the_slot(mesh2, stubs, registry):
    stream = Stream(stubs[0], "abort me from elsewhere")
    scheduler = registry.hget(key(stream.rid), "scheduler")
    assert load(mesh2, scheduler).running >= 1
    reply = stubs[1].Abort(pb.AbortRequest(rid=stream.rid), timeout=10)
    assert reply.success
    assert stream.finish_reasons() == ["abort"]
    assert record(registry, stream.rid)["state"] == "aborted"
    wait_until(lambda: load(mesh2, scheduler).running == 0, what="the slot to be freed")
    # Idempotent: aborting what already ended is acknowledged again.
    assert stubs[1].Abort(pb.AbortRequest(rid=stream.rid), timeout=10).success
    assert stubs[0].Abort(pb.AbortRequest(rid=stream.rid), timeout=10).success


def test_abort_on_the_other_gateway_ends_every_sample_of_n(mesh2, stubs, registry):
    stream = Stream(stubs[1], "many samples", sampling={"n": 3, "temperature": 0.7})
    assert stubs[0].Abort(pb.AbortRequest(rid=stream.rid), timeout=10).success
    reasons = stream.finish_reasons()
    assert reasons == ["abort"] * 3, reasons
    scheduler = record(registry, stream.rid)["scheduler"]
    wait_until(lambda: load(mesh2, scheduler).running == 0, what="every sample to be freed")


def test_abort_all_from_one_gateway_empties_every_scheduler(mesh2, stubs):
    streams = [Stream(stubs[rank], f"busy {rank}", routed_dp_rank=rank) for rank in (0, 1)]
    streams += [Stream(stubs[0], "busy again", routed_dp_rank=1)]
    assert all(load(mesh2, a).running >= 1 for a in schedulers(mesh2))
    assert stubs[1].Abort(pb.AbortRequest(abort_all=True), timeout=10).success
    for s in streams:  # every open gRPC stream, whichever gateway holds it, ends CANCELLED
        s.thread.join(60)
        assert s.error is not None and s.error.code() == grpc.StatusCode.CANCELLED, s.error
        assert "aborted" in s.error.details()
    for address in schedulers(mesh2):
        wait_until(lambda a=address: load(mesh2, a).running == 0 and load(mesh2, a).waiting == 0,
                   what=f"{address} to be empty")


def test_abort_before_the_request_runs_still_wins(mesh2, stubs, registry):
    """The request waits in its scheduler's queue (generation paused in place) when the other
    gateway aborts it: it never runs, and its stream ends with abort."""
    stubs[0].PauseGeneration(pb.PauseGenerationRequest(mode="in_place"), timeout=60)
    try:
        rid = f"early-{uuid.uuid4().hex[:8]}"
        req = text_request("never runs", rid=rid, **LONG)
        call = stubs[0].TextGenerate(req, timeout=60)
        wait_until(lambda: registry.exists(key(rid)), what="the request to be registered")
        scheduler = registry.hget(key(rid), "scheduler")
        wait_until(lambda: load(mesh2, scheduler).waiting == 1, what="the request to queue")
        assert stubs[1].Abort(pb.AbortRequest(rid=rid), timeout=10).success
        messages = list(call)
    finally:
        stubs[0].ContinueGeneration(pb.ContinueGenerationRequest(), timeout=60)
    assert messages[-1].finished and messages[-1].meta_info["finish_reason"] == "abort"
    assert int(messages[-1].meta_info["completion_tokens"]) == 0
