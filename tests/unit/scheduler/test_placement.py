"""Where the engine's steps run (placement.py): the choice at start-up, and the per-step rule."""

from __future__ import annotations

import pytest

from meshlm.scheduler.placement import MAX_LOOP_STEP_S, StepPlacement, check_mode, choose


@pytest.mark.parametrize(("device", "cpus", "threads", "on_loop"), [
    ("cpu", 1.0, 1, True),  # one CPU: the loop and a thread would only take turns
    ("cpu", 0.5, 1, True),  # a cgroup quota under one core
    ("cpu", 2.0, 1, False),  # the loop sends while the engine computes
    ("cpu", 1.5, 1, False),
    ("cpu", 1.0, 2, False),  # torch's own pool on the loop would be a second one
    ("cuda", 1.0, 1, False),  # the GPU computes while the loop runs
])
def test_auto_runs_steps_on_the_loop_only_on_one_cpu_without_a_gpu(
        device: str, cpus: float, threads: int, on_loop: bool) -> None:
    chosen, why = choose("auto", device, cpus, threads)
    assert chosen is on_loop and why


def test_a_mode_named_is_obeyed_and_an_unknown_one_refused() -> None:
    assert choose("loop", "cuda", 8, 8) == (True, "--engine-steps loop")
    assert choose("thread", "cpu", 1, 1) == (False, "--engine-steps thread")
    with pytest.raises(ValueError, match="auto, thread, loop; got 'fast'"):
        check_mode("fast")


def test_a_step_runs_on_the_loop_once_timed_and_only_within_the_budget() -> None:
    placement = StepPlacement(allowed=True)
    assert not placement.on_loop(1)  # no step timed yet
    placement.observe(0.004, 64)  # 62.5 µs a token
    assert placement.on_loop(64)
    assert placement.on_loop(int(MAX_LOOP_STEP_S / 62.5e-6))
    assert not placement.on_loop(int(MAX_LOOP_STEP_S / 62.5e-6) + 1)
    assert not StepPlacement(allowed=False).on_loop(1)


def test_the_cost_follows_recent_steps() -> None:
    placement = StepPlacement(allowed=True)
    placement.observe(0.001, 10)
    assert placement.seconds_per_token == pytest.approx(1e-4)
    for _ in range(20):
        placement.observe(0.01, 10)  # the steps became ten times as slow
    assert placement.seconds_per_token == pytest.approx(1e-3, rel=0.01)
    assert not placement.on_loop(int(MAX_LOOP_STEP_S / 1e-4))


def test_a_recording_torch_trace_keeps_steps_on_the_engine_thread() -> None:
    recording = [True]
    placement = StepPlacement(allowed=True, held=lambda: recording[0])
    placement.observe(0.001, 10)
    assert not placement.on_loop(1)
    recording[0] = False
    assert placement.on_loop(1)
