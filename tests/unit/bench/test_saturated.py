"""saturated: the saturation phase's throughput while every slot is busy, without its ramp and
its drain."""

from __future__ import annotations

from meshlm.bench.mesh_report import Result, fill_line, saturated_line
from meshlm.bench.saturated import Arrivals


def test_the_window_runs_from_the_last_slot_filled_to_the_last_request_started() -> None:
    arrivals = Arrivals()
    for when in (0.0, 0.1, 0.2, 1.0, 2.0):  # two slots: the second is filled at 0.1
        arrivals.first(when)
    for when, tokens in ((0.05, 5), (0.1, 7), (0.5, 11), (2.0, 13), (2.5, 17)):
        arrivals.add(when, tokens)
    # Tokens after 0.1 up to 2.0: those of the ramp and the drain are left out.
    assert arrivals.window(2) == (11 + 13, 2.0 - 0.1)


def test_no_window_when_no_request_waited_for_a_slot() -> None:
    arrivals = Arrivals()
    arrivals.first(0.0)
    arrivals.first(0.1)
    arrivals.add(0.2, 3)
    assert arrivals.window(2) == (0, 0.0)


def test_the_line_gives_each_paths_rate_its_ratio_and_its_share_of_the_tokens() -> None:
    engine = Result("in-process", [0.01], tokens=1000, seconds=1.0, saturated=(800, 0.5))
    mesh = Result("mesh gRPC", [0.01], tokens=1000, seconds=1.2, saturated=(700, 0.5))
    assert saturated_line([engine, mesh], 64) == (
        "throughput while every slot was busy (from the 64th request's first token to the "
        "last request's): in-process 1600.0 tok/s (80% of its tokens; 400.0 outside it), "
        "mesh gRPC 1400.0 (0.88x; 70%; outside it 1.07x)")
    unmeasured = Result("mesh HTTP", [0.01], tokens=10, seconds=1.0)
    assert saturated_line([engine, unmeasured], 64) == (
        "throughput while every slot was busy: no request waited for a slot")


def test_merged_rounds_add_their_windows() -> None:
    rounds = [Result("mesh gRPC", [0.01], tokens=10, seconds=1.0, saturated=(8, 0.5)),
              Result("mesh gRPC", [0.01], tokens=20, seconds=2.0, saturated=(12, 1.5))]
    assert Result.merged(rounds).saturated == (20, 2.0)


def test_filling_runs_from_the_start_to_the_last_slots_first_token() -> None:
    arrivals = Arrivals()
    for when in (10.3, 10.1, 10.2, 11.0):  # out of order, as concurrent streams see them
        arrivals.first(when)
    assert abs(arrivals.fill_seconds(3, 10.0) - 0.3) < 1e-9
    assert abs(arrivals.fill_seconds(8, 10.0) - 1.0) < 1e-9  # fewer requests than slots
    assert Arrivals().fill_seconds(3, 10.0) == 0.0


def test_the_fill_line_gives_each_paths_mean_over_its_rounds_and_its_share() -> None:
    engine = Result("in-process", [0.01], tokens=10, seconds=2.0, fills=(0.002,))
    mesh = Result.merged([Result("mesh gRPC", [0.01], tokens=5, seconds=1.0, fills=(0.05,)),
                          Result("mesh gRPC", [0.01], tokens=5, seconds=1.0, fills=(0.07,))])
    assert fill_line([engine, mesh], 64) == (
        "time to fill the 64 slots (the phase's start to the 64th request's first token), "
        "mean of the rounds: in-process 2.0 ms (0.1% of the phase), mesh gRPC 60.0 ms "
        "(6.0% of the phase)")
    assert fill_line([engine, Result("mesh HTTP", [0.01], tokens=1, seconds=1.0)], 64) == (
        "time to fill every slot: not measured")
