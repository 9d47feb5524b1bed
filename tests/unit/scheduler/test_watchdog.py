"""The engine watchdog: the stall and freeze rules over timestamps, and an engine loop over a real
tiny engine whose engine thread is held (a stall: its requests end UNAVAILABLE, it reports
NOT_SERVING until the step returns, then SERVING) or whose event loop alone is blocked (no
freeze: its requests go on)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from scheduler_helpers import Outputs

from meshlm.common.channels import DOWN_BOUND
from meshlm.scheduler.loop import EngineLoop
from meshlm.scheduler.tracked import Code
from meshlm.scheduler.watchdog import (
    CHECK_INTERVAL,
    DEFAULT_STALL_TIMEOUT,
    FREEZE_LIMIT,
    PauseClock,
    StallDetector,
    Verdict,
)
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2

TIMEOUT = 1.0  # the stall timeout of the scheduler under test, seconds

# -- the rule --------------------------------------------------------------------------------


def test_the_default_stall_is_reported_within_the_bound():
    assert DEFAULT_STALL_TIMEOUT + CHECK_INTERVAL < DOWN_BOUND


def test_no_step_in_flight_is_never_a_stall():
    d = StallDetector(timeout=4.0)
    assert [d.check(t) for t in (0.0, 0.25, 0.5, 0.75)] == [None] * 4


def test_a_step_past_the_timeout_is_a_stall_once_until_it_returns():
    d = StallDetector(timeout=4.0)
    d.check(0.0)
    d.step_started(0.0)
    verdicts = [d.check(t / 4) for t in range(1, 18)]  # every 0.25 s up to 4.25 s
    assert verdicts[:-1] == [None] * 16 and verdicts[-1] is Verdict.STALLED and d.stalled
    assert d.check(4.5) is None  # declared once
    assert d.step_finished(5.0) == (5.0, True) and not d.stalled
    d.step_started(5.0)
    assert d.step_finished(5.5) == (0.5, False)


def test_a_step_within_the_timeout_is_no_stall():
    d = StallDetector(timeout=4.0)
    for start in (0.0, 4.0, 8.0):
        d.check(start)
        d.step_started(start)
        assert d.check(start + 3.9) is None
        assert d.step_finished(start + 3.95) == pytest.approx((3.95, False))


def test_a_process_pause_is_a_freeze_and_restarts_the_steps_clock():
    d = StallDetector(timeout=4.0, freeze_limit=2.0)
    d.check(0.0)
    d.step_started(0.0)
    assert d.check(0.25, paused=1.9) is None  # under the limit: peers still have it
    assert d.check(10.0, paused=9.75) is Verdict.FROZEN and not d.stalled
    verdicts = [d.check(10.0 + t / 4) for t in range(1, 18)]  # the step did not run while
    assert verdicts[:-1] == [None] * 16  # frozen: its 4 s start again at 10 s
    assert verdicts[-1] is Verdict.STALLED


def test_the_pause_clock_reports_the_longest_gap_between_its_ticks_once():
    clock = PauseClock(interval=0.25, limit=2.0)
    for t in (0.0, 0.25, 0.5, 0.75):
        clock.tick(t)
    assert clock.take() == 0.0
    clock.tick(3.0)  # 2.25 s since the last tick: the process did not run
    clock.tick(3.25)
    clock.tick(9.25)
    clock.tick(9.5)
    assert clock.take() == 6.0 and clock.take() == 0.0


# -- the scheduler ---------------------------------------------------------------------------


class Health:
    """Records what the watchdog reports."""

    def __init__(self) -> None:
        self.reports: list[bool] = []
        self.changed = asyncio.Event()

    async def report(self, serving: bool) -> None:
        self.reports.append(serving)
        self.changed.set()

    async def until(self, reports: list[bool], timeout: float = 30) -> None:
        async def wait() -> None:
            while self.reports != reports:
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), timeout)


@pytest.fixture
async def scheduler(make_engine: Any, request: pytest.FixtureRequest
                    ) -> AsyncIterator[tuple[EngineLoop, Outputs, Health, ThreadPoolExecutor]]:
    """An engine loop over the tiny engine with a stall timeout of TIMEOUT, or of N with
    `@pytest.mark.parametrize("scheduler", [N], indirect=True)`."""
    engine = make_engine(max_running=8, block_size=16)
    outputs, health = Outputs(), Health()
    executor = ThreadPoolExecutor(1)  # the engine thread
    loop = EngineLoop(engine, executor, outputs, address="s",
                      stall_timeout=getattr(request, "param", TIMEOUT))
    loop.watchdog.report = health.report
    loop.watchdog.interval = 0.05
    task = asyncio.create_task(loop.run())
    yield loop, outputs, health, executor
    task.cancel()
    loop.close()


def _request(rid: str, max_new_tokens: int) -> scheduler_pb2.TokenizedRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1,
                                         repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                                         ignore_eos=True, logprob_start_len=-1)
    meta = common_pb2.RequestMeta(rid=rid, sampling=sampling,
                                  route=common_pb2.Route(detokenizer="d"))
    return scheduler_pb2.TokenizedRequest(meta=meta,
                                          input_ids=[(7 * i + 3) % 500 for i in range(20)])


def _submit(loop: EngineLoop, *reqs: scheduler_pb2.TokenizedRequest) -> None:
    loop.submit(scheduler_pb2.TokenizedBatch(requests=reqs))


def _final(outputs: Outputs, rid: str) -> detokenizer_pb2.TokenOutput | None:
    return next((o for o in outputs.of(rid) if o.finished), None)


async def test_a_stalled_engine_is_not_serving_and_its_requests_end_unavailable(scheduler):
    loop, outputs, health, engine_thread = scheduler
    _submit(loop, _request("long", 200))
    await outputs.until(lambda: len(outputs.of("long")) >= 2)
    held = threading.Event()
    engine_thread.submit(held.wait, 60)  # the engine thread is stuck: the next step cannot run
    try:
        await health.until([False])
        assert loop.watchdog.stalled
        # A request already on its way when the scheduler went NOT_SERVING is refused at once.
        _submit(loop, _request("late", 4))
        late = _final(outputs, "late")
        assert late is not None and late.error.code == Code.UNAVAILABLE
        assert "stalled" in late.error.message and late.HasField("header")
        assert _final(outputs, "long") is None  # its end comes with the stuck step
    finally:
        held.set()
    await health.until([False, True])
    await outputs.until(lambda: _final(outputs, "long") is not None)
    final = _final(outputs, "long")
    assert final is not None and final.finish_reason == "error"
    assert final.error.code == Code.UNAVAILABLE
    assert loop.engine.stats()["running"] == 0 and not loop.tracked
    # Serving again: a new request runs to its end.
    _submit(loop, _request("after", 4))
    await outputs.until(lambda: _final(outputs, "after") is not None)
    assert _final(outputs, "after").finish_reason == "length"  # type: ignore[union-attr]


@pytest.mark.parametrize("scheduler", [60.0], indirect=True)
async def test_a_blocked_event_loop_is_no_freeze(scheduler):
    """The process runs (it answers its peers' pings), only its loop does not: its requests
    are kept. A process that does not run at all (SIGSTOP) forfeits them: tests/e2e/test_hung.py."""
    loop, outputs, health, _ = scheduler
    _submit(loop, _request("long", 200))
    await outputs.until(lambda: len(outputs.of("long")) >= 2)
    time.sleep(FREEZE_LIMIT * 1.5)  # the fault: the event loop does not run
    await outputs.until(lambda: _final(outputs, "long") is not None)
    assert _final(outputs, "long").finish_reason == "length"  # type: ignore[union-attr]
    assert health.reports == []


async def test_steps_within_the_timeout_forfeit_nothing(scheduler):
    loop, outputs, health, _ = scheduler
    _submit(loop, *(_request(f"r{i}", 24) for i in range(4)))
    await outputs.until(lambda: all(_final(outputs, f"r{i}") for i in range(4)))
    assert {_final(outputs, f"r{i}").finish_reason for i in range(4)} == {"length"}  # type: ignore[union-attr]
    assert health.reports == []
