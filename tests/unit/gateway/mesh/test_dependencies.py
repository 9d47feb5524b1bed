"""Dependencies against real health servers: static and discovered replicas in dp-rank order, a
replica that joins is used once SERVING, and one that leaves counts as down at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from meshlm.common.channels import ChannelPool
from meshlm.gateway.mesh.dependencies import Dependencies
from meshlm.launch.certs import ensure_dev_certs


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[tuple[list[str], ChannelPool]]:
    """Three health servers (mutual TLS, SERVING) and a client channel pool."""
    tls = ensure_dev_certs(tmp_path).mesh_tls()
    servers, addresses = [], []
    for _ in range(3):
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
        await server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    pool = ChannelPool(tls.channel_credentials())
    yield addresses, pool
    await pool.close()
    for server in servers:
        await server.stop(None)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_joining_and_leaving_replicas(mesh):
    (static, a, b), pool = mesh
    ready: list[bool] = []
    downs: list[tuple[str, str]] = []
    deps = Dependencies(pool, {"tokenizer": [static], "scheduler": [static],
                               "detokenizer": [static]}, ready.append,
                        lambda role, address: downs.append((role, address)))
    deps.start()
    try:
        await until(lambda: deps.ready, "the static replicas to serve")
        # Static first, then discovered ones sorted (not in arrival order).
        high, low = sorted([a, b], key=lambda x: int(x.rsplit(":", 1)[1]), reverse=True)
        assert deps.add("scheduler", high) and deps.add("scheduler", low)
        assert deps.addresses["scheduler"] == [static, low, high]
        assert deps.discovered("scheduler") == [high, low]
        assert not deps.add("scheduler", static) and not deps.add("scheduler", low)
        await until(lambda: len(deps.serving("scheduler")) == 3, "the new replicas to serve")
        assert deps.status()["scheduler"] == {static: True, low: True, high: True}

        # Leaving: on_down fires at once (its requests end now), the ranks close up.
        assert deps.remove("scheduler", low)
        assert downs == [("scheduler", low)]
        assert deps.addresses["scheduler"] == [static, high]
        assert deps.serving("scheduler") == [static, high]
        assert low not in deps.status()["scheduler"]
        assert not deps.remove("scheduler", low) and not deps.remove("scheduler", static)
        assert deps.ready and ready == [True]
    finally:
        await deps.close()


async def test_a_replica_added_before_start_is_watched_from_start(mesh):
    (static, a, _), pool = mesh
    deps = Dependencies(pool, {"scheduler": [static]}, lambda ready: None)
    deps.add("tokenizer", a)
    deps.start()
    try:
        await until(lambda: deps.serving("tokenizer") == [a], "the tokenizer to serve")
    finally:
        await deps.close()
