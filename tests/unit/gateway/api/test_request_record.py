"""RequestRecord over a fake registry: a client's rid is checked before anything is sent, a
generated one is recorded off the request's path, n > 1 is recorded, and whatever happens
after, the final state is written exactly once."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.api.request_record import RequestRecord
from meshlm.v1 import common_pb2

ROUTE = common_pb2.Route(gateway="gw:1", scheduler="s:2", detokenizer="d:3")
WHERE = {"gateway": "gw:1", "tokenizer": "t:4", "scheduler": "s:2", "detokenizer": "d:3"}


class FakeRegistry:
    """Records every call, in order; `create` refuses the rids in `taken`."""

    def __init__(self, taken: tuple[str, ...] = ()) -> None:
        self.taken = set(taken)
        self.calls: list[tuple[Any, ...]] = []

    async def create(self, rid: str, fields: dict[str, Any]) -> bool:
        self.calls.append(("create", rid, dict(fields)))
        return rid not in self.taken

    def create_later(self, rid: str, fields: dict[str, Any]) -> None:
        self.calls.append(("create_later", rid, dict(fields)))

    def update(self, rid: str, **fields: Any) -> None:
        self.calls.append(("update", rid, fields))

    def finish(self, rid: str, state: str, **fields: Any) -> None:
        self.calls.append(("finish", rid, state, fields))

    def finishes(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == "finish"]


def _record(registry: FakeRegistry, rid: str = "r1", n: int = 1) -> RequestRecord:
    return RequestRecord(registry, rid, ROUTE, "t:4", n)  # type: ignore[arg-type]


async def _opened(registry: FakeRegistry, n: int = 1) -> RequestRecord:
    record = _record(registry, n=n)
    await record.open(client_rid=False)
    return record


async def test_client_rid_is_created_and_checked() -> None:
    registry = FakeRegistry()
    await _record(registry).open(client_rid=True)
    assert registry.calls == [("create", "r1", WHERE)]


async def test_taken_client_rid_is_already_exists_and_nothing_ends() -> None:
    registry = FakeRegistry(taken=("r1",))
    record = _record(registry)
    with pytest.raises(MeshError) as caught:
        await record.open(client_rid=True)
    assert caught.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert caught.value.message == "rid: 'r1' is already in use"
    assert record.abandoned() is False  # the rid is another request's: not ours to end
    assert registry.calls == [("create", "r1", WHERE)]


async def test_generated_rid_is_recorded_later() -> None:
    registry = FakeRegistry(taken=("r1",))  # not asked: a fresh rid cannot clash
    await _opened(registry)
    assert registry.calls == [("create_later", "r1", WHERE)]


async def test_n_samples_are_recorded() -> None:
    registry = FakeRegistry()
    await _opened(registry, n=3)
    assert registry.calls == [("create_later", "r1", WHERE | {"n": "3"})]


async def test_running_updates_the_state() -> None:
    registry = FakeRegistry()
    (await _opened(registry)).running()
    assert registry.calls[1:] == [("update", "r1", {"state": "running"})]


@pytest.mark.parametrize(
    ("reason", "state"),
    [
        ("stop", "finished"),
        ("length,stop", "finished"),
        ("abort", "aborted"),
        ("stop,abort", "aborted"),  # one sample aborted: the request was
    ],
)
async def test_finished_state_follows_the_reason(reason: str, state: str) -> None:
    registry = FakeRegistry()
    (await _opened(registry)).finished(reason, completion_tokens=7)
    assert registry.finishes() == [
        ("finish", "r1", state, {"finish_reason": reason, "completion_tokens": 7})]


async def test_failed_is_an_error() -> None:
    registry = FakeRegistry()
    (await _opened(registry)).failed("deadline_exceeded")
    assert registry.finishes() == [
        ("finish", "r1", "error", {"finish_reason": "deadline_exceeded"})]


async def test_finished_then_abandoned_writes_once() -> None:
    registry = FakeRegistry()
    record = await _opened(registry)
    record.finished("stop", completion_tokens=2)
    assert record.abandoned() is False
    assert registry.finishes() == [
        ("finish", "r1", "finished", {"finish_reason": "stop", "completion_tokens": 2})]


async def test_failed_then_finished_writes_once() -> None:
    registry = FakeRegistry()
    record = await _opened(registry)
    record.failed("error")
    record.finished("stop", completion_tokens=2)
    record.failed("deadline_exceeded")
    assert record.abandoned() is False
    assert registry.finishes() == [("finish", "r1", "error", {"finish_reason": "error"})]


def test_abandoned_before_open_is_a_no_op() -> None:
    registry = FakeRegistry()
    record = _record(registry)
    assert record.abandoned() is False
    assert registry.calls == []


async def test_abandoned_after_open_aborts_once() -> None:
    registry = FakeRegistry()
    record = await _opened(registry)
    assert record.abandoned() is True
    assert record.abandoned() is False
    record.finished("stop", completion_tokens=2)
    assert registry.finishes() == [("finish", "r1", "aborted", {"finish_reason": "abort"})]
