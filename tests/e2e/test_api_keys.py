"""API keys end to end, on a second mesh whose gateway has two keys: gRPC and HTTP refuse calls
without one (UNAUTHENTICATED / 401) and serve those with one; health, reflection and /metrics
stay open; the keys never reach argv, the backends or the logs."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import own_mesh

from meshlm.launch.mesh import BACKENDS, Mesh
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

KEYS = ("e2e-key-one-4f1c", "e2e-key-two-9b2d")
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def keyed_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with own_mesh(tmp_path_factory.mktemp("keyed-mesh"), api_keys=KEYS) as m:
        yield m


@pytest.fixture(scope="module")
def channel(keyed_mesh: Mesh) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(keyed_mesh.addresses.gateway_grpc) as ch:
        yield ch


@pytest.fixture(scope="module")
def http(keyed_mesh: Mesh) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed_mesh.addresses.gateway_http, timeout=60) as client:
        yield client


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def generate_request() -> pb.TextGenerateRequest:
    return pb.TextGenerateRequest(text="Once upon a time", stream=True, sampling_params=pb.
                                  SamplingParams(max_new_tokens=4, temperature=0.0))


def test_grpc_without_a_valid_key_is_unauthenticated(channel):
    stub = sglang_pb2_grpc.SglangServiceStub(channel)
    for metadata, message in ((None, "missing API key"), (bearer("wrong"), "invalid API key")):
        with pytest.raises(grpc.RpcError) as e:
            stub.Tokenize(pb.TokenizeRequest(text="hello"), metadata=metadata, timeout=30)
        assert e.value.code() == UNAUTHENTICATED
        assert e.value.details().startswith(message)
        if metadata is None:  # the refusal says what to send
            assert "authorization: Bearer <key>" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.TextGenerate(generate_request(), metadata=metadata, timeout=30))
        assert e.value.code() == UNAUTHENTICATED


def test_grpc_with_either_key_works(channel):
    stub = sglang_pb2_grpc.SglangServiceStub(channel)
    reply = stub.Tokenize(pb.TokenizeRequest(text="hello"), metadata=bearer(KEYS[0]), timeout=30)
    assert reply.count == len(reply.tokens) > 0
    messages = list(stub.TextGenerate(generate_request(), metadata=bearer(KEYS[1]), timeout=60))
    assert messages[-1].finished
    assert int(messages[-1].meta_info["completion_tokens"]) == sum(
        len(m.output_ids) for m in messages) > 0


def test_grpc_health_and_reflection_stay_open(channel):
    stub = sglang_pb2_grpc.SglangServiceStub(channel)
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).healthy
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="sglang.runtime.v1.SglangService"), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    answers = list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30))
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"sglang.runtime.v1.SglangService", "grpc.health.v1.Health"} <= names


def test_http_without_a_valid_key_is_401(http):
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = http.post("/v1/runtime/tokenize", json={"text": "hello"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["code"] == UNAUTHENTICATED.value[0] and r.json()["message"]
        r = http.post("/generate", json={"text": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["code"] == UNAUTHENTICATED.value[0]
        for path in ("/v1/models", "/v1/chat/completions"):
            r = http.request("GET" if path == "/v1/models" else "POST", path, headers=headers)
            assert r.status_code == 401
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"


def test_http_with_a_key_works(http):
    r = http.post("/v1/runtime/tokenize", json={"text": "hello"},
                  headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 200 and r.json()["tokens"]
    r = http.post("/generate", headers={"authorization": f"Bearer {KEYS[1]}"},
                  json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200
    assert r.json()["meta_info"]["completion_tokens"] > 0


def test_http_health_and_metrics_stay_open(http):
    assert http.get("/health").status_code == 200
    assert http.get("/v1/runtime/health").json() == {"healthy": True}
    r = http.get("/metrics")
    assert r.status_code == 200 and "vllm:e2e_request_latency_seconds" in r.text


def test_the_keys_stay_out_of_argv_backends_and_logs(keyed_mesh):
    gateway = keyed_mesh.service("gateway")
    assert not any(k in arg for k in KEYS for arg in gateway.args)
    assert gateway.env["MESHLM_API_KEY"] == ",".join(KEYS)
    for name in BACKENDS:
        assert "MESHLM_API_KEY" not in keyed_mesh.service(name).env
    for name in ("gateway", *BACKENDS):
        text = keyed_mesh.log_path(name).read_text()
        assert not any(k in text for k in KEYS), name
    assert "<2 redacted>" in keyed_mesh.log_path("gateway").read_text()
