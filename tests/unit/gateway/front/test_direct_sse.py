"""Direct writes over HTTP (`front/http_streams.DirectBody`): a lone streamed /generate prompt's
running events are written to uvicorn's connection by the inbox while the response's task
waits. Served by a real uvicorn (httptools) on loopback, read by a real HTTP client: the events
are the ones the response's task writes, byte for byte but for the latency, and in order."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from meshlm.bench.gateway_path import StandInMesh, stand_in_api
from meshlm.gateway.front import http_streams
from meshlm.gateway.front.http_app import build_http_app
from meshlm.v1 import gateway_pb2

PROMPT = 17


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    box: list[StandInMesh] = []
    api, table = stand_in_api(box)
    box.append(StandInMesh(table, 0))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    server = uvicorn.Server(uvicorn.Config(build_http_app(api), log_config=None,
                                           access_log=False, lifespan="off", http="httptools",
                                           loop="none"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}")
    try:
        yield client, (box[0], table)
    finally:
        await client.aclose()
        server.should_exit = True
        await task


async def _generate(tokens: int, path: str = "/generate",
                    body: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], int]:
    """A streamed call to `path` (/generate by default) of `tokens` tokens fed one at a time,
    each once the previous event arrived; its events, and how many were written directly."""
    written = 0
    write = http_streams.DirectBody.write

    def counting(self: http_streams.DirectBody, chunk: bytes) -> None:
        nonlocal written
        written += 1
        write(self, chunk)

    if body is None:
        body = {"text": "a prompt", "stream": True, "rid": "r1",
                "sampling_params": {"max_new_tokens": 100}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(http_streams.DirectBody, "write", counting)
        async with _serving() as (client, (mesh, table)):
            got: asyncio.Queue[str] = asyncio.Queue()

            async def read() -> None:
                async with client.stream("POST", path, json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line:  # not the blank line between events
                            got.put_nowait(line.removeprefix("data: "))

            reader = asyncio.create_task(read())
            while not mesh.started:
                await asyncio.sleep(0)  # the request reaching the tokenizer's stream
            [req] = table.requests.values()
            rid = req.rid
            events = []
            for token in range(tokens):
                last = token == tokens - 1
                if token == 0 or last:  # whole, as the detokenizer sends them
                    req.deliver(gateway_pb2.TextOutput(
                        rid=rid, token_ids=[token], text=f" w{token}", prompt_tokens=PROMPT,
                        completion_tokens=token + 1, finished=last,
                        finish_reason="length" if last else ""))
                else:
                    req.deliver_running((rid, [token], PROMPT, token + 1, 0, f" w{token}"))
                while got.empty() or not last and req.direct is None:
                    await asyncio.sleep(0)  # the event out; the handler back to waiting
                while not got.empty() and not last:  # OpenAI's first: two chunks, maybe
                    events.append(orjson.loads(got.get_nowait()))
            while (line := await asyncio.wait_for(got.get(), 10)) != "[DONE]":
                events.append(orjson.loads(line))  # the last output's (and usage's)
            await asyncio.wait_for(reader, 10)
    return events, written


def _without_latency(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for event in events:
        del event["meta_info"]["e2e_latency"]
    return events


async def test_running_events_are_written_directly_and_match_the_handlers() -> None:
    direct, written = await _generate(6)
    assert written == 4  # all but the first and the last
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(http_streams.DirectBody, "writable", lambda self: False)
        through_handler, none = await _generate(6)
    assert none == 0
    assert _without_latency(direct) == _without_latency(through_handler)
    assert direct[3] == {"text": " w0 w1 w2 w3", "output_ids": [0, 1, 2, 3], "meta_info": {
        "id": "r1", "finish_reason": None, "prompt_tokens": 17, "completion_tokens": 4,
        "cached_tokens": 0}}
    assert direct[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 100}


def _without_ids(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for event in events:
        event.pop("id", None)
        event.pop("created", None)
    return events


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": "bench", "prompt": "a prompt", "stream": True,
                         "max_tokens": 100}),
    ("/v1/chat/completions", {"model": "bench", "stream": True, "max_tokens": 100,
                              "messages": [{"role": "user", "content": "hi"}],
                              "stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": True}}),
])
async def test_openai_streams_write_running_chunks_directly_as_the_handler_would(
        path: str, body: dict[str, Any]) -> None:
    direct, written = await _generate(6, path, body)
    assert written >= 4  # the running outputs' chunks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(http_streams.DirectBody, "writable", lambda self: False)
        through_handler, none = await _generate(6, path, body)
    assert none == 0
    assert _without_ids(direct) == _without_ids(through_handler)
    texts = [c.get("text") or c.get("delta", {}).get("content")
             for event in direct for c in event.get("choices", [])]
    assert "".join(t for t in texts if t) == " w0 w1 w2 w3 w4 w5"
