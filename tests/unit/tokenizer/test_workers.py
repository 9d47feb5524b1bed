"""The tokenizer's worker threads: only tiny work runs on the event loop, and a big input has a
thread of its own, so it holds up no small one."""

from __future__ import annotations

import asyncio
import threading

from meshlm.tokenizer.workers import Workers


async def test_work_runs_off_the_event_loop_unless_tiny() -> None:
    workers = Workers(big_chars=100, inline_chars=5)
    try:
        loop_thread = threading.current_thread().name
        tiny = await workers.run(4, lambda: threading.current_thread().name)
        small = await workers.run(10, lambda: threading.current_thread().name)
        big = await workers.run(100, lambda: threading.current_thread().name)
        assert tiny == loop_thread  # less work than handing it to a thread and back
        assert small != loop_thread and small.startswith("tokenize_")
        assert big.startswith("tokenize-big")
    finally:
        workers.close()


async def test_a_big_job_holds_up_no_small_one() -> None:
    workers = Workers(big_chars=100)
    release = threading.Event()
    try:
        big = asyncio.ensure_future(workers.run(10**7, release.wait, 30))
        for _ in range(5):  # more small jobs than small threads, one after another
            assert await asyncio.wait_for(workers.run(10, lambda: 42), 5) == 42
        assert not big.done()
        release.set()
        assert await asyncio.wait_for(big, 5) is True
    finally:
        release.set()
        workers.close()


async def test_failures_reach_the_caller() -> None:
    workers = Workers(big_chars=100)

    def fail() -> None:
        raise ValueError("bad template")

    try:
        for chars in (1, 50, 1000):
            try:
                await workers.run(chars, fail)
            except ValueError as e:
                assert str(e) == "bad template"
            else:
                raise AssertionError("no failure")
    finally:
        workers.close()
