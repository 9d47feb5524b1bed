"""Reflection, health Check/Watch, TLS and mutual TLS on every service."""

from __future__ import annotations

import queue
import signal
import threading
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from helpers import mesh_credentials

from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
INTERNAL = {"tokenizer": "meshlm.v1.Tokenizer", "scheduler": "meshlm.v1.Scheduler",
            "detokenizer": "meshlm.v1.Detokenizer"}


def _reflect(channel: grpc.Channel, service: str) -> tuple[set[str], DescriptorPool]:
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    pool = DescriptorPool(db)
    pool.FindServiceByName(service)  # resolves the file and its dependencies, like grpcurl
    return services, pool


def test_gateway_reflection_lists_and_describes(channel):
    services, pool = _reflect(channel, "sglang.runtime.v1.SglangService")
    assert {"sglang.runtime.v1.SglangService", HEALTH, REFLECTION} <= services
    svc = pool.FindServiceByName("sglang.runtime.v1.SglangService")
    assert len(svc.methods) == 25
    method = svc.methods_by_name["TextGenerate"]
    assert method.server_streaming and method.input_type.full_name.endswith("TextGenerateRequest")
    fields = pool.FindMessageTypeByName("sglang.runtime.v1.SamplingParams").fields_by_name
    assert fields["max_new_tokens"].number == 8 and fields["regex"].number == 15


@pytest.mark.parametrize("role", sorted(INTERNAL))
def test_internal_reflection_and_health(mesh, role):
    address = getattr(mesh.addresses, role)
    with grpc.secure_channel(address, mesh_credentials(mesh)) as ch:
        services, pool = _reflect(ch, INTERNAL[role])
        assert {INTERNAL[role], HEALTH, REFLECTION} <= services
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", INTERNAL[role]):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        first = next(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5))
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_gateway_health_follows_scheduler(mesh, channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "sglang.runtime.v1.SglangService"):
        assert stub.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    statuses: queue.Queue[int] = queue.Queue()
    call = stub.Watch(health_pb2.HealthCheckRequest(service=""))

    def pump() -> None:
        try:
            for reply in call:
                statuses.put(reply.status)
        except grpc.RpcError:
            pass

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert statuses.get(timeout=10) == health_pb2.HealthCheckResponse.SERVING
        mesh.kill("scheduler")
        assert statuses.get(timeout=10) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            list(sglang_pb2_grpc.SglangServiceStub(channel).TextGenerate(
                pb.TextGenerateRequest(text="hi"), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "scheduler" in err.value.details()
        mesh.restart("scheduler")
        assert statuses.get(timeout=60) == health_pb2.HealthCheckResponse.SERVING
    finally:
        call.cancel()
    # And it serves again.
    out = list(sglang_pb2_grpc.SglangServiceStub(channel).TextGenerate(pb.TextGenerateRequest(
        text="hi", sampling_params=pb.SamplingParams(max_new_tokens=3, ignore_eos=True)),
        timeout=60))
    assert out[-1].finished


@pytest.mark.parametrize("role", sorted(INTERNAL))
def test_internal_services_refuse_plaintext_and_certless_tls(mesh, role):
    address = getattr(mesh.addresses, role)
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(ch).Check(request, timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, mesh_credentials(mesh, client_cert=False)) as ch:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(ch).Check(request, timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # The same call with the mesh client certificate succeeds.
    with grpc.secure_channel(address, mesh_credentials(mesh)) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(request, timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_tls_gateway_refuses_plaintext(mesh):
    gw = mesh.start_gateway("gateway-tls", tls=True)
    certs = mesh.addresses.certs
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.insecure_channel(gw.grpc_address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(ch).Check(request, timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    creds = grpc.ssl_channel_credentials(Path(certs.ca_cert).read_bytes())
    with grpc.secure_channel(gw.grpc_address, creds) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(request, timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        out = list(sglang_pb2_grpc.SglangServiceStub(ch).TextGenerate(pb.TextGenerateRequest(
            text="hi", sampling_params=pb.SamplingParams(max_new_tokens=3, ignore_eos=True)),
            timeout=60))
        assert out[-1].finished


def test_sigterm_stops_a_gateway_gracefully(mesh):
    gw = mesh.start_gateway("gateway-term")
    with grpc.insecure_channel(gw.grpc_address) as ch:
        stub = sglang_pb2_grpc.SglangServiceStub(ch)
        # A request in flight when SIGTERM arrives still completes within the grace period.
        stream = stub.TextGenerate(pb.TextGenerateRequest(
            text="draining", stream=True,
            sampling_params=pb.SamplingParams(max_new_tokens=40, ignore_eos=True)), timeout=60)
        first = next(stream)
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        gw.send_signal(signal.SIGTERM)
        statuses = []
        try:
            for reply in watch:
                statuses.append(reply.status)
        except grpc.RpcError:
            pass
        assert statuses and statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING
        rest = [first, *stream]
        assert rest[-1].finished and rest[-1].meta_info["completion_tokens"] == "40"
    gw.proc.wait(timeout=30)
    assert gw.returncode == 0
    log = mesh.log_path("gateway-term").read_text()
    assert '"event":"shutdown_requested"' in log and '"event":"stopped"' in log
