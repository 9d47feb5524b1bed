"""API keys: the one check, the gRPC interceptor on a real grpc.aio server (unary and streaming
RPCs refused, health and reflection open) and the HTTP middleware (Status JSON or OpenAI's
error shape, health and /metrics open)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import orjson
import pytest
from flat_api import FlatApi
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshlm.common.metrics import GatewayMetrics
from meshlm.common.rpc import CallContext
from meshlm.common.server import Binding, GrpcServer
from meshlm.gateway.front.auth import ApiKeyInterceptor, ApiKeys
from meshlm.gateway.front.http_app import build_http_app
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

KEYS = ApiKeys(["alpha-key", "beta-key"])
MISSING = "missing API key"


def test_the_check_wants_a_bearer_token_that_is_one_of_the_keys():
    assert KEYS.check("Bearer alpha-key") is None
    assert KEYS.check("bearer beta-key") is None  # the scheme is case-insensitive
    assert KEYS.check("  Bearer   alpha-key ") is None
    for missing in (None, "", "Bearer", "Bearer ", "alpha-key", "Basic alpha-key"):
        problem = KEYS.check(missing)
        assert problem is not None and problem.startswith(MISSING)
        assert "authorization: Bearer <key>" in problem
    for wrong in ("Bearer alpha", "Bearer alpha-key2", "Bearer ALPHA-KEY"):
        assert KEYS.check(wrong) == "invalid API key"


def test_no_keys_means_no_check():
    assert not ApiKeys([]) and not ApiKeys([""])
    assert KEYS


# ---- gRPC ------------------------------------------------------------------------------------


class Servicer(sglang_pb2_grpc.SglangServiceServicer):
    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(tokens=[1, 2], count=2, input_text=request.text)

    async def TextGenerate(self, request: pb.TextGenerateRequest, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[pb.TextGenerateResponse]:
        for piece in ("a", "b"):
            yield pb.TextGenerateResponse(text=piece)

    async def HealthCheck(self, request: pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(healthy=True)


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = GrpcServer([Binding(sglang_pb2_grpc.add_SglangServiceServicer_to_server,
                                 Servicer(), "sglang.runtime.v1.SglangService")],
                        interceptors=[ApiKeyInterceptor(KEYS)])
    address = await server.start("127.0.0.1", 0, None)
    await server.set_serving(True)
    async with grpc.aio.insecure_channel(address) as ch:
        yield ch
    await server.stop(0)


def _key(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def _refused(call: Any, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (e.value.details() or "").startswith(message)


async def test_grpc_calls_without_the_right_key_are_unauthenticated(channel):
    stub = sglang_pb2_grpc.SglangServiceStub(channel)
    req = pb.TokenizeRequest(text="hi")
    await _refused(stub.Tokenize(req), MISSING)
    await _refused(stub.Tokenize(req, metadata=_key("nope")), "invalid API key")
    await _refused(stub.Tokenize(req, metadata=(("authorization", "alpha-key"),)), MISSING)
    reply = await stub.Tokenize(req, metadata=_key("beta-key"))
    assert list(reply.tokens) == [1, 2]


async def test_grpc_streams_are_checked_too(channel):
    stub = sglang_pb2_grpc.SglangServiceStub(channel)
    req = pb.TextGenerateRequest(text="hi")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [m async for m in stub.TextGenerate(req, metadata=_key("nope"))]
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    texts = [m.text async for m in stub.TextGenerate(req, metadata=_key("alpha-key"))]
    assert texts == ["a", "b"]


async def test_grpc_health_and_reflection_stay_open(channel):
    stub = sglang_pb2_grpc.SglangServiceStub(channel)
    assert (await stub.HealthCheck(pb.HealthCheckRequest())).healthy
    health = health_pb2_grpc.HealthStub(channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = [a async for a in reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
    names = {s.name for s in answers[0].list_services_response.service}
    assert "sglang.runtime.v1.SglangService" in names


# ---- HTTP ------------------------------------------------------------------------------------


class FakeApi:
    async def Tokenize(self, req: pb.TokenizeRequest, ctx: CallContext) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(tokens=[1, 2], count=2, input_text=req.text)

    async def generated(self, req: pb.TextGenerateRequest, ctx: CallContext,
                        express: object = None) -> AsyncIterator[pb.TextGenerateResponse]:
        yield pb.TextGenerateResponse(text="ok", finished=True, meta_info={
            "id": "r1", "prompt_tokens": "1", "completion_tokens": "1", "cached_tokens": "0",
            "finish_reason": "length"})

    def is_healthy(self) -> bool:
        return True

    def model_cards(self) -> list[pb.ModelCard]:
        return [pb.ModelCard(id="tiny", root="/models/tiny", max_model_len=64)]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = build_http_app(FlatApi(FakeApi()), metrics=GatewayMetrics(lambda: "tiny"),
                         keys=KEYS)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_http_without_the_right_key_is_401_with_the_status_json(client):
    for path in ("/v1/runtime/tokenize", "/generate", "/no/such/route"):
        r = await client.post(path, json={"text": "hi"})
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
        body = r.json()
        assert body["code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert body["message"].startswith(MISSING)
    r = await client.post("/v1/runtime/tokenize", json={"text": "hi"}, headers=_bearer("x"))
    assert r.status_code == 401 and r.json()["message"] == "invalid API key"


async def test_openai_paths_get_openais_error_shape(client):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"):
        r = await client.post(path, json={}, headers=_bearer("wrong"))
        assert r.status_code == 401, path
        assert r.json() == {"error": {"message": "invalid API key",
                                      "type": "invalid_request_error", "param": None,
                                      "code": "invalid_api_key"}}


async def test_http_with_a_key_reaches_the_routes(client):
    r = await client.post("/v1/runtime/tokenize", json={"text": "hi"},
                          headers=_bearer("alpha-key"))
    assert r.status_code == 200 and r.json()["tokens"] == [1, 2]
    r = await client.post("/generate", json={"text": "hi"}, headers=_bearer("beta-key"))
    assert r.status_code == 200 and orjson.loads(r.content)["text"] == "ok"
    r = await client.get("/v1/models", headers=_bearer("alpha-key"))
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


async def test_health_and_metrics_stay_open(client):
    assert (await client.get("/health")).status_code == 200
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in r.text
    # Only these exact paths: look-alikes are not open.
    for path in ("/metrics2", "/health/x", "/v1/runtime/health2"):
        assert (await client.get(path)).status_code == 401, path


async def test_anthropics_x_api_key_and_error_shape(client):
    r = await client.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": "invalid API key"}}
    r = await client.get("/v1/models", headers={"x-api-key": "alpha-key"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
