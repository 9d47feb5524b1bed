"""The RID registry in Redis, duplicate rids, abort and client cancellation."""

from __future__ import annotations

import threading
import uuid

import grpc
import httpx
import pytest
from helpers import mesh_credentials, mesh_redis, scheduler_load, text_request, wait_until

from sglang.runtime.v1 import sglang_pb2 as pb

LONG = {"max_new_tokens": 1500, "ignore_eos": True}


def _record(mesh, rid: str) -> dict[str, str]:
    r = mesh_redis(mesh)
    return r.hgetall(f"meshlm:rid:{rid}")


def test_registry_records_running_request_and_expires_it(mesh, stub):
    rid = f"reg-{uuid.uuid4().hex}"
    stream = stub.TextGenerate(text_request("Tell me a story", rid=rid, **LONG))
    first = next(stream)
    assert not first.finished
    record = _record(mesh, rid)
    assert record["gateway"] == mesh.addresses.gateway_inbox
    assert record["scheduler"] == mesh.addresses.scheduler
    assert record["detokenizer"] == mesh.addresses.detokenizer
    assert record["state"] in ("queued", "running")
    assert float(record["created_at"]) > 0
    wait_until(lambda: _record(mesh, rid).get("state") == "running", what="state running")
    # Duplicate rid while it runs: refused before any work.
    with pytest.raises(grpc.RpcError) as err:
        list(stub.TextGenerate(text_request("again", rid=rid)))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert stub.Abort(pb.AbortRequest(rid=rid)).success
    rest = list(stream)
    assert rest[-1].finished and rest[-1].meta_info["finish_reason"] == "abort"
    wait_until(lambda: _record(mesh, rid).get("state") == "aborted", what="state aborted")
    # Finished records expire (the test mesh sets a 2 s finished TTL).
    wait_until(lambda: not _record(mesh, rid), timeout=15, what="record expiry")


def test_abort_mid_stream_frees_the_slot(mesh, stub):
    creds = mesh_credentials(mesh)
    before = scheduler_load(mesh, creds)
    rid = f"abort-{uuid.uuid4().hex}"
    stream = stub.TextGenerate(text_request("Abort me", rid=rid, **LONG))
    got = [next(stream), next(stream)]
    assert not got[-1].finished
    assert scheduler_load(mesh, creds).running >= 1
    assert stub.Abort(pb.AbortRequest(rid=rid)).success
    rest = list(stream)
    final = rest[-1]
    assert final.finished and final.meta_info["finish_reason"] == "abort"
    assert int(final.meta_info["completion_tokens"]) < 1500
    wait_until(lambda: scheduler_load(mesh, creds).running == 0, what="slot freed")
    assert scheduler_load(mesh, creds).aborted_total == before.aborted_total + 1


def test_abort_unknown_rid_succeeds_and_says_nothing_was_aborted(stub):
    """Idempotent, as SGLang's: success; the trailer says no request was ended."""
    reply, call = stub.Abort.with_call(pb.AbortRequest(rid=f"nope-{uuid.uuid4().hex}"))
    assert reply.success
    assert dict(call.trailing_metadata())["meshlm-aborted"] == "0"


def test_grpc_cancel_aborts_the_request(mesh, stub):
    creds = mesh_credentials(mesh)
    before = scheduler_load(mesh, creds).aborted_total
    stream = stub.TextGenerate(text_request("Cancel me", **LONG))
    next(stream)
    stream.cancel()
    wait_until(lambda: scheduler_load(mesh, creds).aborted_total == before + 1,
               what="scheduler abort after cancel")
    wait_until(lambda: scheduler_load(mesh, creds).running == 0, what="slot freed")


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "Disconnect", "stream": True,
                   "sampling_params": {"temperature": 0, **LONG}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Disconnect"}],
                              "stream": True, "temperature": 0, "ignore_eos": True,
                              "max_tokens": LONG["max_new_tokens"]}),
])
def test_http_disconnect_aborts_the_request(mesh, path, body):
    creds = mesh_credentials(mesh)
    before = scheduler_load(mesh, creds).aborted_total
    with httpx.stream("POST", f"{mesh.addresses.gateway_http}{path}", json=body,
                      timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # leaving the block closed the connection mid-stream
    wait_until(lambda: scheduler_load(mesh, creds).aborted_total == before + 1,
               what="scheduler abort after disconnect")
    wait_until(lambda: scheduler_load(mesh, creds).running == 0, what="slot freed")


def test_abort_all(mesh, stub):
    creds = mesh_credentials(mesh)
    streams = [stub.TextGenerate(text_request(f"All {i}", **LONG)) for i in range(3)]
    for s in streams:
        next(s)
    assert stub.Abort(pb.AbortRequest(abort_all=True)).success
    for s in streams:  # as SGLang's gRPC server: the open streams end CANCELLED
        with pytest.raises(grpc.RpcError) as err:
            list(s)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert "aborted" in err.value.details()
    wait_until(lambda: scheduler_load(mesh, creds).running == 0, what="all freed")


def test_slow_client_does_not_stall_others(stub):
    slow = stub.TextGenerate(text_request("Slow reader", max_new_tokens=200, ignore_eos=True))
    next(slow)  # then stop reading for a while
    done = threading.Event()
    result: list[str] = []

    def fast() -> None:
        msgs = list(stub.TextGenerate(text_request("Fast reader", max_new_tokens=50,
                                                   ignore_eos=True)))
        result.append(msgs[-1].meta_info["finish_reason"])
        done.set()

    threading.Thread(target=fast, daemon=True).start()
    assert done.wait(60), "a slow client stalled another request"
    assert result == ["length"]
    rest = list(slow)
    assert rest[-1].finished and rest[-1].meta_info["completion_tokens"] == "200"
