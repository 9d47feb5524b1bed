"""What the transports themselves cost per streamed message: the floors under the gateway's CPU
per token.

A bare server in its own process (no mesh, none of the gateway's work) streams the message the
gateway streams per token to `streams` clients at once, one message to every stream on each
tick of a timer, as the gateway writes one message to each client per engine step:

- gRPC: grpc.aio with no interceptors, a TextGenerateResponse with one id, a piece of text and
  the same meta_info keys;
- HTTP: uvicorn as the gateway runs it (httptools), the gateway's Starlette response class,
  SGLang's /generate event (cumulative text, the same meta_info keys) as Server-Sent Events.

The messages are made before the run: making them is the gateway's own work, which
`bench.gateway_path` measures. The server's CPU seconds per message are the transport's own
cost of one public message, measured on this machine in this run; times the messages per
token the gateway wrote (fewer than one at saturation, where a stream's mailbox folds what
arrives while its client is busy), it is the floor under the gateway's µs per token. What the
gateway spends above it is its own work (reading the detokenizer's stream, routing each
update, building the message).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import socket
from collections.abc import AsyncIterator, Callable, Collection, Coroutine
from typing import Any

import grpc

from meshlm.bench.proc_cpu import own_cpu_seconds
from meshlm.bench.raw_http import SsePool
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

TICK_S = 0.002  # between the server's rounds of writes (an engine step, roughly)
RID = "0123456789abcdef0123456789abcdef"


class _Ticks:
    """Wakes every stream's writer once per tick, and calls `on_tick`."""

    def __init__(self) -> None:
        self.tick = asyncio.Event()
        self.on_tick: Callable[[], None] = lambda: None

    async def run(self) -> None:
        while True:
            self.tick.set()
            self.tick.clear()
            self.on_tick()
            await asyncio.sleep(TICK_S)


def _message(i: int, messages: int) -> pb.TextGenerateResponse:
    meta = {"id": RID, "prompt_tokens": "17", "completion_tokens": str(i + 1),
            "cached_tokens": "0"}
    return pb.TextGenerateResponse(text=" word", output_ids=[i], meta_info=meta,
                                   finished=i == messages - 1)


class _Streamer(sglang_pb2_grpc.SglangServiceServicer):
    """The messages are made before the run: making one is the gateway's own work (and
    bench.gateway_path's), not the transport's."""

    def __init__(self, messages: int, ticks: _Ticks) -> None:
        self.replies = [_message(i, messages) for i in range(messages)]
        self.ticks = ticks

    async def TextGenerate(self, req: pb.TextGenerateRequest,
                           ctx: grpc.aio.ServicerContext) -> AsyncIterator[pb.TextGenerateResponse]:
        for reply in self.replies:
            await self.ticks.tick.wait()
            yield reply


class _DirectStreamer(sglang_pb2_grpc.SglangServiceServicer):
    """As `_Streamer` on the native server, as the gateway streams there: the first and last
    messages from the handler, the ones between written on each tick from outside it with
    `write_now` (the gateway's direct writes, `gateway/api/direct.py`)."""

    def __init__(self, messages: int, ticks: _Ticks) -> None:
        self.messages = messages
        self.replies = [_message(i, messages) for i in range(messages)]  # made beforehand,
        self.wire = [m.SerializeToString() for m in self.replies]  # as _Streamer's
        self.running: dict[Any, list[Any]] = {}  # context -> [next message, its end]
        ticks.on_tick = self._tick

    def _tick(self) -> None:
        for context, state in list(self.running.items()):
            if context.write_now(self.wire[state[0]]):
                state[0] += 1
            if state[0] == self.messages - 1:
                del self.running[context]
                state[1].set()

    async def TextGenerate(self, req: pb.TextGenerateRequest,
                           ctx: grpc.aio.ServicerContext) -> AsyncIterator[pb.TextGenerateResponse]:
        yield self.replies[0]
        end = asyncio.Event()
        self.running[ctx] = [1, end]
        await end.wait()
        yield self.replies[-1]


async def _serve_grpc(messages: int, ticks: _Ticks, ports: multiprocessing.Queue) -> None:
    server = grpc.aio.server()
    sglang_pb2_grpc.add_SglangServiceServicer_to_server(_Streamer(messages, ticks), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ports.put(port)
    await server.wait_for_termination()


def _event(i: int) -> bytes:
    """SGLang's /generate event after `i` + 1 tokens: the text so far."""
    from meshlm.gateway.front.sse import sse_event

    return sse_event({"text": " word" * (i + 1), "meta_info": {
        "id": RID, "finish_reason": None, "prompt_tokens": 17, "completion_tokens": i + 1,
        "cached_tokens": 0, "e2e_latency": 0.002 * i, "weight_version": "default"}})


def _sse_app(messages: int, ticks: _Ticks, direct: bool = False) -> Any:
    """/generate's SSE stream; `direct`: the first and last events from the response's task,
    the ones between written on each tick from outside it, as the gateway's direct writes do
    (`front/http_streams.DirectBody`)."""
    from starlette.requests import Request
    from starlette.routing import Route

    from meshlm.gateway.front.http_streams import BodySendApp, DirectBody, StreamResponse
    from meshlm.gateway.front.sse import SSE_DONE

    running: dict[DirectBody, list[Any]] = {}  # -> [next event, its end]
    made = [_event(i) for i in range(messages)]  # beforehand, as the gRPC servers' messages

    def tick() -> None:
        for body, state in list(running.items()):
            if body.writable():
                body.write(made[state[0]])
                state[0] += 1
            if state[0] == messages - 1:
                del running[body]
                state[1].set()

    async def events(body: DirectBody | None) -> AsyncIterator[bytes]:
        if body is None:
            for event in made:
                await ticks.tick.wait()
                yield event
        else:
            yield made[0]
            end = asyncio.Event()
            running[body] = [1, end]
            await end.wait()
            yield made[-1]
        yield SSE_DONE

    async def generate(request: Request) -> StreamResponse:
        await request.body()
        body = DirectBody() if direct else None
        return StreamResponse(events(body), None, "text/event-stream", body)

    ticks.on_tick = tick
    return BodySendApp(routes=[Route("/generate", generate, methods=["POST"])])


async def _serve_http(messages: int, ticks: _Ticks, ports: multiprocessing.Queue,
                      direct: bool = False) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    config = uvicorn.Config(_sse_app(messages, ticks, direct), log_config=None, access_log=False,
                            lifespan="off", http="httptools", loop="none")
    ports.put(sock.getsockname()[1])
    await uvicorn.Server(config).serve(sockets=[sock])


async def _serve_native(messages: int, ticks: _Ticks, ports: multiprocessing.Queue,
                        direct: bool = False) -> None:
    from meshlm.common.native_grpc.server import NativeServer

    server = NativeServer()
    streamer = (_DirectStreamer if direct else _Streamer)(messages, ticks)
    sglang_pb2_grpc.add_SglangServiceServicer_to_server(streamer, server)
    server.add_insecure_port("127.0.0.1:0")
    [port] = await server.bind()
    ports.put(port)
    await server.wait_for_termination()


_SERVERS: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
    "grpc": _serve_grpc, "native": _serve_native, "http": _serve_http,
    "native-direct": functools.partial(_serve_native, direct=True),
    "http-direct": functools.partial(_serve_http, direct=True)}


def _serve(kind: str, messages: int, cpus: Collection[int] | None,
           ports: multiprocessing.Queue) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)

    async def serve() -> None:
        ticks = _Ticks()
        timer = asyncio.create_task(ticks.run())
        try:
            await _SERVERS[kind](messages, ticks, ports)
        finally:
            timer.cancel()

    asyncio.run(serve())


async def _drain_grpc(port: int, streams: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = sglang_pb2_grpc.SglangServiceStub(channel)

        async def one() -> int:
            return len([r async for r in stub.TextGenerate(pb.TextGenerateRequest(text="x"))])

        await one()  # the connection and the server's first call, not measured
        counts = await asyncio.gather(*(one() for _ in range(streams)))
    return sum(counts)


async def _drain_http(port: int, streams: int) -> int:
    pool = SsePool("127.0.0.1", port)

    async def one() -> int:
        events: list[bytes] = []
        await pool.stream("/generate", b"{}", events.append)
        return len([e for e in events if e != b"data: [DONE]"])

    try:
        await one()  # a connection and the server's first call, not measured
        counts = await asyncio.gather(*(one() for _ in range(streams)))
    finally:
        pool.close()
    return sum(counts)


def _server_cpu_per_message(kind: str, drain: Callable[[int, int], Any], streams: int,
                            messages: int, cpus: Collection[int] | None) -> float:
    context = multiprocessing.get_context("spawn")  # no copy of this process's torch
    ports: multiprocessing.Queue = context.Queue()
    server = context.Process(target=_serve, args=(kind, messages, cpus, ports), daemon=True)
    server.start()
    try:
        port, pid = ports.get(timeout=60), server.pid or 0
        before = own_cpu_seconds(pid)
        sent = asyncio.run(drain(port, streams))
        spent = own_cpu_seconds(pid) - before
    finally:
        server.kill()
        server.join()
    if sent != streams * messages:
        raise RuntimeError(f"the {kind} floor's server sent {sent} of {streams * messages} "
                           "messages")
    return spent / sent * 1e6


def grpc_message_floor_us(streams: int = 64, messages: int = 300,
                          cpus: Collection[int] | None = None) -> float:
    """grpc.aio's server CPU µs per streamed message, `streams` streams of `messages` each;
    the server runs on `cpus` (None: anywhere), as the gateway does in the bench."""
    return _server_cpu_per_message("grpc", _drain_grpc, streams, messages, cpus)


def native_grpc_message_floor_us(streams: int = 64, messages: int = 300,
                                 cpus: Collection[int] | None = None) -> float:
    """The gateway's native gRPC server's CPU µs per streamed message (common/native_grpc),
    as above."""
    return _server_cpu_per_message("native", _drain_grpc, streams, messages, cpus)


def native_direct_message_floor_us(streams: int = 64, messages: int = 300,
                                   cpus: Collection[int] | None = None) -> float:
    """The native server's CPU µs per streamed message written directly (`write_now`, as the
    gateway writes a running request's messages), as above."""
    return _server_cpu_per_message("native-direct", _drain_grpc, streams, messages, cpus)


def http_direct_event_floor_us(streams: int = 64, messages: int = 300,
                               cpus: Collection[int] | None = None) -> float:
    """uvicorn's server CPU µs per SSE event written directly (as the gateway writes a lone
    streamed prompt's running events), as above."""
    return _server_cpu_per_message("http-direct", _drain_http, streams, messages, cpus)


def http_event_floor_us(streams: int = 64, messages: int = 300,
                        cpus: Collection[int] | None = None) -> float:
    """uvicorn's and Starlette's server CPU µs per streamed SSE event, as above."""
    return _server_cpu_per_message("http", _drain_http, streams, messages, cpus)
