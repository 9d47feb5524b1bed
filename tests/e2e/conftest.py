"""End-to-end fixtures: the real services as processes on loopback ports, a real Redis, real
certificates, and an in-test OTLP receiver. Everything is torn down even when a test fails."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
import pytest
from helpers import openai_client
from k8s_objects import TARGETS
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from meshlm.launch.mesh import Mesh, MeshOptions
from sglang.runtime.v1 import sglang_pb2_grpc


@dataclass
class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects exported spans; `wait_for(predicate)` blocks on new exports, not on time."""

    spans: list[dict] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        with self.cond:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "attributes": {a.key: a.value for a in s.attributes},
                        })
            self.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout: float = 30.0):
        with self.cond:
            ok = self.cond.wait_for(lambda: predicate(self.spans), timeout=timeout)
        return ok


@pytest.fixture(scope="session")
def otlp() -> Iterator[tuple[OtlpReceiver, str]]:
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="session")
def mesh(otlp, tmp_path_factory) -> Iterator[Mesh]:
    _, endpoint = otlp
    workdir: Path = tmp_path_factory.mktemp("mesh")
    options = MeshOptions(
        workdir=workdir, http_port=0, grpc_port=0, metrics_port=0,  # metrics on free ports
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "MESHLM_REGISTRY_FINISHED_TTL": "2",
        },
    )
    m = Mesh(options)
    try:
        m.start()
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="session")
def channel(mesh) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(mesh.addresses.gateway_grpc)
    yield ch
    ch.close()


@pytest.fixture(scope="session")
def stub(channel) -> sglang_pb2_grpc.SglangServiceStub:
    return sglang_pb2_grpc.SglangServiceStub(channel)


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    """The official openai client on the module's mesh (a module's own mesh where it has one)."""
    return openai_client(mesh)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    """The served model's name, as /v1/models lists it."""
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def meshlm_image(tmp_path_factory) -> str:
    """The real image, built once per session from deploy/Dockerfile (skips without Docker)."""
    from containers import build_image, require_docker

    require_docker()
    tag = "meshlm:e2e"
    built = build_image(tag, tmp_path_factory.mktemp("image"))
    print(f"\nimage {tag}: built in {built['seconds']:.1f} s, {built['bytes'] / 1e6:.0f} MB")
    return tag


@pytest.fixture(params=list(TARGETS))
def target(request) -> str:
    """Each kustomize target of deploy/k8s (the base and every overlay), for the k8s tests."""
    return request.param
