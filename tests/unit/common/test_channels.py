"""ChannelPool: a replica resolved from a DNS name is verified against that name (TLS target
name override), and later calls that know only the address reuse that channel."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshlm.common.channels import ChannelPool
from meshlm.launch.certs import ensure_dev_certs

NAME = "schedulers.meshlm.test"


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[str, ChannelPool]]:
    certs = ensure_dev_certs(tmp_path, [NAME])
    tls = certs.mesh_tls()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    await server.start()
    pool = ChannelPool(tls.channel_credentials())
    yield f"127.0.0.1:{port}", pool
    await pool.close()
    await server.stop(None)


async def check(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def test_the_server_name_is_what_the_certificate_is_checked_against(served):
    address, pool = served
    assert await check(pool.get(address, NAME)) == health_pb2.HealthCheckResponse.SERVING
    assert pool.get(address) is pool.get(address, NAME)  # remembered for the address
    # The certificate is valid for 127.0.0.1 too: only the override can make this fail.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await check(pool.get(address, "other.meshlm.test"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_discard_forgets_the_name(served):
    address, pool = served
    pool.get(address, "other.meshlm.test")
    await pool.discard(address)
    assert await check(pool.get(address)) == health_pb2.HealthCheckResponse.SERVING
