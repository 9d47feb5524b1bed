"""The HTTP app over a fake api: transcoded routes, NDJSON and SSE streams, native /generate
(n > 1 included), /encode and /flush_cache, /health, /v1/models, error shapes, and closing the
api stream when the client goes away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import orjson
import pytest
from flat_api import FlatApi

from meshlm.common.errors import MeshError
from meshlm.common.rpc import CallContext
from meshlm.gateway.front.http_app import build_http_app
from meshlm.gateway.protocol.validation import validate_tokenize
from sglang.runtime.v1 import sglang_pb2 as pb

FINAL_TEXT_META = {
    "id": "r1",
    "prompt_tokens": "3",
    "completion_tokens": "3",
    "cached_tokens": "1",
    "finish_reason": "stop",
    "matched_stop": "!",
    "matched_stop_type": "text",
}


class FakeApi:
    """Text prompts pick a behaviour: "early"/"late" fail before/after the first message,
    "hang" never finishes; anything else streams "Hel", "lo", "!"."""

    def __init__(self) -> None:
        self.healthy = True
        self.flushable = True
        self.contexts: list[CallContext] = []
        self.ended: list[tuple[str, bool]] = []  # (prompt, ran to completion)

    async def Tokenize(self, req: pb.TokenizeRequest, ctx: CallContext) -> pb.TokenizeResponse:
        self.contexts.append(ctx)
        if req.text == "crash":
            raise RuntimeError("bug")
        validate_tokenize(req)
        return pb.TokenizeResponse(tokens=[1, 2], count=2, max_model_len=64, input_text=req.text)

    async def GetLoad(self, req: pb.GetLoadRequest, ctx: CallContext) -> pb.GetLoadResponse:
        return pb.GetLoadResponse(json_info=f"rank={req.dp_rank}")

    async def Abort(self, req: pb.AbortRequest, ctx: CallContext) -> pb.AbortResponse:
        raise MeshError(grpc.StatusCode.UNIMPLEMENTED, "Abort is not implemented yet")

    def TextGenerate(
        self, req: pb.TextGenerateRequest, ctx: CallContext
    ) -> AsyncIterator[pb.TextGenerateResponse]:
        self.contexts.append(ctx)
        if req.sampling_params.n > 1:
            return self._samples(req)
        return self._text(req)

    async def _samples(self, req: pb.TextGenerateRequest
                       ) -> AsyncIterator[pb.TextGenerateResponse]:
        """n samples "a", "b", ...: streamed as two pieces each, interleaved (the last sample
        first), or as one finished message each, in index order."""
        n = req.sampling_params.n
        letters = "abcdefghijklmnop"[:n]

        def meta(i: int, done: bool) -> dict[str, str]:
            m = {"id": f"r1-{i}", "index": str(i), "prompt_tokens": "3",
                 "completion_tokens": str(2 if done else 1), "cached_tokens": str(i and 3)}
            return m | {"finish_reason": "length"} if done else m

        if not req.stream:
            for i, c in enumerate(letters):
                yield pb.TextGenerateResponse(text=c * 2, meta_info=meta(i, True), finished=True)
            return
        for i in reversed(range(n)):
            yield pb.TextGenerateResponse(text=letters[i], meta_info=meta(i, False))
        for i in range(n):
            yield pb.TextGenerateResponse(text=letters[i], meta_info=meta(i, True),
                                          finished=True)

    async def TextEmbed(self, req: pb.TextEmbedRequest, ctx: CallContext) -> pb.TextEmbedResponse:
        if not req.text:
            raise MeshError(grpc.StatusCode.INVALID_ARGUMENT, "text: must not be empty")
        return pb.TextEmbedResponse(embedding=[0.6, 0.8], meta_info={
            "id": req.rid or "e1", "prompt_tokens": "2", "cached_tokens": "0",
            "finish_reason": "stop"})

    async def Embed(self, req: pb.EmbedRequest, ctx: CallContext) -> pb.EmbedResponse:
        return pb.EmbedResponse(embedding=[1.0, 0.0], meta_info={
            "id": "e2", "prompt_tokens": str(len(req.input_ids)), "cached_tokens": "1"})

    async def FlushCache(self, req: pb.FlushCacheRequest,
                         ctx: CallContext) -> pb.FlushCacheResponse:
        if self.flushable:
            return pb.FlushCacheResponse(success=True, message="flushed 1")
        return pb.FlushCacheResponse(success=False, message="s1: requests are running")

    async def _text(self, req: pb.TextGenerateRequest) -> AsyncIterator[pb.TextGenerateResponse]:
        completed = False
        try:
            if req.text == "early":
                raise MeshError(grpc.StatusCode.INVALID_ARGUMENT, "text: not today")
            if not req.stream:
                yield pb.TextGenerateResponse(
                    text="Hello!", meta_info=FINAL_TEXT_META, finished=True
                )
            else:
                for i, piece in enumerate(["Hel", "lo"], start=1):
                    meta = {
                        "id": "r1",
                        "prompt_tokens": "3",
                        "completion_tokens": str(i),
                        "cached_tokens": "1",
                    }
                    yield pb.TextGenerateResponse(text=piece, meta_info=meta)
                    if req.text == "late":
                        raise MeshError(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of KV cache")
                    if req.text == "hang":
                        await asyncio.Event().wait()
                    if req.text == "many":
                        for _ in range(100):
                            yield pb.TextGenerateResponse(text=".", meta_info=meta)
                yield pb.TextGenerateResponse(text="!", meta_info=FINAL_TEXT_META, finished=True)
            if req.text == "hang":
                await asyncio.Event().wait()
            completed = True
        finally:
            self.ended.append((req.text, completed))

    async def Generate(
        self, req: pb.GenerateRequest, ctx: CallContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        length = req.input_ids[0] == 9
        final = {
            "id": "r2",
            "prompt_tokens": str(len(req.input_ids)),
            "completion_tokens": "3",
            "cached_tokens": "0",
            "finish_reason": "length" if length else "stop",
        }
        if not length:
            final |= {"matched_stop": "7", "matched_stop_type": "token"}
        if not req.stream:
            yield pb.GenerateResponse(output_ids=[5, 6, 7], meta_info=final, finished=True)
            return
        yield pb.GenerateResponse(output_ids=[5], meta_info={"id": "r2"})
        yield pb.GenerateResponse(output_ids=[6, 7], meta_info=final, finished=True)

    def is_healthy(self) -> bool:
        return self.healthy

    def model_cards(self) -> list[pb.ModelCard]:
        return [pb.ModelCard(id="tiny", root="/models/tiny", max_model_len=64)]


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
async def client(api: FakeApi) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_http_app(FlatApi(api)),
                                    client=("10.0.0.7", 4242))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


def _status(r: httpx.Response, http: int, code: grpc.StatusCode) -> str:
    assert r.status_code == http, r.text
    body = r.json()
    assert body["code"] == code.value[0] and body["details"] == []
    return str(body["message"])


def _lines(r: httpx.Response) -> list[Any]:
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [orjson.loads(line) for line in r.content.splitlines()]


def _events(r: httpx.Response) -> list[Any]:
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = r.content.split(b"\n\n")
    assert chunks[-1] == b"" and chunks[-2] == b"data: [DONE]"
    assert all(c.startswith(b"data: ") for c in chunks[:-1])
    return [orjson.loads(c[len(b"data: ") :]) for c in chunks[:-2]]


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
        (b'{"text": ""}', "text: must not be empty"),  # raised by the api's validation
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


# ---- native /generate ------------------------------------------------------------------------


async def test_native_text(client: httpx.AsyncClient) -> None:
    r = await client.post("/generate", json={"text": "hi", "sampling_params": {"stop": "!"}})
    assert r.status_code == 200
    body = r.json()
    assert body["text"] == "Hello!" and body["output_ids"] == []  # the fake api sends no ids
    meta = body["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "stop", "matched": "!"}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 3, 1)
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] >= 0
    assert "matched_stop" not in meta and "matched_stop_type" not in meta


async def test_native_ids(client: httpx.AsyncClient) -> None:
    body = (await client.post("/generate", json={"input_ids": [1, 2]})).json()
    assert "text" not in body and body["output_ids"] == [5, 6, 7]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 7}
    assert body["meta_info"]["prompt_tokens"] == 2


async def test_native_length_finish(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/generate", json={"input_ids": [9], "sampling_params": {"max_new_tokens": 3}}
    )
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def test_native_sse_text_is_cumulative(client: httpx.AsyncClient) -> None:
    events = _events(await client.post("/generate", json={"text": "hi", "stream": True}))
    assert [e["text"] for e in events] == ["Hel", "Hello", "Hello!"]
    reasons = [e["meta_info"]["finish_reason"] for e in events]
    assert reasons == [None, None, {"type": "stop", "matched": "!"}]
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3]


async def test_native_sse_ids_are_cumulative(client: httpx.AsyncClient) -> None:
    events = _events(await client.post("/generate", json={"input_ids": [1], "stream": True}))
    assert [e["output_ids"] for e in events] == [[5], [5, 6, 7]]


async def test_native_sse_mid_stream_error(client: httpx.AsyncClient) -> None:
    events = _events(await client.post("/generate", json={"text": "late", "stream": True}))
    assert events[0]["text"] == "Hel"
    assert events[1] == {
        "error": {"message": "out of KV cache", "code": 429, "type": "RESOURCE_EXHAUSTED"}
    }


@pytest.mark.parametrize(
    ("body", "status", "start"),
    [
        (b'{"text": "early", "stream": true}', 400, "text: not today"),
        (b'{"text": "early"}', 400, "text: not today"),
        (b'{"text": "a", "input_ids": [1]}', 400, "text: give exactly one of text and input_ids"),
        (b'{"sampling_params": {}}', 400, "text: give exactly one of text and input_ids"),
        (b"{oops", 400, "request body is not valid JSON: "),
        (b'{"text": []}', 400, "text: the batch is empty"),
        (b'{"text": ["a", "early"]}', 400, "text: not today"),
    ],
)
async def test_native_errors(
    client: httpx.AsyncClient, body: bytes, status: int, start: str
) -> None:
    r = await client.post("/generate", content=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"].startswith(start) and error["code"] == status
    assert error["type"] in ("INVALID_ARGUMENT", "UNIMPLEMENTED")


async def test_native_n_samples_are_a_list_in_index_order(client: httpx.AsyncClient) -> None:
    r = await client.post("/generate", json={"text": "hi", "sampling_params": {"n": 3}})
    assert r.status_code == 200
    body = r.json()
    assert [x["index"] for x in body] == [0, 1, 2]
    assert [x["text"] for x in body] == ["aa", "bb", "cc"]
    assert [x["meta_info"]["id"] for x in body] == ["r1-0", "r1-1", "r1-2"]
    assert [x["meta_info"]["cached_tokens"] for x in body] == [0, 3, 3]
    assert all(x["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
               and "index" not in x["meta_info"] for x in body)


async def test_native_n_samples_stream_with_their_index(client: httpx.AsyncClient) -> None:
    events = _events(await client.post(
        "/generate", json={"text": "hi", "stream": True, "sampling_params": {"n": 2}}))
    assert [(e["index"], e["text"]) for e in events] == [(1, "b"), (0, "a"), (0, "aa"), (1, "bb")]
    assert [e["meta_info"]["finish_reason"] for e in events][2:] == [
        {"type": "length", "length": 128}] * 2


async def test_native_batch_is_a_list_of_every_prompts_samples(
        client: httpx.AsyncClient, api: FakeApi) -> None:
    r = await client.post("/generate", json={
        "text": ["x", "hi"], "sampling_params": [{}, {"n": 2}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(x["index"], x["text"]) for x in body] == [(0, "Hello!"), (1, "aa"), (2, "bb")]
    r = await client.post("/generate", json={"input_ids": [[1, 2], [9]]})
    assert [(x["index"], x["output_ids"], x["meta_info"]["finish_reason"]["type"])
            for x in r.json()] == [(0, [5, 6, 7], "stop"), (1, [5, 6, 7], "length")]


async def test_native_batch_streams_every_prompt_with_its_index(client: httpx.AsyncClient,
                                                                api: FakeApi) -> None:
    events = _events(await client.post(
        "/generate", json={"text": ["x", "y"], "stream": True}))
    by_index: dict[int, list[str]] = {}
    for e in events:
        by_index.setdefault(e["index"], []).append(e["text"])
    assert by_index == {0: ["Hel", "Hello", "Hello!"], 1: ["Hel", "Hello", "Hello!"]}
    assert sorted(api.ended) == [("x", True), ("y", True)]


# ---- native /encode and /flush_cache ---------------------------------------------------------


async def test_native_encode(client: httpx.AsyncClient) -> None:
    r = await client.post("/encode", json={"text": "hi", "rid": "mine"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["embedding"] == [0.6000000238418579, 0.800000011920929]  # float32 on the wire
    meta = body["meta_info"]
    assert (meta["id"], meta["prompt_tokens"], meta["cached_tokens"]) == ("mine", 2, 0)
    assert meta["finish_reason"] == {"type": "stop"} and meta["e2e_latency"] >= 0
    body = (await client.post("/encode", json={"input_ids": [4, 5, 6]})).json()
    assert body["embedding"] == [1.0, 0.0] and body["meta_info"]["prompt_tokens"] == 3
    body = (await client.post("/encode", json={"text": ["a", "b"], "rid": ["p", "q"]})).json()
    assert [x["meta_info"]["id"] for x in body] == ["p", "q"]
    body = (await client.post("/encode", json={"input_ids": [[1], [2, 3]]})).json()
    assert [x["meta_info"]["prompt_tokens"] for x in body] == [1, 2]


@pytest.mark.parametrize(
    ("body", "status", "start"),
    [
        (b'{"text": ""}', 400, "text: must not be empty"),
        (b'{"text": "a", "input_ids": [1]}', 400, "text: give exactly one of text and input_ids"),
        (b'{"text": "a", "sampling_params": {}}', 400, "sampling_params: unknown field"),
        (b'{"text": ["a", ""]}', 400, "text: must not be empty"),
        (b'{"text": ["a", "b"], "rid": ["x"]}', 400, "rid: has 1 entries for 2 prompts"),
    ],
)
async def test_native_encode_errors(
    client: httpx.AsyncClient, body: bytes, status: int, start: str
) -> None:
    r = await client.post("/encode", content=body)
    assert r.status_code == status
    assert r.json()["error"]["message"].startswith(start), r.text


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


# ---- client disconnect -----------------------------------------------------------------------


async def _disconnect_after_first_chunk(
    api: FakeApi, path: str, body: bytes, *, stall: bool = False
) -> list[Any]:
    """Drive the app over raw ASGI; the client disconnects once a body chunk arrived (at once
    for a non-streaming request). With `stall`, sending a second chunk never completes (a client
    that stopped reading), so the api stream is left suspended at a yield."""
    app = build_http_app(FlatApi(api))
    chunk_seen = asyncio.Event()
    if b'"stream": true' not in body:
        chunk_seen.set()
    inbox = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[Any] = []

    async def receive() -> Any:
        if inbox:
            return inbox.pop(0)
        await chunk_seen.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        if stall and chunk_seen.is_set():
            await asyncio.Event().wait()
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            chunk_seen.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 5000),
        "server": ("gw", 80),
        "headers": [(b"content-type", b"application/json")],
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/runtime/text_generate", b'{"text": "hang", "stream": true}'),
        ("/generate", b'{"text": "hang", "stream": true}'),
        ("/generate", b'{"text": "hang"}'),
    ],
)
async def test_client_disconnect_closes_the_api_stream(
    api: FakeApi, path: str, body: bytes
) -> None:
    await _disconnect_after_first_chunk(api, path, body)
    assert api.ended == [("hang", False)]


@pytest.mark.parametrize("path", ["/v1/runtime/text_generate", "/generate"])
async def test_client_that_stops_reading_and_leaves_closes_the_api_stream(
    api: FakeApi, path: str
) -> None:
    await _disconnect_after_first_chunk(api, path, b'{"text": "many", "stream": true}', stall=True)
    assert api.ended == [("many", False)]
