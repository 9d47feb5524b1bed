"""The native gRPC server (common/native_grpc): grpc's own client (grpc.aio, on loopback) calls
a small service on it, and sees what it would see from a grpc.aio server: messages, metadata,
statuses, deadlines, cancellation, flow control over large answers, compressed requests, TLS
by ALPN, a graceful stop. A raw socket checks that protocol errors close the connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshlm.common.errors import MeshError
from meshlm.common.native_grpc import frames as h2
from meshlm.common.native_grpc.connection import RESET_BUDGET
from meshlm.common.native_grpc.server import NativeServer
from meshlm.common.tls import tls_context
from meshlm.launch.certs import ensure_dev_certs

SERVICE = "test.Echo"


class Echo:
    """Unary Echo, streamed Count, Hold (waits until cancelled), Fail (aborts), Big (large
    messages), Sum (streamed requests); records cancellations and metadata."""

    def __init__(self) -> None:
        self.cancelled: asyncio.Event = asyncio.Event()
        self.metadata: dict[str, Any] = {}
        self.release = asyncio.Event()

    async def echo(self, request: bytes, context: Any) -> bytes:
        self.metadata = dict(context.invocation_metadata())
        await context.send_initial_metadata((("x-initial", "yes"),))
        context.set_trailing_metadata((("x-trailer", "done"), ("x-raw-bin", b"\x00\xff")))
        return request[::-1]

    async def count(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield str(i).encode()

    async def hold(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        context.add_done_callback(lambda ctx: self.cancelled.set() if ctx.cancelled() else None)
        yield b"started"
        await self.release.wait()
        yield b"released"

    async def fail(self, request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no way: ünïcode 100%")
        return b""

    async def big(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(8):
            yield bytes([i]) * (1024 * 1024)

    async def total(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        return str(sum([int(r) async for r in requests])).encode()

    async def later(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        await self.release.wait()  # reads nothing until released
        return str(len([r async for r in requests])).encode()

    async def direct(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        self.early = context.write_now(b"early")  # before the call has begun answering
        yield b"first"
        self.direct_sent = 0
        while context.write_now(b"d" * 1024):  # until the client's window is spent
            self.direct_sent += 1
        yield b"last" * 512  # more than the window has left: waits for the client

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
            "Count": grpc.unary_stream_rpc_method_handler(self.count),
            "Hold": grpc.unary_stream_rpc_method_handler(self.hold),
            "Fail": grpc.unary_unary_rpc_method_handler(self.fail),
            "Big": grpc.unary_stream_rpc_method_handler(self.big),
            "Sum": grpc.stream_unary_rpc_method_handler(self.total),
            "Later": grpc.stream_unary_rpc_method_handler(self.later),
            "Direct": grpc.unary_stream_rpc_method_handler(self.direct),
        })


@pytest.fixture
async def served() -> AsyncIterator[tuple[NativeServer, Echo, int]]:
    server = NativeServer(max_receive_bytes=64 * 1024)
    echo = Echo()
    server.add_generic_rpc_handlers((echo.handler(),))
    server.add_insecure_port("127.0.0.1:0")
    [port] = await server.bind()
    yield server, echo, port
    await server.stop(None)


def _method(channel: grpc.aio.Channel, name: str, kind: str = "unary_unary") -> Any:
    return getattr(channel, kind)(f"/{SERVICE}/{name}")


async def test_unary_call_carries_messages_and_metadata_both_ways(served: Any) -> None:
    _, echo, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = _method(channel, "Echo")(b"hello", metadata=(("x-key", "v"),
                                                            ("x-blob-bin", b"\x01\x02")))
        assert await call == b"olleh"
        assert ("x-initial", "yes") in list(await call.initial_metadata())
        trailers = list(await call.trailing_metadata())
        assert ("x-trailer", "done") in trailers and ("x-raw-bin", b"\x00\xff") in trailers
    assert echo.metadata["x-key"] == "v" and echo.metadata["x-blob-bin"] == b"\x01\x02"


async def test_streamed_answers_arrive_in_order(served: Any) -> None:
    _, _, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        count = _method(channel, "Count", "unary_stream")
        answers = await asyncio.gather(*(_collect(count(b"50")) for _ in range(20)))
    assert all(a == [str(i).encode() for i in range(50)] for a in answers)


async def _collect(call: Any) -> list[bytes]:
    return [m async for m in call]


async def test_abort_status_and_unicode_message(served: Any) -> None:
    _, _, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _method(channel, "Fail")(b"")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == "no way: ünïcode 100%"


async def test_unknown_method_is_unimplemented(served: Any) -> None:
    _, _, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary("/test.Echo/Nope")(b"")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_client_cancel_cancels_the_handler(served: Any) -> None:
    _, echo, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = _method(channel, "Hold", "unary_stream")(b"")
        assert await call.read() == b"started"
        call.cancel()
        await asyncio.wait_for(echo.cancelled.wait(), 5)


async def test_deadline_ends_the_call(served: Any) -> None:
    _, echo, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = _method(channel, "Hold", "unary_stream")(b"", timeout=0.3)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _collect(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(echo.cancelled.wait(), 5)


async def test_request_over_the_limit_is_resource_exhausted(served: Any) -> None:
    _, _, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _method(channel, "Echo")(b"x" * (65 * 1024))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _method(channel, "Echo")(b"ok") == b"ko"  # the connection lives on


async def test_large_answers_respect_flow_control(served: Any) -> None:
    _, _, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        big = _method(channel, "Big", "unary_stream")
        results = await asyncio.gather(*(_collect(big(b"")) for _ in range(3)))
    for messages in results:
        assert [m[:1] for m in messages] == [bytes([i]) for i in range(8)]
        assert all(m == m[:1] * (1024 * 1024) for m in messages)


async def test_compressed_and_streamed_requests(served: Any) -> None:
    _, _, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                         compression=grpc.Compression.Gzip) as channel:
        assert await _method(channel, "Echo")(b"abc" * 1000) == b"cba" * 1000
        sums = _method(channel, "Sum", "stream_unary")
        assert await sums(iter([b"1", b"2", b"39"])) == b"42"


async def test_tls_with_alpn(tmp_path: Path) -> None:
    certs = ensure_dev_certs(tmp_path)
    server = NativeServer()
    server.add_generic_rpc_handlers((Echo().handler(),))
    server.add_secure_port("127.0.0.1:0", tls_context(certs.server_cert, certs.server_key))
    [port] = await server.bind()
    try:
        creds = grpc.ssl_channel_credentials(certs.ca_cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            assert await _method(channel, "Echo")(b"tls") == b"slt"
    finally:
        await server.stop(None)


async def test_graceful_stop_finishes_calls_in_flight(served: Any) -> None:
    server, echo, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = _method(channel, "Hold", "unary_stream")(b"")
        assert await call.read() == b"started"
        stopping = asyncio.create_task(server.stop(5))
        await asyncio.sleep(0)  # the GOAWAY is queued; the call is still running
        echo.release.set()
        assert await call.read() == b"released"
        await stopping
        assert await call.code() == grpc.StatusCode.OK
    assert not echo.cancelled.is_set()


async def _until_closed(port: int, send: bytes) -> list[tuple[int, bytes]]:
    """Send raw bytes; the (type, payload) of every frame the server sends until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(send)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)  # EOF: the server closed
    finally:
        writer.close()
    received = []
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        received.append((data[3], data[9:9 + length]))
        data = data[9 + length:]
    return received


async def test_a_bad_preface_closes_the_connection_with_goaway(served: Any) -> None:
    _, _, port = served
    frames = await _until_closed(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [kind for kind, _ in frames][-1] == h2.GOAWAY


async def test_an_oversized_frame_is_a_frame_size_error(served: Any) -> None:
    _, _, port = served
    oversized = (20_000).to_bytes(3, "big") + bytes((h2.DATA, 0)) + (1).to_bytes(4, "big")
    frames = await _until_closed(port, h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0) + oversized)
    kind, payload = frames[-1]
    assert kind == h2.GOAWAY
    assert int.from_bytes(payload[4:8], "big") == h2.FRAME_SIZE_ERROR


def _opened_and_reset(first: int, count: int) -> bytes:
    """`count` calls opened and reset at once by the client, from stream `first` on."""
    headers = _call_headers(f"/{SERVICE}/Later")
    cancel = h2.CANCEL.to_bytes(4, "big")
    return b"".join(h2.frame(h2.HEADERS, h2.END_HEADERS, i, headers)
                    + h2.frame(h2.RST_STREAM, 0, i, cancel)
                    for i in range(first, first + 2 * count, 2))


async def test_a_rapid_reset_client_is_sent_away_with_enhance_your_calm(served: Any) -> None:
    """Calls opened and reset at once, over and over (CVE-2023-44487), spend the connection's
    reset budget: GOAWAY ENHANCE_YOUR_CALM once past RESET_BUDGET of them, and the close."""
    _, _, port = served
    flood = _opened_and_reset(1, RESET_BUDGET + 10)
    frames = await _until_closed(port, h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0) + flood)
    kind, payload = frames[-1]
    assert kind == h2.GOAWAY
    assert int.from_bytes(payload[4:8], "big") == h2.ENHANCE_YOUR_CALM
    assert b"rapid reset" in payload[8:]


async def test_a_client_that_cancels_some_calls_keeps_its_connection(served: Any) -> None:
    """A third of the calls reset at once, the others run to their end, over three times as
    many calls as the budget: the connection stays, and answers."""
    _, _, port = served
    client = await RawClient.connect(port)
    try:
        finished = _call_headers(f"/{SERVICE}/Sum")  # no requests: answers "0" at once
        stream = 1
        for _ in range(RESET_BUDGET):
            client.send(_opened_and_reset(stream, 1) + b"".join(
                h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, stream + i, finished)
                for i in (2, 4)))
            stream += 6
        client.send(h2.frame(h2.PING, 0, 0, b"probe..."))
        while (got := await client.frame()) is not None:
            kind, flags, _, _ = got
            assert kind != h2.GOAWAY, "the server sent the client away"
            if kind == h2.PING and flags & h2.ACK:
                break
        else:
            raise AssertionError("the server closed the connection")
    finally:
        client.close()


class RawClient:
    """An HTTP/2 client on a plain socket, frame by frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0))
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def frame(self) -> tuple[int, int, int, bytes] | None:
        """The next frame (type, flags, stream, payload); None at the server's EOF."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), 10)
            payload = await self.reader.readexactly(int.from_bytes(head[:3], "big"))
        except asyncio.IncompleteReadError:
            return None
        return head[3], head[4], int.from_bytes(head[5:9], "big"), payload

    def close(self) -> None:
        self.writer.close()


def _call_headers(method: str) -> bytes:
    return b"".join(h2.literal(k, v) for k, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
        (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")))


async def test_a_handler_that_reads_nothing_holds_its_client_to_the_window() -> None:
    window = 16 * 1024
    server = NativeServer(stream_window=window)
    echo = Echo()
    server.add_generic_rpc_handlers((echo.handler(),))
    server.add_insecure_port("127.0.0.1:0")
    [port] = await server.bind()
    client = await RawClient.connect(port)
    try:
        client.send(h2.frame(h2.HEADERS, h2.END_HEADERS, 1, _call_headers(f"/{SERVICE}/Later")))
        message = b"\x00" + (1019).to_bytes(4, "big") + b"1" * 1019  # 1 KiB framed
        client.send(b"".join(h2.frame(h2.DATA, 0, 1, message) for _ in range(window // 1024)))
        client.send(h2.frame(h2.PING, 0, 0, b"probe..."))
        credited = 0  # the window the server gave back for the call

        async def credit_until(done: Any) -> None:
            nonlocal credited
            while (got := await client.frame()) is not None:
                kind, flags, stream, payload = got
                if kind == h2.WINDOW_UPDATE and stream == 1:
                    credited += int.from_bytes(payload, "big")
                if done(kind, flags):
                    return
            raise AssertionError("the server closed the connection")

        await credit_until(lambda kind, flags: kind == h2.PING and flags & h2.ACK)
        assert credited < window, "the whole window came back before the handler read"
        echo.release.set()  # the handler reads: the rest of the window comes back
        await credit_until(lambda kind, flags: credited == window)
        assert credited == window
    finally:
        client.close()
        await server.stop(None)


async def test_a_silent_client_is_pinged_and_dropped_when_it_does_not_answer() -> None:
    server = NativeServer(keepalive=(0.05, 0.2))
    server.add_insecure_port("127.0.0.1:0")
    [port] = await server.bind()
    answering, silent = await RawClient.connect(port), await RawClient.connect(port)
    try:
        pings = 0
        while pings < 2:  # answered, the server pings again after the idle time, and again
            got = await answering.frame()
            assert got is not None, "a client answering the pings was dropped"
            kind, flags, _, payload = got
            if kind == h2.PING and not flags & h2.ACK:
                pings += 1
                answering.send(h2.frame(h2.PING, h2.ACK, 0, payload))
        kinds = []
        while (got := await silent.frame()) is not None:  # until the server closes it
            kinds.append(got[0])
        assert h2.PING in kinds
        assert len(server.connections) == 1
    finally:
        answering.close()
        silent.close()
        await server.stop(None)


async def test_write_now_sends_within_the_window_and_declines_past_it(served: Any) -> None:
    """`Context.write_now` (the gateway's direct writes) queues a message at once while the
    call has begun answering and the client's windows take it; past them it sends nothing and
    says so, and what the handler then sends follows in order once the client reads."""
    _, echo, port = served
    client = await RawClient.connect(port)
    try:
        client.send(h2.frame(h2.HEADERS, h2.END_HEADERS, 1, _call_headers(f"/{SERVICE}/Direct"))
                    + h2.frame(h2.DATA, h2.END_STREAM, 1, b"\x00\x00\x00\x00\x00"))
        data, trailers = bytearray(), b""
        while not data or len(data) < h2.DEFAULT_WINDOW - 1024:  # the window, nearly spent
            got = await client.frame()
            assert got is not None
            if got[0] == h2.DATA:
                data += got[3]
        assert echo.early is False
        framed_first = 5 + len(b"first")
        assert echo.direct_sent == (h2.DEFAULT_WINDOW - framed_first) // (5 + 1024)
        more = (1 << 20).to_bytes(4, "big")
        client.send(h2.frame(h2.WINDOW_UPDATE, 0, 0, more)
                    + h2.frame(h2.WINDOW_UPDATE, 0, 1, more))
        while not trailers:
            got = await client.frame()
            assert got is not None
            if got[0] == h2.DATA:
                data += got[3]
            elif got[0] == h2.HEADERS and got[1] & h2.END_STREAM:
                trailers = got[3]
        messages = []
        while data:
            size = int.from_bytes(data[1:5], "big")
            messages.append(bytes(data[5:5 + size]))
            del data[:5 + size]
        assert messages == [b"first", *[b"d" * 1024] * echo.direct_sent, b"last" * 512]
        assert b"grpc-status" in trailers
    finally:
        client.close()


async def test_a_sink_takes_each_message_where_it_arrives(served: Any) -> None:
    server, _, port = served
    taken: list[bytes] = []
    server.add_sink(f"/{SERVICE}/Sum", taken.append)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        sums = _method(channel, "Sum", "stream_unary")
        assert await sums(iter([b"1", b"2", b"39"])) == b"0"  # its handler read only the end
    assert taken == [b"1", b"2", b"39"]


@pytest.mark.parametrize(("failure", "code", "details"), [
    (MeshError(grpc.StatusCode.INVALID_ARGUMENT, "a bad batch"),
     grpc.StatusCode.INVALID_ARGUMENT, "a bad batch"),
    (KeyError("rid"), grpc.StatusCode.INTERNAL, "internal error: KeyError('rid')"),
])
async def test_a_failing_sink_ends_its_call_with_a_status(served: Any, failure: Exception,
                                                          code: grpc.StatusCode,
                                                          details: str) -> None:
    server, _, port = served

    def sink(message: bytes) -> None:
        if message == b"2":
            raise failure
    server.add_sink(f"/{SERVICE}/Sum", sink)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await _method(channel, "Sum", "stream_unary")(iter([b"1", b"2", b"3"]))
        assert (failed.value.code(), failed.value.details()) == (code, details)
        assert await _method(channel, "Echo")(b"ok") == b"ko"  # the connection serves on
