"""The HTTP app over a fake api: transcoded routes, NDJSON streams, /flush_cache, /health,
/v1/models and error shapes. Native /generate and /encode: test_native_generate.py."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import orjson
import pytest
from fake_generation_api import FakeApi, http_client


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
async def client(api: FakeApi) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(api) as c:
        yield c


def _status(r: httpx.Response, http: int, code: grpc.StatusCode) -> str:
    assert r.status_code == http, r.text
    body = r.json()
    assert body["code"] == code.value[0] and body["details"] == []
    return str(body["message"])


def _lines(r: httpx.Response) -> list[Any]:
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [orjson.loads(line) for line in r.content.splitlines()]


# ---- transcoded routes -----------------------------------------------------------------------


async def test_unary(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/runtime/tokenize", json={"text": "hi"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"tokens": [1, 2], "count": 2, "max_model_len": 64, "input_text": "hi"}


async def test_query_binding(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/runtime/load", params={"dp_rank": "3"})
    assert r.json() == {"json_info": "rank=3"}
    r = await client.get("/v1/runtime/load", params={"dp_rnk": "3"})
    assert _status(r, 400, grpc.StatusCode.INVALID_ARGUMENT).startswith("dp_rnk: unknown field")


async def test_call_context(client: httpx.AsyncClient, api: FakeApi) -> None:
    headers = {"traceparent": "00-abc-def-01", "Authorization": "Bearer t"}
    await client.post("/v1/runtime/tokenize", json={"text": "hi"}, headers=headers)
    ctx = api.contexts[-1]
    assert ctx.transport == "http" and ctx.peer == "10.0.0.7:4242"
    assert ctx.metadata["traceparent"] == "00-abc-def-01"
    assert ctx.metadata["authorization"] == "Bearer t"


@pytest.mark.parametrize(
    ("body", "start"),
    [
        (b'{"txt": "hi"}', "txt: unknown field"),
        (b'{"text": ', "request body is not valid JSON: "),
        (b'{"text": "x", "add_special_tokens": "yes"}', "request body: Expected true or false"),
    ],
)
async def test_unary_invalid(client: httpx.AsyncClient, body: bytes, start: str) -> None:
    r = await client.post("/v1/runtime/tokenize", content=body)
    assert _status(r, 400, grpc.StatusCode.INVALID_ARGUMENT).startswith(start)


async def test_unimplemented(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/runtime/classify", json={"text": "a"})  # absent from the api
    assert "Classify" in _status(r, 501, grpc.StatusCode.UNIMPLEMENTED)
    r = await client.post("/v1/runtime/abort", json={"rid": "x"})  # raises UNIMPLEMENTED
    _status(r, 501, grpc.StatusCode.UNIMPLEMENTED)


async def test_unexpected_exception_is_500_and_logged(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        r = await client.post("/v1/runtime/tokenize", json={"text": "crash"})
    assert _status(r, 500, grpc.StatusCode.INTERNAL) == "internal error"
    assert any(rec.getMessage() == "http_request_failed" and rec.exc_info for rec in caplog.records)


async def test_unknown_path_and_wrong_method(client: httpx.AsyncClient) -> None:
    _status(await client.get("/v1/nowhere"), 404, grpc.StatusCode.NOT_FOUND)
    r = await client.get("/v1/runtime/tokenize")
    assert r.status_code == 405 and r.json()["code"] == grpc.StatusCode.UNIMPLEMENTED.value[0]


async def test_ndjson_stream(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/runtime/text_generate", json={"text": "hi", "stream": True})
    lines = _lines(r)
    assert [line["result"]["text"] for line in lines] == ["Hel", "lo", "!"]
    assert [line["result"]["finished"] for line in lines] == [False, False, True]
    assert lines[-1]["result"]["meta_info"]["finish_reason"] == "stop"


async def test_ndjson_mid_stream_error(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/runtime/text_generate", json={"text": "late", "stream": True})
    assert r.status_code == 200
    lines = _lines(r)
    assert lines[0]["result"]["text"] == "Hel"
    assert lines[1] == {"error": {"code": 8, "message": "out of KV cache", "details": []}}
    assert len(lines) == 2


async def test_stream_error_before_first_message_is_http_error(
    client: httpx.AsyncClient, api: FakeApi
) -> None:
    r = await client.post("/v1/runtime/text_generate", json={"text": "early", "stream": True})
    assert _status(r, 400, grpc.StatusCode.INVALID_ARGUMENT) == "text: not today"
    assert api.ended == [("early", False)]


async def test_ndjson_generate_ids(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/runtime/generate", json={"input_ids": [1], "stream": True})
    assert [line["result"]["output_ids"] for line in _lines(r)] == [[5], [6, 7]]


# ---- native /flush_cache ---------------------------------------------------------------------


async def test_native_flush_cache(client: httpx.AsyncClient, api: FakeApi) -> None:
    r = await client.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert (await client.get("/flush_cache")).status_code == 200
    api.flushable = False
    r = await client.post("/flush_cache")
    assert r.status_code == 400 and "requests are running" in r.text
    r = await client.post("/v1/runtime/flush_cache", json={})
    assert r.json() == {"success": False, "message": "s1: requests are running"}


# ---- /health and /v1/models ------------------------------------------------------------------


async def test_health(client: httpx.AsyncClient, api: FakeApi) -> None:
    r = await client.get("/health")
    assert r.status_code == 200 and r.content == b""
    api.healthy = False
    assert (await client.get("/health")).status_code == 503


async def test_models(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    [model] = body["data"]
    assert model["id"] == "tiny" and model["object"] == "model" and model["owned_by"] == "meshlm"
    assert model["root"] == "/models/tiny" and model["max_model_len"] == 64
    assert isinstance(model["created"], int)

