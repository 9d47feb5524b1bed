"""The load poller: GetLoad from each serving scheduler while the router has a choice."""

from __future__ import annotations

import asyncio
from typing import Any

from meshlm.gateway.mesh.loads import LoadPoller
from meshlm.gateway.mesh.routing import Load
from meshlm.v1 import scheduler_pb2


class FakeChannel:
    """Answers GetLoad with `running` and counts the calls."""

    def __init__(self, running: int) -> None:
        self.running = running
        self.calls = 0

    def unary_unary(self, method: str, **_: Any) -> Any:
        async def call(request: Any, timeout: float | None = None) -> Any:
            assert method.endswith("/GetLoad")
            self.calls += 1
            return scheduler_pb2.Load(running=self.running, waiting=1, max_running=8)
        return call

    def __getattr__(self, name: str) -> Any:  # the stub's other methods: never called here
        return lambda *a, **k: None


class FakePool:
    def __init__(self, channels: dict[str, FakeChannel]) -> None:
        self.channels = channels

    def get(self, address: str) -> FakeChannel:
        return self.channels[address]


def test_polls_every_scheduler_when_the_router_has_a_choice():
    pool = FakePool({"a:1": FakeChannel(3), "b:1": FakeChannel(5)})
    poller = LoadPoller(pool, lambda: ["a:1", "b:1"])  # type: ignore[arg-type]
    asyncio.run(poller.poll())
    assert poller.loads == {"a:1": Load(running=3, waiting=1, max_running=8, token_usage=0.0),
                            "b:1": Load(running=5, waiting=1, max_running=8, token_usage=0.0)}


def test_one_scheduler_is_not_polled_and_leaves_no_stale_loads():
    pool = FakePool({"a:1": FakeChannel(3), "b:1": FakeChannel(5)})
    live = ["a:1", "b:1"]
    poller = LoadPoller(pool, lambda: live)  # type: ignore[arg-type]
    asyncio.run(poller.poll())
    live.remove("b:1")  # one left: the router takes it without looking at loads
    asyncio.run(poller.poll())
    assert pool.channels["a:1"].calls == 1
    assert poller.loads == {}
