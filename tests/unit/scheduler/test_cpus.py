"""The engine's threads and cores: CPU lists, the share rule, the cgroup quota, the start-up
measurement and pinning the engine thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from meshlm.scheduler.cpus import (
    EngineCpus,
    auto_threads,
    choose_threads,
    measure_engine_us,
    usable_cpus,
)
from meshlm.scheduler.engine.engine import Engine


@pytest.mark.parametrize(("cores", "engine_us", "mesh_us", "threads"), [
    (2, 200, 250, 1),  # the tiny model: the mesh needs about a core
    (2, 1800, 250, 2),  # a 25M-parameter model: the engine's work dominates
    (2, 734, 250, 2),  # the bench model on meshlm's own matmuls: a share of 1.49 cores
    (2, 290, 250, 1),  # a share of 1.07: within the calibration's margin
    (2, 342, 250, 2),  # the bench model on bfloat16 weights, 1.16: two threads gave 1.2x
    (16, 1800, 250, 14),
    (1, 5000, 0, 1),
    (2, 10, 10_000, 1),  # never below one thread
    (2.5, 1000, 0, 2),  # a fractional quota rounds down to whole cores
])
def test_the_engine_takes_its_share_of_the_cores(cores: float, engine_us: float,
                                                 mesh_us: float, threads: int) -> None:
    assert choose_threads(cores, engine_us, mesh_us) == threads


def test_a_cgroup_quota_lowers_the_usable_cores(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    quota.write_text("50000 100000\n")
    assert usable_cpus(quota) == min(affinity, 0.5)
    quota.write_text("max 100000\n")
    assert usable_cpus(quota) == affinity
    assert usable_cpus(tmp_path / "missing") == affinity


def test_measuring_the_engine_leaves_it_idle(gqa_engine: Engine) -> None:
    before = gqa_engine.stats()
    us = measure_engine_us(gqa_engine, rows=4, steps=2)
    assert us > 0
    assert not gqa_engine.has_work()
    after = gqa_engine.stats()
    assert after["running"] == after["waiting"] == 0
    assert after["free_slots"] == before["free_slots"]


def test_auto_threads_sets_what_it_chooses(gqa_engine: Engine) -> None:
    threads = torch.get_num_threads()
    try:
        # No mesh beside it: the engine takes every core it counts on.
        assert auto_threads(gqa_engine, mesh_us=0.0, cores=2) == 2
        assert torch.get_num_threads() == 2
        # A mesh that costs far more than the engine: one thread.
        assert auto_threads(gqa_engine, mesh_us=1e9, cores=2) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_pinning_gives_one_engine_thread_per_cpu() -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    plan = EngineCpus.pinned(allowed)
    assert (plan.threads, plan.cpus) == (len(allowed), allowed)
    assert EngineCpus.pinned(allowed, num_threads=3).threads == 3


def test_cpus_the_kernel_refuses_are_a_clear_error() -> None:
    absent = frozenset({os.cpu_count() or 1, 4096})  # no such CPU on this machine
    with pytest.raises(ValueError, match=r"cannot run on CPUs .*\(--engine-cpus\)"):
        EngineCpus.pinned(absent).pin_process()
