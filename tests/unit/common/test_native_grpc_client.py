"""The native client of the mesh's batched streams (common/native_grpc/client.py), against real
servers on loopback (the native server, and grpc.aio's): replies and statuses, large messages
under flow control, a server that stops and another that takes its port, and what it refuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshlm.common.native_grpc import frames as h2
from meshlm.common.native_grpc.client import NativeChannel
from meshlm.common.native_grpc.server import NativeServer
from meshlm.common.server import MESH_WINDOW_BYTES, server_options
from meshlm.launch.certs import ensure_dev_certs

SERVICE = "test.Streams"


class Streams:
    """Echo (bidi: each request back, reversed), Sum (client-streaming: the total of the
    requests' lengths), Refuse (bidi: fails with a status after the first request)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    async def echo(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            self.seen.append(len(request))
            yield request[::-1]

    async def total(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        return str(sum([len(r) async for r in requests])).encode()

    async def refuse(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for _ in requests:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too much: 100% ünïcode")
        yield b""  # never reached

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Echo": grpc.stream_stream_rpc_method_handler(self.echo),
            "Sum": grpc.stream_unary_rpc_method_handler(self.total),
            "Refuse": grpc.stream_stream_rpc_method_handler(self.refuse),
        })


async def _serve(kind: str, streams: Streams, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server: grpc.aio.Server
    if kind == "native":
        server = NativeServer(stream_window=MESH_WINDOW_BYTES)
    else:
        server = grpc.aio.server(options=server_options())
    server.add_generic_rpc_handlers((streams.handler(),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if isinstance(server, NativeServer):
        [bound] = await server.bind()
    await server.start()
    return server, bound


class Served:
    def __init__(self, kind: str, streams: Streams, server: grpc.aio.Server, port: int,
                 channel: NativeChannel) -> None:
        self.kind, self.streams, self.server, self.port = kind, streams, server, port
        self.channel = channel


@pytest.fixture(params=["native", "grpcio"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    streams = Streams()
    server, port = await _serve(request.param, streams)
    channel = NativeChannel(f"127.0.0.1:{port}", None)
    await asyncio.wait_for(channel.channel_ready(), 10)
    it = Served(request.param, streams, server, port, channel)
    yield it
    await channel.close()
    await it.server.stop(None)


async def test_bidi_replies_and_a_client_streaming_answer(served: Served) -> None:
    channel = served.channel
    call = channel.stream_stream(f"/{SERVICE}/Echo")()
    for word in (b"abc", b"hello"):
        await call.write(word)
    replies = []
    async for reply in call:
        replies.append(reply)
        if len(replies) == 2:
            break
    assert replies == [b"cba", b"olleh"]
    call.cancel()
    assert await call.code() == grpc.StatusCode.CANCELLED

    total = channel.stream_unary(f"/{SERVICE}/Sum")()
    await total.write(b"x" * 10)
    await total.write(b"y" * 5)
    await total.done_writing()
    assert await total == b"15"


async def test_large_messages_cross_a_small_window_whole_and_in_order(served: Served) -> None:
    streams, channel = served.streams, served.channel
    call = channel.stream_stream(f"/{SERVICE}/Echo")()
    sizes = [1, 3 * 1024 * 1024, 17, 1024 * 1024]
    for i, size in enumerate(sizes):
        await call.write(bytes([i]) * size)
    got = []
    async for reply in call:
        got.append(reply)
        if len(got) == len(sizes):
            break
    assert [len(r) for r in got] == sizes
    assert [r[0] for r in got] == [0, 1, 2, 3]
    assert streams.seen == sizes
    call.cancel()


async def test_a_status_from_the_server_is_the_calls_error(served: Served) -> None:
    channel = served.channel
    call = channel.stream_stream(f"/{SERVICE}/Refuse")()
    await call.write(b"go")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        async for _ in call:
            pass
    assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert failed.value.details() == "too much: 100% ünïcode"
    with pytest.raises((grpc.aio.AioRpcError, asyncio.InvalidStateError)):
        await call.write(b"again")


async def test_a_stopped_server_fails_the_call_and_a_new_one_on_its_port_is_reached(
        served: Served) -> None:
    channel = served.channel
    call = channel.stream_stream(f"/{SERVICE}/Echo")()
    await call.write(b"one")
    async for _ in call:
        break
    ended = asyncio.ensure_future(call.code())
    await served.server.stop(None)
    assert await asyncio.wait_for(ended, 10) != grpc.StatusCode.OK
    served.server, _ = await _serve(served.kind, served.streams, served.port)
    await asyncio.wait_for(channel.channel_ready(), 10)
    again = channel.stream_stream(f"/{SERVICE}/Echo")()
    await again.write(b"two")
    async for reply in again:
        assert reply == b"owt"
        break
    again.cancel()


async def test_unary_methods_are_not_the_native_channels() -> None:
    channel = NativeChannel("127.0.0.1:1", None)
    unary = channel.unary_unary(f"/{SERVICE}/Anything")
    with pytest.raises(NotImplementedError):
        unary(b"")


async def test_a_server_it_cannot_trust_is_logged_once_and_retried(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ours = ensure_dev_certs(tmp_path / "ours").mesh_tls()
    theirs = ensure_dev_certs(tmp_path / "theirs").mesh_tls()  # another CA
    server = NativeServer(stream_window=MESH_WINDOW_BYTES)
    server.add_generic_rpc_handlers((Streams().handler(),))
    server.add_secure_port("127.0.0.1:0", theirs.server_context())
    [port] = await server.bind()
    channel = NativeChannel(f"127.0.0.1:{port}", ours.client_context())
    try:
        with pytest.raises(TimeoutError):  # retried with backoff: 0.1, 0.2, 0.4, 0.8 s
            await asyncio.wait_for(channel.channel_ready(), 1.6)
        failures = [r for r in caplog.records if r.getMessage() == "stream_connect_failed"]
        assert len(failures) == 1
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_server_that_breaks_http2_fails_the_call_instead_of_hanging() -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(h2.frame(h2.SETTINGS, 0, 0))
        await reader.readexactly(len(h2.PREFACE))
        while True:  # the client's frames, up to its call's HEADERS
            head = await reader.readexactly(9)
            await reader.readexactly(int.from_bytes(head[:3], "big"))
            if head[3] == h2.HEADERS:
                break
        writer.write(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.PADDED, 1))  # no pad length
        await reader.read()  # until the client closes

    server = await asyncio.start_server(broken, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    channel = NativeChannel(f"127.0.0.1:{port}", None)
    try:
        await asyncio.wait_for(channel.channel_ready(), 10)
        call = channel.stream_stream(f"/{SERVICE}/Echo")()
        await call.write(b"x")
        assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.INTERNAL
    finally:
        await channel.close()
        server.close()
