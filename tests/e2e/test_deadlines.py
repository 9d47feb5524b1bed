"""Client deadlines: a gRPC deadline or an HTTP `grpc-timeout` header ends a request that runs
past it with DEADLINE_EXCEEDED / 504, within a bound, with its slot freed in the scheduler and
its registry record closed; a malformed header is a 400 that names it."""

from __future__ import annotations

import time
import uuid

import grpc
import httpx
import pytest
from helpers import (
    mesh_redis,
    text_request,
    wait_idle,
    wait_until,
)

from meshlm.gateway.mesh.registry import key

LONG = {"max_new_tokens": 1900, "ignore_eos": True}
# A third of LONG's time alone on a quiet machine (1900 tokens once took the tiny model 1.49 s,
# past a deadline of 1.5 s), so the request is still running when its deadline passes.
DEADLINE_S = 0.5


@pytest.fixture(scope="module")
def registry(mesh):
    client = mesh_redis(mesh)
    yield client
    client.close()


def _closed(registry, rid: str) -> dict[str, str]:
    wait_until(lambda: registry.hget(key(rid), "state") in ("aborted", "error"),
               what=f"the registry record of {rid} to close")
    return registry.hgetall(key(rid))


def test_grpc_deadline_ends_a_long_stream(mesh, stub, registry):
    rid = f"dl-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    got = 0
    with pytest.raises(grpc.RpcError) as err:
        request = text_request("a long story", rid=rid, **LONG)
        for msg in stub.TextGenerate(request, timeout=DEADLINE_S):
            got += len(msg.output_ids) or 1
    elapsed = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got > 0  # it streamed until the deadline, then ended
    assert elapsed < DEADLINE_S + 2.0, elapsed
    assert _closed(registry, rid)["state"] in ("aborted", "error")
    wait_idle(mesh)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "a long story", "sampling_params": LONG}),
    ("/v1/completions", {"prompt": "a long story", "max_tokens": 1900,
                         "ignore_eos": True}),
])
def test_http_grpc_timeout_header_ends_a_request_with_504(mesh, registry, path, body):
    rid = f"dl-{uuid.uuid4().hex[:8]}"
    if path == "/generate":
        body = {**body, "rid": rid}
    started = time.monotonic()
    r = httpx.post(f"{mesh.addresses.gateway_http}{path}", json=body,
                   headers={"grpc-timeout": f"{int(DEADLINE_S * 1000)}m"}, timeout=30)
    elapsed = time.monotonic() - started
    assert r.status_code == 504, r.text
    assert "deadline passed" in r.text
    assert elapsed < DEADLINE_S + 2.0, elapsed
    if path == "/generate":
        assert _closed(registry, rid)["finish_reason"] == "deadline_exceeded"
    wait_idle(mesh)


def test_a_deadline_long_enough_changes_nothing(mesh, stub):
    msgs = list(stub.TextGenerate(text_request("short", max_new_tokens=4, ignore_eos=True),
                                  timeout=60))
    assert msgs[-1].finished and msgs[-1].meta_info["finish_reason"] == "length"
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", headers={"grpc-timeout": "60S"},
                   json={"text": "short", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["soon", "10", "5X", "123456789S", ""])
def test_a_malformed_grpc_timeout_header_is_a_400(mesh, value):
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", headers={"grpc-timeout": value},
                   json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert r.status_code == 400, r.text
    assert "grpc-timeout" in r.json()["error"]["message"]
