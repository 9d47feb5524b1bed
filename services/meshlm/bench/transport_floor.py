"""What grpc.aio itself costs per streamed message: the floor under the gateway's CPU per token.

A bare grpc.aio server in its own process (no interceptors, no mesh) streams the message the
gateway streams per token (a TextGenerateResponse with one id, a piece of text and the same
meta_info keys) to `streams` clients at once, one message to every stream on each tick of a
timer, as the gateway writes one message to each client per engine step. Its CPU seconds per
message are grpc.aio's own cost of one public message, measured on this machine in this run:
the gateway's µs per token over gRPC cannot go below it while it sends a message per token.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import AsyncIterator, Collection

import grpc

from meshlm.bench.proc_cpu import own_cpu_seconds
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

TICK_S = 0.002  # between the server's rounds of writes (an engine step, roughly)


class _Streamer(sglang_pb2_grpc.SglangServiceServicer):
    def __init__(self, messages: int) -> None:
        self.messages = messages
        self.tick = asyncio.Event()

    async def TextGenerate(self, req: pb.TextGenerateRequest,
                           ctx: grpc.aio.ServicerContext) -> AsyncIterator[pb.TextGenerateResponse]:
        for i in range(self.messages):
            await self.tick.wait()
            meta = {"id": "0123456789abcdef0123456789abcdef", "prompt_tokens": "17",
                    "completion_tokens": str(i + 1), "cached_tokens": "0"}
            yield pb.TextGenerateResponse(text=" word", output_ids=[i], meta_info=meta,
                                          finished=i == self.messages - 1)

    async def ticks(self) -> None:
        while True:
            self.tick.set()
            self.tick.clear()
            await asyncio.sleep(TICK_S)


def _serve(messages: int, cpus: Collection[int] | None, ports: multiprocessing.Queue) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)

    async def serve() -> None:
        server = grpc.aio.server()
        streamer = _Streamer(messages)
        sglang_pb2_grpc.add_SglangServiceServicer_to_server(streamer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ticks = asyncio.create_task(streamer.ticks())
        ports.put(port)
        try:
            await server.wait_for_termination()
        finally:
            ticks.cancel()

    asyncio.run(serve())


async def _drain(port: int, streams: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = sglang_pb2_grpc.SglangServiceStub(channel)

        async def one() -> int:
            return len([r async for r in stub.TextGenerate(pb.TextGenerateRequest(text="x"))])

        await one()  # the connection and the server's first call, not measured
        counts = await asyncio.gather(*(one() for _ in range(streams)))
    return sum(counts)


def grpc_message_floor_us(streams: int = 64, messages: int = 300,
                          cpus: Collection[int] | None = None) -> float:
    """Server CPU µs per streamed message, `streams` streams of `messages` each; the server
    runs on `cpus` (None: anywhere), as the gateway does in the bench."""
    context = multiprocessing.get_context("spawn")  # no copy of this process's torch
    ports: multiprocessing.Queue = context.Queue()
    server = context.Process(target=_serve, args=(messages, cpus, ports), daemon=True)
    server.start()
    try:
        port, pid = ports.get(timeout=60), server.pid or 0
        before = own_cpu_seconds(pid)
        sent = asyncio.run(_drain(port, streams))
        spent = own_cpu_seconds(pid) - before
    finally:
        server.kill()
        server.join()
    if sent != streams * messages:
        raise RuntimeError(f"the floor's server sent {sent} of {streams * messages} messages")
    return spent / sent * 1e6
