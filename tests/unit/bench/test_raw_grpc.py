"""raw_grpc: make bench's lean gRPC client, against a real grpc.aio server on loopback, on
asyncio's event loop and on uvloop's (which make bench's load generator uses)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import pytest
import uvloop

from meshlm.bench.raw_grpc import CallError, GrpcConnection

LAST = b"last"
Run = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    return uvloop.run if request.param == "uvloop" else asyncio.run


async def _stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    """Request "<count> <size> <end>": count messages of size bytes, then `end`: last (the
    message the client waits for), none (the stream just ends), abort, or hang."""
    count, size, end = request.decode().split()
    for i in range(int(count)):
        yield bytes([i % 256]) * int(size)
    if end == "last":
        yield LAST
    elif end == "abort":
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no more")
    elif end == "hang":
        await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[tuple[grpc.aio.Server, GrpcConnection]]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.S", {
        "Stream": grpc.unary_stream_rpc_method_handler(_stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn = await GrpcConnection.open("127.0.0.1", port)
    try:
        yield server, conn
    finally:
        conn.close()
        await server.stop(None)


async def _call(conn: GrpcConnection, request: str) -> list[bytes]:
    got: list[bytes] = []

    def on_message(data: bytes) -> bool:
        got.append(data)
        return data == LAST

    await conn.call("/t.S/Stream", request.encode(), on_message)
    return got


def test_concurrent_calls_each_get_their_messages_in_order(run: Run) -> None:
    async def scenario() -> None:
        async with _serving() as (_, conn):
            results = await asyncio.gather(*(_call(conn, f"{n} 7 last") for n in range(64)))
        for n, got in enumerate(results):
            assert got == [bytes([i]) * 7 for i in range(n)] + [LAST]

    run(scenario())


def test_messages_larger_than_a_frame_are_put_together(run: Run) -> None:
    async def scenario() -> None:
        async with _serving() as (_, conn):
            got = await _call(conn, "3 100000 last")  # HTTP/2 frames carry at most 16 KiB
        assert [len(m) for m in got] == [100000, 100000, 100000, len(LAST)]
        assert got[2] == bytes([2]) * 100000

    run(scenario())


@pytest.mark.parametrize("end", ["none", "abort"])
def test_a_stream_that_ends_before_its_last_message_fails_the_call(run: Run, end: str) -> None:
    async def scenario() -> None:
        async with _serving() as (_, conn):
            with pytest.raises(CallError, match="ended before its last message"):
                await _call(conn, f"2 5 {end}")
            assert await _call(conn, "1 5 last") == [bytes(5), LAST]  # the connection goes on

    run(scenario())


def test_calls_in_flight_fail_when_the_server_goes(run: Run) -> None:
    async def scenario() -> None:
        async with _serving() as (server, conn):
            first = []
            started = asyncio.Event()

            def on_message(data: bytes) -> bool:
                first.append(data)
                started.set()
                return False

            call = conn.call("/t.S/Stream", b"1 3 hang", on_message)
            await started.wait()
            await server.stop(None)
            with pytest.raises(CallError):
                await call
            assert first == [bytes(3)]
            with pytest.raises(CallError, match="connection lost|going away"):
                await _call(conn, "1 1 last")

    run(scenario())
