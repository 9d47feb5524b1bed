"""Native /generate and /encode over a fake api: text and ids, SSE streams, n > 1 samples,
batches, error shapes, and closing the api stream when the client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from fake_generation_api import FakeApi, http_client
from flat_api import FlatApi

from meshlm.gateway.front.http_app import build_http_app


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
async def client(api: FakeApi) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(api) as c:
        yield c


def _events(r: httpx.Response) -> list[Any]:
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = r.content.split(b"\n\n")
    assert chunks[-1] == b"" and chunks[-2] == b"data: [DONE]"
    assert all(c.startswith(b"data: ") for c in chunks[:-1])
    return [orjson.loads(c[len(b"data: ") :]) for c in chunks[:-2]]


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


# ---- native /encode --------------------------------------------------------------------------


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
