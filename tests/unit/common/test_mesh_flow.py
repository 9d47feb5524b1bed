"""A mesh server's small, fixed HTTP/2 window: a receiver that stops reading stops its sender
within a few batches, and what waits meanwhile leaves as a few full batches (one for many
steps), not as thousands of single-step messages buffered in the transport. Real gRPC on
loopback: a BatchedStream into a GatewayInbox server built as a mesh port is, on grpc.aio's
server or the native one, from grpc.aio's channel or the native client, each with each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from meshlm.common.native_grpc.client import NativeChannel
from meshlm.common.native_grpc.server import NativeServer
from meshlm.common.server import MESH_WINDOW_BYTES, server_options
from meshlm.common.streams import BatchedStream
from meshlm.v1 import common_pb2, gateway_pb2
from meshlm.v1 import gateway_pb2_grpc as pb_grpc

ITEMS = 2000
ITEM_TEXT = "x" * 1000  # 2 MB in all: over a hundred times the window


class StalledInbox(pb_grpc.GatewayInboxServicer):
    """Reads one batch, then nothing until `resume` is set."""

    def __init__(self) -> None:
        self.resume = asyncio.Event()
        self.first = asyncio.Event()
        self.batches: list[int] = []  # items per batch received

    async def Deliver(self, request_iterator: AsyncIterator[gateway_pb2.TextBatch],
                      context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        async for batch in request_iterator:
            self.batches.append(len(batch.outputs))
            self.first.set()
            await self.resume.wait()
        return common_pb2.Empty()


async def _until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout)


@pytest.fixture(params=[("grpcio", "grpcio"), ("native", "native"), ("grpcio", "native"),
                        ("native", "grpcio")], ids=lambda p: f"server-{p[0]}-client-{p[1]}")
async def stalled(request: pytest.FixtureRequest
                  ) -> AsyncIterator[tuple[StalledInbox, BatchedStream[gateway_pb2.TextOutput]]]:
    server_kind, client_kind = request.param
    server: grpc.aio.Server
    if server_kind == "native":
        server = NativeServer(stream_window=MESH_WINDOW_BYTES)
    else:
        server = grpc.aio.server(options=server_options())
    inbox = StalledInbox()
    pb_grpc.add_GatewayInboxServicer_to_server(inbox, server)
    port = server.add_insecure_port("127.0.0.1:0")
    if isinstance(server, NativeServer):
        [port] = await server.bind()
    await server.start()
    channel: grpc.aio.Channel | NativeChannel
    if client_kind == "native":
        channel = NativeChannel(f"127.0.0.1:{port}", None)
    else:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream: BatchedStream[gateway_pb2.TextOutput] = BatchedStream(
        "test", "inbox", pb_grpc.GatewayInboxStub(channel).Deliver,
        lambda items: gateway_pb2.TextBatch(outputs=items), ready=channel.channel_ready)
    stream.start()
    try:
        yield inbox, stream
    finally:
        inbox.resume.set()
        await stream.close()
        await channel.close()
        await server.stop(0)


async def test_a_stalled_receiver_pushes_back_and_what_waits_leaves_in_few_batches(stalled):
    inbox, stream = stalled
    await stream.put([gateway_pb2.TextOutput(rid="first")])
    await asyncio.wait_for(inbox.first.wait(), 10)
    for i in range(ITEMS):  # one item per loop turn, as one engine step's output would come
        await stream.put([gateway_pb2.TextOutput(rid=f"r{i}", text=ITEM_TEXT)])
        await asyncio.sleep(0)
    # the transport took a few messages (a window's worth, and the batch whose write waits
    # for room); the rest waits in the sender's queue
    assert stream.messages_sent < 64, stream.messages_sent
    assert stream.queued > 0
    inbox.resume.set()
    await _until(lambda: sum(inbox.batches) == ITEMS + 1)  # nothing lost
    assert len(inbox.batches) < ITEMS // 20, len(inbox.batches)  # and merged on the way


def test_only_mesh_ports_get_the_small_window():
    mesh, public = dict(server_options()), dict(server_options(public=True))
    assert mesh["grpc.http2.bdp_probe"] == 0
    assert mesh["grpc.http2.lookahead_bytes"] == MESH_WINDOW_BYTES
    assert "grpc.http2.bdp_probe" not in public and "grpc.http2.lookahead_bytes" not in public
