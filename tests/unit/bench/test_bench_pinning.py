"""pinning: CPU list strings, the engine/rest split, and pinning every thread of this process."""

from __future__ import annotations

import os
import threading

import pytest

from meshlm.bench import pinning


def test_describe() -> None:
    assert pinning.describe({0}) == "CPU 0"
    assert pinning.describe({1, 2, 3}) == "CPUs 1-3"


def test_split_defaults_to_the_first_allowed_cpu() -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        with pytest.raises(ValueError, match="no CPUs left"):
            pinning.CpuPlan.split()
        return
    plan = pinning.CpuPlan.split()
    assert plan.engine == {min(allowed)}
    assert plan.rest == allowed - {min(allowed)}


def test_split_refuses_cpus_outside_the_affinity() -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match="not all in"):
        pinning.CpuPlan.split(str(outside))


def test_pin_process_moves_every_thread_and_restores() -> None:
    allowed = os.sched_getaffinity(0)
    target = {min(allowed)}
    started, stop = threading.Event(), threading.Event()
    # A thread that exists before pinning is moved too, not only the calling thread.
    other = threading.Thread(target=lambda: (started.set(), stop.wait()))
    other.start()
    started.wait()
    try:
        with pinning.pin_process(target):
            assert os.sched_getaffinity(0) == target
            assert other.native_id is not None
            assert os.sched_getaffinity(other.native_id) == target
            assert pinning.thread_cpus(os.getpid()) == {pinning.format_cpus(target): len(
                pinning.thread_ids())}
        assert os.sched_getaffinity(0) == allowed
        assert os.sched_getaffinity(other.native_id) == allowed
    finally:
        stop.set()
        other.join()
