"""The client's deadline: gRPC timeout strings, the current call's deadline, internal timeouts."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from meshlm.common import deadline
from meshlm.common.errors import MeshError


@pytest.mark.parametrize("value,seconds", [
    ("1H", 3600.0), ("2M", 120.0), ("30S", 30.0), ("500m", 0.5), ("250000u", 0.25),
    ("99999999n", 0.099999999), ("0S", 0.0),
])
def test_parse_timeout(value: str, seconds: float):
    assert deadline.parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "S", "5", "5s", "-5S", "1.5S", "123456789S", "5 S"])
def test_parse_timeout_refuses_malformed_values(value: str):
    with pytest.raises(MeshError) as err:
        deadline.parse_timeout(value)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc-timeout" in err.value.message


def test_timeout_is_bounded_by_the_current_deadline():
    async def call(at: float | None) -> float:
        deadline.set_deadline(at)  # each task has its own copy of the context
        return deadline.timeout(10.0)

    async def main() -> None:
        assert await asyncio.create_task(call(None)) == 10.0
        left = await asyncio.create_task(call(time.time() + 2.0))
        assert 1.0 < left <= 2.0
        assert await asyncio.create_task(call(time.time() + 60)) == 10.0
        with pytest.raises(MeshError) as err:
            await asyncio.create_task(call(time.time() - 1))
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert deadline.current() is None  # the tasks' deadlines did not leak out

    asyncio.run(main())


def test_wire_form():
    assert deadline.wire(None) == 0.0 and not deadline.passed(0.0)
    assert deadline.passed(100.0, now=100.0) and not deadline.passed(100.0, now=99.9)
