"""Accept-ahead on a grpc.aio server (common/accept_ahead.py): calls that arrive together at a
busy event loop start within a few turns of each other instead of about five turns apiece, and
each still goes through the server's interceptors; the server stops as before. Real gRPC on
loopback: a GrpcServer (the services' own server) with a small SglangService, and a client
process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from meshlm.common import accept_ahead
from meshlm.common.server import Binding, GrpcServer
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc as pb_grpc

CALLS = 20
BUSY_S = 0.005  # one turn of the server's loop, as at a gateway's saturation
NAME = "sglang.runtime.v1.SglangService"


class Turns:
    """Counts the event loop's turns; each turn also runs BUSY_S of work."""

    def __init__(self) -> None:
        self.count = 0

    async def run(self) -> None:
        while True:
            self.count += 1
            end = time.perf_counter() + BUSY_S
            while time.perf_counter() < end:
                pass
            await asyncio.sleep(0)  # one turn: let every ready callback run


class Servicer(pb_grpc.SglangServiceServicer):
    """HealthCheck notes the loop turn each call starts on."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns
        self.entered: list[int] = []

    async def HealthCheck(self, request: pb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        self.entered.append(self.turns.count)
        return pb.HealthCheckResponse(healthy=True)


class Refuse(grpc.aio.ServerInterceptor):
    """Refuses every call without the header x-pass (as the gateway's API-key check does)."""

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if ("x-pass", "1") in (details.invocation_metadata or ()):
            return await continuation(details)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no pass")

        return grpc.unary_unary_rpc_method_handler(refuse)


@contextlib.asynccontextmanager
async def serving(depth: int, interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
                  ) -> AsyncIterator[tuple[GrpcServer, Servicer, Turns, str]]:
    turns = Turns()
    servicer = Servicer(turns)
    server = GrpcServer([Binding(pb_grpc.add_SglangServiceServicer_to_server, servicer, NAME)],
                        interceptors=interceptors, accept_ahead=depth)
    address = await server.start("127.0.0.1", 0, None)
    server.accept_ahead.start()
    await server.set_serving(True)
    try:
        yield server, servicer, turns, address
    finally:
        await server.stop(1.0)


# The client: another process (the server's loop spins; a client sharing its GIL would crawl),
# CALLS HealthChecks at once on one channel; prints each call's status code name.
CLIENT = """
import asyncio, json, sys
import grpc
from sglang.runtime.v1 import sglang_pb2 as pb, sglang_pb2_grpc as pb_grpc

async def main(address, metadata):
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = pb_grpc.SglangServiceStub(channel)

        async def one():
            try:
                await stub.HealthCheck(pb.HealthCheckRequest(), metadata=metadata, timeout=60)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return "OK"

        print(json.dumps(await asyncio.gather(*(one() for _ in range(int(sys.argv[2]))))))

asyncio.run(main(sys.argv[1], tuple(tuple(kv) for kv in json.loads(sys.argv[3]))))
"""


async def _call_all(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """CALLS HealthChecks arriving together from a client process; each call's status."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, address, str(CALLS), json.dumps(metadata),
        stdout=asyncio.subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    codes: list[str] = json.loads(out)
    return codes


async def _turns_to_start_all(depth: int) -> int:
    """Loop turns between the first and the last of CALLS calls' start, arriving together at a
    loop whose turns take BUSY_S."""
    async with serving(depth) as (_, servicer, turns, address):
        ticking = asyncio.create_task(turns.run())
        try:
            codes = await _call_all(address)
        finally:
            ticking.cancel()
        assert codes == ["OK"] * CALLS  # nothing lost
        assert len(servicer.entered) == CALLS
        return max(servicer.entered) - min(servicer.entered)


async def test_calls_arriving_together_start_within_a_few_turns_of_each_other():
    alone = await _turns_to_start_all(0)
    ahead = await _turns_to_start_all(8)
    # grpc's own serving task: about five turns per call (measured 90-110 for 20 calls)
    assert alone >= 3 * CALLS, alone
    assert ahead * 3 <= alone, (ahead, alone)


async def test_calls_taken_ahead_go_through_the_interceptors():
    async with serving(4, (Refuse(),)) as (server, servicer, _, address):
        refused = await _call_all(address)
        passed = await _call_all(address, (("x-pass", "1"),))
        assert refused == ["PERMISSION_DENIED"] * CALLS
        assert passed == ["OK"] * CALLS
        assert len(servicer.entered) == CALLS  # only the calls with the header got in
        assert server.accept_ahead.accepted > 0  # the acceptors took some of them


async def test_the_server_stops_promptly_and_its_acceptors_end():
    async with serving(8) as (server, _, _, address):
        assert await _call_all(address) == ["OK"] * CALLS
        acceptors = list(server.accept_ahead._acceptors)
        assert len(acceptors) == 8 * len(server.accept_ahead.methods)
        start = time.perf_counter()
        await server.stop(1.0)
        assert time.perf_counter() - start < 1.0  # nothing in flight: no wait for the grace
        await asyncio.wait_for(asyncio.gather(*acceptors, return_exceptions=True), 5)
        assert all(task.done() for task in acceptors)


async def test_a_grpc_without_the_internals_serves_as_grpc_does(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(accept_ahead._INTERNALS, "_handle_rpc", ("another", "signature"))
    async with serving(8) as (server, servicer, _, address):
        assert server.accept_ahead._acceptors == []
        assert await _call_all(address) == ["OK"] * CALLS
        assert server.accept_ahead.accepted == 0
        assert len(servicer.entered) == CALLS
