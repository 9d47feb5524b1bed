"""Bounded admission: past a gateway's limit of requests in flight, RESOURCE_EXHAUSTED / 429 at
once (never a queue that grows without bound or a hang), and service again once load drops."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator

import grpc
import httpx
import pytest
from helpers import mesh_credentials, own_mesh, scheduler_load, text_request, wait_until

from meshlm.launch.process import ServiceProcess
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

LONG = {"max_new_tokens": 1900, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_gateway(mesh) -> Iterator[ServiceProcess]:
    name = f"gateway-small-{uuid.uuid4().hex[:6]}"
    proc = mesh.start_gateway(name, max_inflight=3)
    yield proc
    proc.stop(10)
    del mesh.services[name]


@pytest.fixture(scope="module")
def small_stub(small_gateway) -> Iterator[sglang_pb2_grpc.SglangServiceStub]:
    with grpc.insecure_channel(small_gateway.grpc_address) as ch:
        yield sglang_pb2_grpc.SglangServiceStub(ch)


def test_gateway_refuses_past_its_limit_and_recovers(small_gateway, small_stub):
    rids = [f"busy-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    calls = [small_stub.TextGenerate(text_request("keep busy", rid=rid, **LONG), timeout=120)
             for rid in rids]
    for call in calls:
        next(call)  # running
    drained = [threading.Thread(target=_drain, args=(c,), daemon=True) for c in calls]
    for t in drained:
        t.start()

    _refused(small_stub, small_gateway.http_address, "3 requests in flight (limit 3)")
    # n samples count one each: 2 more would not fit even with one slot free.
    small_stub.Abort(pb.AbortRequest(rid=rids[0]), timeout=10)
    drained[0].join(30)
    wait_until(lambda: _in_flight(small_stub) == 2, what="the aborted request to leave")
    with pytest.raises(grpc.RpcError) as err:
        list(small_stub.TextGenerate(text_request("pair", max_new_tokens=2, n=2), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    msgs = list(small_stub.TextGenerate(text_request("fits", max_new_tokens=2), timeout=30))
    assert msgs[-1].finished

    small_stub.Abort(pb.AbortRequest(abort_all=True), timeout=10)
    for t in drained:
        t.join(30)
        assert not t.is_alive()


def _drain(call) -> None:
    """Read a stream to its end; an abort_all ends it CANCELLED."""
    with contextlib.suppress(grpc.RpcError):
        list(call)


def _refused(stub, http_base: str, why: str) -> None:
    """One more request, over gRPC and over HTTP, is refused at once: RESOURCE_EXHAUSTED / 429
    saying `why`."""
    with pytest.raises(grpc.RpcError) as err:
        list(stub.TextGenerate(text_request("one too many", max_new_tokens=2), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert why in err.value.details()
    r = httpx.post(f"{http_base}/generate", timeout=30,
                   json={"text": "over http", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 429, r.text
    assert why in r.json()["error"]["message"]


def _in_flight(stub) -> int:
    import json

    info = json.loads(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).json_info)
    return int(info["requests_in_flight"])


def test_scheduler_refuses_past_its_waiting_queue(tmp_path_factory):
    """A scheduler with one running slot and one waiting place: a third request ends at once
    with RESOURCE_EXHAUSTED (gRPC) / 429 (HTTP), the first two finish, and the queue takes
    requests again once it has room."""
    env = {"MESHLM_MAX_RUNNING": "1", "MESHLM_MAX_QUEUED": "1"}
    with own_mesh(tmp_path_factory.mktemp("queue"), env=env) as m, \
            grpc.insecure_channel(m.addresses.gateway_grpc) as ch:
        stub = sglang_pb2_grpc.SglangServiceStub(ch)
        running = stub.TextGenerate(text_request("first", **LONG), timeout=120)
        next(running)
        waiting = stub.TextGenerate(text_request("second", max_new_tokens=2), timeout=120)
        wait_until(lambda: scheduler_load(m, mesh_credentials(m)).waiting == 1,
                   what="the second request to wait")
        _refused(stub, m.addresses.gateway_http, "1 requests waiting (limit 1)")
        running.cancel()
        assert list(waiting)[-1].finished
        msgs = list(stub.TextGenerate(text_request("later", max_new_tokens=2), timeout=30))
        assert msgs[-1].finished
