import asyncio

import grpc
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.inbox import PendingRequest, RequestTable
from meshlm.v1 import gateway_pb2


def _req(rid: str = "r", scheduler: str = "s1") -> PendingRequest:
    return PendingRequest(rid=rid, tokenizer="t", scheduler=scheduler, detokenizer="d",
                          started_at=0.0)


async def test_mailbox_coalesces_until_read():
    req = _req()
    for i in range(3):
        req.deliver(gateway_pb2.TextOutput(rid="r", text=f"t{i} ", token_ids=[i],
                                           completion_tokens=i + 1))
    update = await req.next()
    assert (update.text, update.token_ids, update.completion_tokens) == ("t0 t1 t2 ", [0, 1, 2], 3)
    assert update.final is None and not req.done
    req.deliver(gateway_pb2.TextOutput(rid="r", text="end", finished=True, finish_reason="stop"))
    req.deliver(gateway_pb2.TextOutput(rid="r", text="ignored after final"))
    update = await req.next()
    assert update.text == "end" and update.final.finish_reason == "stop" and req.done


async def test_error_output_and_fail_become_mesh_errors():
    req = _req()
    req.deliver(gateway_pb2.TextOutput(rid="r", finished=True, finish_reason="error",
                                       error={"code": 3, "message": "bad"}))
    update = await req.next()
    assert update.error.code == grpc.StatusCode.INVALID_ARGUMENT and update.error.message == "bad"
    other = _req("o")
    other.fail(MeshError(grpc.StatusCode.UNAVAILABLE, "gone"))
    assert (await asyncio.wait_for(other.next(), 1)).error.code == grpc.StatusCode.UNAVAILABLE


def test_table_counts_per_scheduler_and_refuses_duplicates():
    table = RequestTable()
    table.add(_req("a", "s1"))
    table.add(_req("b", "s1"))
    table.add(_req("c", "s2"))
    with pytest.raises(MeshError) as err:
        table.add(_req("a", "s2"))
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert (table.count_on("s1"), table.count_on("s2")) == (2, 1)
    table.remove("a")
    table.remove("a")
    assert table.count_on("s1") == 1
