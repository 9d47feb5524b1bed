"""FlushCache: the prefix cache of every scheduler emptied on request, refused while requests
run; over gRPC, transcoded HTTP and SGLang's /flush_cache."""

from __future__ import annotations

import random
import uuid

import httpx
from helpers import mesh_credentials, scheduler_load, text_request, wait_until

from sglang.runtime.v1 import sglang_pb2 as pb


def _cached_tokens(stub, prompt: list[int]) -> int:
    req = pb.GenerateRequest(input_ids=prompt, sampling_params=pb.SamplingParams(
        temperature=0.0, max_new_tokens=2, ignore_eos=True))
    [final] = list(stub.Generate(req, timeout=60))
    return int(final.meta_info["cached_tokens"])


def _flushed(stub) -> bool:
    return stub.FlushCache(pb.FlushCacheRequest(), timeout=60).success


def test_flush_empties_the_prefix_cache(stub):
    rng = random.Random(uuid.uuid4().int)
    prompt = [rng.randrange(10, 1000) for _ in range(40)]
    assert _cached_tokens(stub, prompt) == 0
    assert _cached_tokens(stub, prompt) >= 32  # two full blocks reused
    wait_until(lambda: _flushed(stub), what="flush while idle")
    assert _cached_tokens(stub, prompt) == 0


def test_flush_is_refused_while_requests_run(mesh, stub):
    creds = mesh_credentials(mesh)
    rid = f"flush-{uuid.uuid4().hex[:8]}"
    stream = stub.TextGenerate(text_request("Keep running", rid=rid, max_new_tokens=1500,
                                            ignore_eos=True))
    next(stream)
    base = mesh.addresses.gateway_http
    try:
        reply = stub.FlushCache(pb.FlushCacheRequest(), timeout=60)
        assert not reply.success and "running" in reply.message
        assert mesh.addresses.scheduler in reply.message
        native = httpx.post(f"{base}/flush_cache", timeout=60)
        assert native.status_code == 400 and "running" in native.text
    finally:
        assert stub.Abort(pb.AbortRequest(rid=rid)).success
        list(stream)
    wait_until(lambda: scheduler_load(mesh, creds).running == 0, what="slot freed")
    wait_until(lambda: httpx.post(f"{base}/flush_cache", timeout=60).status_code == 200,
               what="native flush while idle")
    r = httpx.post(f"{base}/v1/runtime/flush_cache", json={}, timeout=60)
    assert r.status_code == 200 and r.json()["success"] is True
