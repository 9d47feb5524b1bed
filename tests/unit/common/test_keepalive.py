"""Keepalive between mesh peers: a peer that stops answering while its connection stays open (as
under SIGSTOP) is noticed within DOWN_BOUND, and an idle stream with the mesh's pings is not
refused by a mesh server's ping policy. Real gRPC over mTLS through a TCP relay that can stop
passing bytes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshlm.common.channels import (
    DOWN_BOUND,
    KEEPALIVE_TIME_MS,
    MIN_PING_INTERVAL_MS,
    PING_TIMEOUT_MS,
    ChannelPool,
)
from meshlm.common.native_grpc.client import NativeChannel
from meshlm.common.native_grpc.server import NativeServer
from meshlm.common.server import MESH_WINDOW_BYTES, SERVER_OPTIONS, server_options
from meshlm.launch.certs import ensure_dev_certs
from meshlm.v1 import common_pb2, gateway_pb2
from meshlm.v1 import gateway_pb2_grpc as pb_grpc


def test_the_bound_covers_a_ping_and_its_timeout_and_servers_allow_the_pings():
    assert (KEEPALIVE_TIME_MS + PING_TIMEOUT_MS) / 1000 < DOWN_BOUND
    assert MIN_PING_INTERVAL_MS < KEEPALIVE_TIME_MS
    options = dict(SERVER_OPTIONS)
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= KEEPALIVE_TIME_MS
    assert options["grpc.keepalive_permit_without_calls"] == 1


class Relay:
    """Passes TCP bytes between clients and `target` until `freeze()`: then it holds them, both
    ways, and keeps every connection open, like a peer that stopped running."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.passing = asyncio.Event()
        self.passing.set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def freeze(self) -> None:
        self.passing.clear()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._tasks.add(task)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                await self.passing.wait()
                sink.write(data)
                await sink.drain()
        sink.close()

    async def close(self) -> None:
        self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture
async def relayed(tmp_path: Path) -> AsyncIterator[tuple[Relay, grpc.aio.Channel]]:
    """A mesh server (SERVER_OPTIONS) behind a relay, and a mesh channel to it through the
    relay (CHANNEL_OPTIONS)."""
    tls = ensure_dev_certs(tmp_path).mesh_tls()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    await server.start()
    relay = Relay(port)
    pool = ChannelPool(tls.channel_credentials())
    channel = pool.get(f"127.0.0.1:{await relay.start()}")
    yield relay, channel
    await pool.close()
    await relay.close()
    await server.stop(None)


async def _watch(channel: grpc.aio.Channel, replies: asyncio.Queue[int]) -> grpc.StatusCode:
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    try:
        async for reply in call:
            replies.put_nowait(reply.status)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def test_an_idle_stream_lives_and_a_silent_peer_ends_it_within_the_bound(relayed):
    relay, channel = relayed
    replies: asyncio.Queue[int] = asyncio.Queue()
    watch = asyncio.create_task(_watch(channel, replies))
    assert await asyncio.wait_for(replies.get(), 10) == health_pb2.HealthCheckResponse.SERVING
    # Idle for four keepalive periods: the client's pings are allowed (a server refusing them
    # would end the call with GOAWAY "too_many_pings" after its third strike).
    done, _ = await asyncio.wait({watch}, timeout=4 * KEEPALIVE_TIME_MS / 1000)
    assert not done, watch.result()
    relay.freeze()
    frozen_at = time.monotonic()
    code = await asyncio.wait_for(watch, DOWN_BOUND + 1)
    took = time.monotonic() - frozen_at
    assert code == grpc.StatusCode.UNAVAILABLE
    assert took <= DOWN_BOUND, took


class Inbox(pb_grpc.GatewayInboxServicer):
    """Reads batches for as long as they come."""

    def __init__(self) -> None:
        self.batches: asyncio.Queue[gateway_pb2.TextBatch] = asyncio.Queue()

    async def Deliver(self, request_iterator: AsyncIterator[gateway_pb2.TextBatch],
                      context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        async for batch in request_iterator:
            self.batches.put_nowait(batch)
        return common_pb2.Empty()


@pytest.mark.parametrize("server_kind", ["grpcio", "native"])
async def test_a_native_stream_lives_idle_and_ends_within_the_bound_when_its_peer_is_silent(
        tmp_path: Path, server_kind: str) -> None:
    """The native client's batched stream (common/native_grpc/client.py), over mTLS through
    the relay, to either mesh server: its pings keep an idle stream up and find a frozen peer
    within DOWN_BOUND, failing the call UNAVAILABLE."""
    tls = ensure_dev_certs(tmp_path).mesh_tls()
    inbox = Inbox()
    server: grpc.aio.Server
    if server_kind == "native":
        server = NativeServer(stream_window=MESH_WINDOW_BYTES)
        server.add_secure_port("127.0.0.1:0", tls.server_context())
        [port] = await server.bind()
    else:
        server = grpc.aio.server(options=server_options())
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
        await server.start()
    pb_grpc.add_GatewayInboxServicer_to_server(inbox, server)
    relay = Relay(port)
    channel = NativeChannel(f"127.0.0.1:{await relay.start()}", tls.client_context())
    try:
        await asyncio.wait_for(channel.channel_ready(), 10)
        call = pb_grpc.GatewayInboxStub(channel).Deliver()
        await call.write(gateway_pb2.TextBatch(outputs=[gateway_pb2.TextOutput(rid="a")]))
        assert (await asyncio.wait_for(inbox.batches.get(), 10)).outputs[0].rid == "a"
        ended = asyncio.ensure_future(call)
        done, _ = await asyncio.wait({ended}, timeout=4 * KEEPALIVE_TIME_MS / 1000)
        assert not done, ended.exception()
        relay.freeze()
        frozen_at = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(ended, DOWN_BOUND + 1)
        took = time.monotonic() - frozen_at
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert took <= DOWN_BOUND, took
    finally:
        await channel.close()
        await relay.close()
        await server.stop(None)


def test_the_public_port_pings_its_clients_gently_and_keeps_its_own_message_limit() -> None:
    mesh = dict(server_options())
    public = dict(server_options(public=True, max_receive_bytes=1 << 20))
    assert mesh["grpc.keepalive_time_ms"] <= 2_000 < public["grpc.keepalive_time_ms"]
    assert public["grpc.keepalive_timeout_ms"] == public["grpc.http2.ping_timeout_ms"] == 10_000
    assert public["grpc.max_receive_message_length"] == 1 << 20
    assert mesh["grpc.max_receive_message_length"] == 64 << 20
    # what the clients may do is the same on both: the mesh's 1 s pings are allowed anywhere
    allowed = "grpc.http2.min_ping_interval_without_data_ms"
    assert public[allowed] == mesh[allowed]
