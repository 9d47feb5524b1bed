"""Fixtures of the fault tests (test_faults.py, test_hung.py), imported by each: a module's own
mesh with two tokenizers, schedulers and detokenizers, a gRPC stub to its gateway, and a client
of its Redis registry."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import redis
from helpers import mesh_redis, own_mesh

from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2_grpc


@pytest.fixture(scope="module")
def mesh2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    replicas = {"tokenizer": 2, "scheduler": 2, "detokenizer": 2}
    with own_mesh(tmp_path_factory.mktemp("two-of-each"), replicas=replicas) as m:
        yield m


@pytest.fixture(scope="module")
def stub(mesh2: Mesh) -> Iterator[sglang_pb2_grpc.SglangServiceStub]:
    with grpc.insecure_channel(mesh2.addresses.gateway_grpc) as ch:
        yield sglang_pb2_grpc.SglangServiceStub(ch)


@pytest.fixture(scope="module")
def registry(mesh2: Mesh) -> Iterator[redis.Redis]:
    client = mesh_redis(mesh2)
    yield client
    client.close()
