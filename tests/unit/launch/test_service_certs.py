"""Per-service certificates by name, the Redis password files, and the probe/pool that check a
peer against its role's name rather than its address."""

from __future__ import annotations

import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshlm.common.channels import ChannelPool
from meshlm.common.server import Binding, GrpcServer
from meshlm.common.tls import MeshTLS
from meshlm.launch.certs import DevCerts, cli, ensure_service_certs
from meshlm.launch.mesh_secrets import redis_auth_secret, tls_secret

SERVICES = {"scheduler": ["scheduler", "meshlm-scheduler"], "gateway": ["gateway"]}


def _sans(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n.value) for n in ext}


def test_one_certificate_per_service_with_its_names_only(tmp_path: Path) -> None:
    certs = ensure_service_certs(tmp_path, SERVICES)
    assert _sans(certs.leaf("scheduler")[0]) == {"scheduler", "meshlm-scheduler"}
    assert _sans(certs.leaf("gateway")[0]) == {"gateway"}  # no addresses at all
    assert stat.S_IMODE(certs.leaf("scheduler")[1].stat().st_mode) == 0o600
    before = certs.leaf("gateway")[0].read_bytes()
    ensure_service_certs(tmp_path, SERVICES)
    assert certs.leaf("gateway")[0].read_bytes() == before  # kept when still good
    ensure_service_certs(tmp_path, {"gateway": ["gateway", "meshlm-gateway"]})
    assert _sans(certs.leaf("gateway")[0]) == {"gateway", "meshlm-gateway"}


def test_cli_makes_certs_and_a_redis_password_kept_across_runs(tmp_path: Path) -> None:
    args = [str(tmp_path), "--service", "redis=redis", "--service", "tokenizer=tokenizer",
            "--redis-password"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    password = (tmp_path / "redis-password").read_text().strip()
    assert len(password) >= 32 and password not in result.output
    assert (tmp_path / "redis-auth.conf").read_text() == f"requirepass {password}\n"
    assert stat.S_IMODE((tmp_path / "redis-password").stat().st_mode) == 0o600
    assert CliRunner().invoke(cli, args).exit_code == 0
    assert (tmp_path / "redis-password").read_text().strip() == password
    certs = DevCerts(tmp_path)
    secret = tls_secret(certs.ca_cert, *certs.leaf("tokenizer"))
    assert set(secret) == {"tls.crt", "tls.key", "ca.crt"}
    assert redis_auth_secret(tmp_path)["password"] == password.encode()


def test_cli_refuses_a_malformed_service_and_k8s_outside_a_pod(tmp_path: Path) -> None:
    bad = CliRunner().invoke(cli, [str(tmp_path), "--service", "scheduler"])
    assert bad.exit_code == 2 and "NAME=DNS" in bad.output
    env = {"KUBERNETES_SERVICE_HOST": ""}
    outside = CliRunner(env=env).invoke(
        cli, [str(tmp_path), "--no-certs", "--redis-password", "--k8s-secrets", "meshlm"])
    assert outside.exit_code != 0 and "inside a Kubernetes pod" in str(outside.exception)


@pytest.fixture
async def scheduler(tmp_path: Path) -> AsyncIterator[tuple[str, DevCerts, str, GrpcServer]]:
    """A mesh server with the scheduler's certificate, plus its plaintext health-only port."""
    certs = ensure_service_certs(tmp_path, SERVICES)
    tls = MeshTLS(str(certs.ca_cert), *map(str, certs.leaf("scheduler")))
    server = GrpcServer([Binding(lambda s, srv: None, None, "meshlm.v1.Scheduler")])
    bound = await server.start("127.0.0.1", 0, tls.server_credentials())
    health_only = await server.serve_health("127.0.0.1", 0)
    await server.set_serving(True)
    yield bound, certs, health_only, server
    await server.stop(0)


async def test_pool_checks_the_role_name_not_the_address(scheduler) -> None:
    address, certs, *_ = scheduler
    client = MeshTLS(str(certs.ca_cert), *map(str, certs.leaf("gateway")))
    named = ChannelPool(client.channel_credentials(), "meshlm-{role}")
    assert named.name_for("scheduler") == "meshlm-scheduler"
    reply = await health_pb2_grpc.HealthStub(named.for_role("scheduler", address)).Check(
        health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # The same certificate is refused for another role's name, and by address (127.0.0.1).
    for pool, role in ((named, "tokenizer"), (ChannelPool(client.channel_credentials()), "x")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(pool.for_role(role, address)).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await pool.close()


def _probe(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshlm.health", *args], env=env,
                          capture_output=True, text=True, timeout=60)


async def test_probe_over_mtls_with_the_role_name_and_plaintext_health_port(scheduler) -> None:
    import asyncio
    import os

    address, certs, health_only, _ = scheduler
    cert, key = certs.leaf("gateway")
    env = {**os.environ, "MESHLM_MESH_CA": str(certs.ca_cert), "MESHLM_MESH_CERT": str(cert),
           "MESHLM_MESH_KEY": str(key), "MESHLM_PEER_TLS_NAME": "meshlm-{role}"}
    ok = await asyncio.to_thread(_probe, ["scheduler", "--address", address], env)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    wrong = await asyncio.to_thread(
        _probe, ["scheduler", "--address", address], {**env, "MESHLM_PEER_TLS_NAME": "x-{role}"})
    assert wrong.returncode == 1 and "UNAVAILABLE" in wrong.stderr
    plain = await asyncio.to_thread(_probe, ["scheduler", "--plaintext", "--address",
                                             health_only], env)
    assert plain.returncode == 0, plain.stderr
    no_certs = {k: v for k, v in env.items() if not k.startswith("MESHLM_MESH")}
    usage = await asyncio.to_thread(_probe, ["scheduler", "--address", address], no_certs)
    assert usage.returncode == 2 and "MESHLM_MESH_CA" in usage.stderr


async def test_health_only_port_answers_nothing_else(scheduler) -> None:
    health_only = scheduler[2]
    async with grpc.aio.insecure_channel(health_only) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="meshlm.v1.Scheduler"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # Not ready (e.g. waiting for a dependency) is still alive: liveness stays SERVING.
        await scheduler[3].set_serving(False)
        stub = health_pb2_grpc.HealthStub(channel)
        ready = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        alive = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert alive.status == health_pb2.HealthCheckResponse.SERVING
        call = channel.unary_unary("/meshlm.v1.Scheduler/GetLoad")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


_ = health  # the grpc_health package is what GrpcServer registers
