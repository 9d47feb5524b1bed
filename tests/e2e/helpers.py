"""Small client helpers shared by the e2e tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson

from meshlm.launch.mesh import Mesh, MeshOptions
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb


def text_request(text: str, *, stream: bool = True, rid: str | None = None,
                 **sampling: object) -> pb.TextGenerateRequest:
    params = pb.SamplingParams(**{"temperature": 0.0, "max_new_tokens": 16, **sampling})
    req = pb.TextGenerateRequest(text=text, sampling_params=params, stream=stream)
    if rid is not None:
        req.rid = rid
    return req


def collect_text(stub, req: pb.TextGenerateRequest) -> tuple[str, list[pb.TextGenerateResponse]]:
    msgs = list(stub.TextGenerate(req, timeout=120))
    return "".join(m.text for m in msgs), msgs


def scheduler_load(mesh, credentials: grpc.ChannelCredentials) -> scheduler_pb2.Load:
    with grpc.secure_channel(mesh.addresses.scheduler, credentials) as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(scheduler_pb2.GetLoadRequest(),
                                                            timeout=10)


def gateway_load(stub) -> dict:
    return json.loads(stub.GetLoad(pb.GetLoadRequest(), timeout=10).json_info)[0]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll a condition on the system under test (a state, not a duration) with a deadline."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


def mesh_credentials(mesh: Mesh, client_cert: bool = True) -> grpc.ChannelCredentials:
    certs = mesh.addresses.certs
    ca = Path(certs.ca_cert).read_bytes()
    if not client_cert:
        return grpc.ssl_channel_credentials(ca)
    return grpc.ssl_channel_credentials(ca, Path(certs.mesh_key).read_bytes(),
                                        Path(certs.mesh_cert).read_bytes())


TWO_OF_EACH = {"gateway": 2, "tokenizer": 2, "scheduler": 2, "detokenizer": 2}


@contextmanager
def own_mesh(workdir: Path, **options: Any) -> Iterator[Mesh]:
    """A mesh of a test module's own (free ports, one engine thread each unless `env` says
    otherwise), stopped even when a test fails. `options` are MeshOptions fields."""
    env = {"MESHLM_NUM_THREADS": "1", **options.pop("env", {})}
    mesh = Mesh(MeshOptions(workdir=workdir, http_port=0, grpc_port=0, env=env, **options))
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


def generate_events(base: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The events of a streamed POST /generate (no error event allowed)."""
    with httpx.stream("POST", f"{base}/generate", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[len("data: "):])
            assert "error" not in event, event
            yield event
