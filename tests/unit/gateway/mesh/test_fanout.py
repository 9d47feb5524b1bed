"""A replica that leaves while a call to it runs: its channel closes under the call. The fan-out
reports that replica's call as CANCELLED, with the others' replies, and a handler whose own call
was cancelled under it answers UNAVAILABLE at once over gRPC (instead of leaving its client to
wait out its deadline), while a handler its client cancels still just stops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.interceptors import ErrorInterceptor
from meshlm.gateway.mesh.fanout import on_every
from meshlm.launch.certs import ensure_dev_certs

CHECK = health_pb2.HealthCheckRequest()


class Replica(health_pb2_grpc.HealthServicer):
    """Check answers SERVING, or (service "hold") holds the call until released."""

    def __init__(self) -> None:
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def Check(self, req: health_pb2.HealthCheckRequest,
                    ctx: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        if req.service == "hold":
            self.holding.set()
            await self.release.wait()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class Front(health_pb2_grpc.HealthServicer):
    """A gateway-like handler: it asks the replica (through the pool), and answers with that."""

    def __init__(self, pool: ChannelPool, address: str) -> None:
        self.pool, self.address = pool, address
        self.cancelled = asyncio.Event()

    async def Check(self, req: health_pb2.HealthCheckRequest,
                    ctx: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        try:
            return await health_pb2_grpc.HealthStub(self.pool.get(self.address)).Check(
                req, timeout=30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@dataclass
class Mesh:
    replicas: list[tuple[str, Replica]]
    pool: ChannelPool
    front: Front
    front_channel: grpc.aio.Channel


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    tls = ensure_dev_certs(tmp_path, []).mesh_tls()
    servers, replicas = [], []
    for _ in range(2):
        replica = Replica()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(replica, server)
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
        await server.start()
        servers.append(server)
        replicas.append((f"127.0.0.1:{port}", replica))
    pool = ChannelPool(tls.channel_credentials())
    front = Front(pool, replicas[0][0])
    front_server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    health_pb2_grpc.add_HealthServicer_to_server(front, front_server)
    front_port = front_server.add_insecure_port("127.0.0.1:0")
    await front_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{front_port}")
    yield Mesh(replicas, pool, front, channel)
    for _, replica in replicas:
        replica.release.set()
    await channel.close()
    await pool.close()
    for server in [front_server, *servers]:
        await server.stop(None)


async def test_the_fan_out_reports_a_replica_that_left_mid_call_as_cancelled(mesh: Mesh):
    (held, replica), (other, _) = mesh.replicas

    async def check(channel: grpc.aio.Channel) -> health_pb2.HealthCheckResponse:
        service = "hold" if channel is mesh.pool.get(held) else ""
        return await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=30)

    calls = asyncio.ensure_future(on_every(mesh.pool, [held, other], check))
    await replica.holding.wait()
    await mesh.pool.discard(held)  # the replica left: its channel closes under the call
    left, answered = await asyncio.wait_for(calls, timeout=10)
    assert isinstance(left, grpc.aio.AioRpcError)
    assert left.code() == grpc.StatusCode.CANCELLED
    assert left.details() == "the replica left the mesh"
    assert answered.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_call_cancelled_under_a_handler_is_unavailable_to_its_client(mesh: Mesh):
    address, replica = mesh.replicas[0]
    call = health_pb2_grpc.HealthStub(mesh.front_channel).Check(
        health_pb2.HealthCheckRequest(service="hold"), timeout=30)
    await replica.holding.wait()
    await mesh.pool.discard(address)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(call, timeout=10)  # not the 30 s deadline
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the replica it went to left the mesh; calling again is safe" in err.value.details()


async def test_a_handler_its_client_cancels_just_stops(mesh: Mesh):
    _, replica = mesh.replicas[0]
    call = health_pb2_grpc.HealthStub(mesh.front_channel).Check(
        health_pb2.HealthCheckRequest(service="hold"), timeout=30)
    await replica.holding.wait()
    call.cancel()
    await asyncio.wait_for(mesh.front.cancelled.wait(), timeout=10)
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await call.code() == grpc.StatusCode.CANCELLED
