"""raw_http: make bench's lean SSE client, against a real uvicorn server on loopback, on
asyncio's event loop and on uvloop's (which make bench's load generator uses)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import uvicorn
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from meshlm.bench.raw_http import HttpError, SsePool

Run = Callable[[Coroutine[Any, Any, None]], None]
CONNECTION_HEADERS: list[str] = []  # each request's Connection header, as the server saw it


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    return uvloop.run if request.param == "uvloop" else asyncio.run


async def _events(request: Request) -> Response:
    """Body "<count> <size>": count events of size bytes each, sent one chunk apiece."""
    CONNECTION_HEADERS.append(request.headers.get("connection", ""))
    count, size = (int(x) for x in (await request.body()).split())
    if count < 0:
        return PlainTextResponse("bad count", status_code=400)

    async def body() -> AsyncIterator[bytes]:
        for i in range(count):
            yield b"data: " + str(i).encode() * size + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


@contextlib.asynccontextmanager
async def _serving(keepalive: bool = True) -> AsyncIterator[SsePool]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # connections wait in the backlog until the server takes them
    server = uvicorn.Server(uvicorn.Config(
        Starlette(routes=[Route("/events", _events, methods=["POST"])]), log_config=None,
        access_log=False, lifespan="off", http="httptools", loop="none"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    pool = SsePool("127.0.0.1", sock.getsockname()[1], keepalive)
    try:
        yield pool
    finally:
        pool.close()
        server.should_exit = True
        await task


async def _stream(pool: SsePool, body: bytes) -> list[bytes]:
    got: list[bytes] = []
    await pool.stream("/events", body, got.append)
    return got


def test_each_event_reaches_the_callback_in_order_on_kept_connections(run: Run) -> None:
    async def scenario() -> None:
        async with _serving() as pool:
            for _ in range(2):  # the second time round, the same connections serve
                results = await asyncio.gather(*(_stream(pool, b"%d 3" % n) for n in range(16)))
                for n, got in enumerate(results):
                    assert got == [b"data: " + str(i).encode() * 3 for i in range(n)] + [
                        b"data: [DONE]"]
            assert len(pool._idle) == 16

    run(scenario())


def test_large_events_split_over_reads_are_put_together(run: Run) -> None:
    async def scenario() -> None:
        async with _serving() as pool:
            got = await _stream(pool, b"3 200000")
        assert [len(e) for e in got] == [6 + 200000] * 3 + [12]

    run(scenario())


def test_a_reply_other_than_200_fails_the_request(run: Run) -> None:
    async def scenario() -> None:
        async with _serving() as pool:
            with pytest.raises(HttpError, match="400"):
                await _stream(pool, b"-1 1")
            assert await _stream(pool, b"1 1") == [b"data: 0", b"data: [DONE]"]

    run(scenario())


def test_without_keepalive_each_request_asks_to_close_and_keeps_no_connection(run: Run) -> None:
    async def scenario() -> None:
        async with _serving(keepalive=False) as pool:
            CONNECTION_HEADERS.clear()
            results = await asyncio.gather(*(_stream(pool, b"%d 2" % n) for n in (1, 2, 3)))
            assert [len(got) for got in results] == [2, 3, 4]
            assert await _stream(pool, b"1 1") == [b"data: 0", b"data: [DONE]"]
            assert pool._idle == []
        assert CONNECTION_HEADERS == ["close"] * 4

    run(scenario())
