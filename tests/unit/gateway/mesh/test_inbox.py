import asyncio

import grpc
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.mesh.inbox import PendingRequest, RequestTable, next_updates
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


async def test_the_prompt_ids_come_with_the_first_update_only():
    req = _req()
    req.deliver(gateway_pb2.TextOutput(rid="r", text="a", token_ids=[4], prompt_ids=[1, 2]))
    assert (await req.next()).prompt_ids == [1, 2]
    req.deliver(gateway_pb2.TextOutput(rid="r", text="b", token_ids=[5]))
    assert (await req.next()).prompt_ids is None


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


async def test_children_share_one_wait():
    ready = asyncio.Event()
    kids = [PendingRequest(rid=f"r-{i}", tokenizer="t", scheduler="s", detokenizer="d",
                           started_at=0.0, ready=ready) for i in range(3)]
    waiter = asyncio.ensure_future(next_updates(kids))
    await asyncio.sleep(0)
    assert not waiter.done()
    kids[2].deliver(gateway_pb2.TextOutput(rid="r-2", token_ids=[5]))
    kids[0].deliver(gateway_pb2.TextOutput(rid="r-0", token_ids=[6], finished=True,
                                           finish_reason="length", embedding=[1.0]))
    news = await asyncio.wait_for(waiter, 1)
    assert [(i, u.token_ids) for i, u in news] == [(0, [6]), (2, [5])]
    assert news[0][1].embedding == [1.0] and kids[0].done and not kids[2].done
    assert kids[0].take() is None and kids[1].take() is None
    kids[1].fail(MeshError(grpc.StatusCode.UNAVAILABLE, "gone"))
    [(i, update)] = await asyncio.wait_for(next_updates(kids), 1)
    assert i == 1 and update.error is not None


def test_groups_are_added_and_removed_whole():
    table = RequestTable()
    table.add_group("p", [_req("p-0"), _req("p-1")])
    assert [r.rid for r in table.members("p")] == ["p-0", "p-1"]
    assert [r.rid for r in table.members("p-1")] == ["p-1"] and table.members("x") == []
    for rid, kids in [("p", [_req("q")]), ("q", [_req("p-1")]), ("p-0", [_req("p-0")])]:
        with pytest.raises(MeshError) as err:
            table.add_group(rid, kids)
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert len(table.requests) == 2 and table.count_on("s1") == 2  # nothing half-added
    table.remove_group("p")
    assert table.requests == {} and table.groups == {} and table.count_on("s1") == 0
    table.add(_req("p"))
    assert [r.rid for r in table.members("p")] == ["p"]
