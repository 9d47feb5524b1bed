"""Pause and resume (SGLang's pause_generation / continue_generation): the policy's three modes
on the fake runner, the engine's outputs across a retract on a real tiny model, the scheduler
service's Pause/Continue between engine steps, and the policy property test with pauses mixed
into random traffic."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from policy_helpers import FakeRunner, make, params, prompt, shape, tokens_of
from scheduler_helpers import Outputs, run_all, sample_prompt, submit, tokenized
from scheduler_helpers import tokens_of as engine_tokens
from test_policy_machine import PolicyMachine

from meshlm.common.errors import MeshError
from meshlm.scheduler.engine.engine import Engine, SamplingParams, StepOutput
from meshlm.scheduler.engine.policy import PAUSE_MODES, BatchPlanner
from meshlm.scheduler.server import SchedulerServicer
from meshlm.v1 import scheduler_pb2

EngineFactory = Callable[..., Engine]  # the make_engine fixture (conftest.py)


def unpaused(rid: str, ids: list[int], max_new_tokens: int) -> list[int]:
    """The tokens the fake model gives `ids` when nothing interrupts it."""
    s = make()
    s.add(rid, ids, params(max_new_tokens=max_new_tokens, ignore_eos=True))
    return tokens_of(FakeRunner(s).drain()[rid])


def running_three(**kw: object) -> tuple[BatchPlanner, FakeRunner]:
    """a and b decoding, c half-way through its (chunked) prompt, d waiting for a row."""
    s = make(max_running=3, max_batched_tokens=12, **kw)
    runner = FakeRunner(s)
    for rid, first in (("a", 10), ("b", 30)):
        s.add(rid, prompt(5, first), params(max_new_tokens=8, ignore_eos=True))
    runner.step()
    runner.step()
    s.add("c", prompt(20, 50), params(max_new_tokens=8, ignore_eos=True))
    s.add("d", prompt(3, 70), params(max_new_tokens=8, ignore_eos=True))
    runner.step()  # a, b decode; c computes its first 10 prompt tokens
    assert [q.rid for q in s.running] == ["a", "b", "c"] and [q.rid for q in s.waiting] == ["d"]
    assert 0 < s.running[2].num_computed_tokens < 20
    return s, runner


def expected() -> dict[str, list[int]]:
    return {rid: unpaused(rid, prompt(n, first), 8)
            for rid, n, first in (("a", 5, 10), ("b", 5, 30), ("c", 20, 50), ("d", 3, 70))}


def test_in_place_keeps_everything_and_plans_nothing_until_resumed() -> None:
    s, runner = running_three()
    used, computed = s.blocks.num_used, [q.num_computed_tokens for q in s.running]
    assert s.pause("in_place") == 3 and s.paused == "in_place"
    assert s.schedule() is None and not s.has_work()
    s.add("e", prompt(2, 80), params(max_new_tokens=8, ignore_eos=True))  # queues, no error
    assert s.schedule() is None and s.postprocess(None, None) == []
    assert s.blocks.num_used == used and [q.num_computed_tokens for q in s.running] == computed
    assert s.stats()["paused"] == "in_place" and s.stats()["waiting"] == 2
    assert s.resume() and s.paused is None and s.has_work()
    plan, _ = runner.step()  # each picks up where it was: no recompute
    assert shape(plan)[:3] == [("a", 7, 1, True), ("b", 7, 1, True), ("c", 10, 10, True)]
    outs = runner.drain()
    want = expected()
    for rid in "abcd":
        assert tokens_of(outs[rid]) == want[rid], rid
    assert len(tokens_of(outs["e"])) == 8 and s.stats()["retracted_total"] == 0


def test_retract_requeues_running_in_order_frees_blocks_and_loses_no_token() -> None:
    s, runner = running_three()
    before = {q.rid: q.num_tokens for q in s.running}
    assert s.pause("retract") == 3
    assert not s.running and [q.rid for q in s.waiting] == ["a", "b", "c", "d"]
    assert s.blocks.num_used == 0 and s.rows.num_free == s.max_running
    assert all(q.num_computed_tokens == 0 and not q.table.blocks for q in s.waiting)
    assert {q.rid: q.num_tokens for q in s.waiting if q.rid in before} == before  # tokens kept
    st_ = s.stats()
    assert st_["retracted_total"] == 3 and st_["preempted_total"] == 0
    assert st_["kv_blocks_cached"] > 0  # their full blocks stay in the prefix cache
    assert s.schedule() is None and not s.has_work()
    assert s.resume()
    plan, _ = runner.step()
    # Recomputed from their cached prefixes (full blocks of 4), each re-admission rebuilding
    # its sampling row.
    assert shape(plan)[:2] == [("a", 4, 4, True), ("b", 4, 4, True)]
    assert plan is not None and all(item.reset_row for item in plan.items)
    outs = runner.drain()
    want = expected()
    for rid in "abcd":
        assert tokens_of(outs[rid]) == want[rid], rid
        assert [o.completion_tokens for o in outs[rid]] == list(range(1, 9))
    assert s.blocks.num_used == 0


def test_abort_mode_ends_every_request_and_later_ones_wait_for_resume() -> None:
    s, runner = running_three()
    assert s.pause("abort") == 4
    s.add("e", prompt(2, 80), params(max_new_tokens=3, ignore_eos=True))
    assert s.has_work()  # the aborted running requests are still to be released
    assert s.schedule() is None
    outs = s.postprocess(None, None)
    assert sorted((o.rid, o.finish_reason) for o in outs) == [
        (rid, "abort") for rid in "abcd"]
    assert all(not o.new_token_ids for o in outs)
    assert s.blocks.num_used == 0 and not s.running and [q.rid for q in s.waiting] == ["e"]
    assert not s.has_work() and s.stats()["aborted_total"] == 4
    assert s.resume()
    assert tokens_of(runner.drain()["e"]) == unpaused("e", prompt(2, 80), 3)


def test_abort_while_paused_in_place_is_released_without_a_step() -> None:
    s, _ = running_three()
    s.pause("in_place")
    assert s.abort("b") and s.has_work()
    assert s.schedule() is None
    assert [(o.rid, o.finish_reason) for o in s.postprocess(None, None)] == [("b", "abort")]
    assert [q.rid for q in s.running] == ["a", "c"] and not s.has_work()


def test_pausing_twice_applies_the_new_mode_and_resuming_twice_is_harmless() -> None:
    s, runner = running_three()
    assert not s.resume()  # not paused: nothing to do
    assert s.pause("in_place") == 3
    assert s.pause("in_place") == 3 and s.paused == "in_place"
    assert s.pause("retract") == 3 and not s.running and s.paused == "retract"
    assert s.pause("retract") == 0
    with pytest.raises(ValueError, match="in_place"):
        s.pause("sleep")
    assert s.paused == "retract"  # a refused mode changes nothing
    assert s.resume() and not s.resume()
    outs = runner.drain()
    want = expected()
    assert {rid: tokens_of(outs[rid]) for rid in "abcd"} == want


def test_flush_is_allowed_after_retract_but_not_while_kv_is_held() -> None:
    s, runner = running_three()
    s.pause("in_place")
    assert not s.reset_prefix_cache()  # running requests hold blocks
    s.pause("retract")
    assert s.reset_prefix_cache() and s.stats()["kv_blocks_cached"] == 0
    s.resume()
    assert not s.reset_prefix_cache()  # live and not paused
    outs = runner.drain()
    assert all(o[-1].cached_tokens == 0 for o in outs.values())  # first admissions' figures
    want = expected()
    assert {rid: tokens_of(outs[rid]) for rid in "abcd"} == want


def test_held_followers_wait_out_a_retracted_leader() -> None:
    s = make(max_batched_tokens=6)
    runner = FakeRunner(s)
    s.add("lead", prompt(12), params(max_new_tokens=3, ignore_eos=True))
    s.add("follow", prompt(12), params(max_new_tokens=3, ignore_eos=True), after="lead")
    runner.step()  # half the leader's prompt
    assert s.pause("retract") == 1 and [q.rid for q in s.waiting] == ["lead"]
    s.resume()
    outs = runner.drain()
    assert tokens_of(outs["follow"]) == tokens_of(outs["lead"]) == unpaused("x", prompt(12), 3)
    assert outs["follow"][-1].cached_tokens == 8  # still shares the leader's prompt blocks


# -- the engine: real model, real sampling -------------------------------------------------


def test_engine_retract_keeps_greedy_seeded_and_penalised_outputs(
    make_engine: EngineFactory,
) -> None:
    reqs = {
        "greedy": ([5, 6, 7, 8, 9] * 4, SamplingParams(temperature=0.0, max_new_tokens=12,
                                                        ignore_eos=True)),
        "seeded": ([40, 41, 42] * 3, SamplingParams(temperature=0.9, top_p=0.9, seed=11,
                                                     max_new_tokens=12, ignore_eos=True)),
        "penalised": ([70, 71] * 9, SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                                   frequency_penalty=0.5, max_new_tokens=12,
                                                   ignore_eos=True)),
    }

    def run(pause_at: int | None) -> dict[str, list[StepOutput]]:
        engine = make_engine(max_running=4, block_size=4, max_batched_tokens=32)
        for rid, (ids, p) in reqs.items():
            engine.add_request(rid, ids, p)
        outs: dict[str, list[StepOutput]] = {}
        for step in range(1000):
            if step == pause_at:
                assert engine.pause("retract") == 3
                assert engine.stats()["kv_blocks_used"] == 0
                assert not engine.has_work() and engine.step() == []
                assert engine.resume()
            if not engine.has_work():
                return outs
            for o in engine.step():
                outs.setdefault(o.rid, []).append(o)
        raise AssertionError("engine did not go idle")

    plain, paused = run(None), run(5)
    for rid in reqs:
        assert engine_tokens(paused[rid]) == engine_tokens(plain[rid]), rid
        assert len(engine_tokens(paused[rid])) == 12


def test_engine_in_place_pause_holds_new_requests(make_engine: EngineFactory) -> None:
    engine = make_engine(max_running=4)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=4))
    engine.step()
    assert engine.pause("in_place") == 1 and engine.paused == "in_place"
    engine.add_request("b", [8, 9], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert engine.step() == [] and engine.stats()["waiting"] == 1
    assert engine.resume() and engine.paused is None
    outs = run_all(engine)
    assert sorted(outs) == ["a", "b"] and all(o[-1].finished for o in outs.values())


# -- the scheduler service: Pause / Continue between engine steps -------------------------


async def _tokens_seen(outputs: Outputs, rid: str, n: int) -> None:
    while sum(len(o.token_ids) for o in outputs.items if o.rid == rid) < n:
        outputs.news.clear()
        await asyncio.wait_for(outputs.news.wait(), 30)


async def test_service_retract_then_continue_matches_an_unpaused_run(
    served: tuple[SchedulerServicer, Outputs],
) -> None:
    servicer, outputs = served
    long = tokenized("long", sample_prompt(30))
    long.meta.sampling.max_new_tokens = 40
    await submit(servicer, long)
    await _tokens_seen(outputs, "long", 3)
    pause = await servicer.Pause(scheduler_pb2.PauseRequest(mode="retract"), None)
    assert not pause.already_paused and pause.requests == 1
    stats = servicer.loop.engine.stats()
    assert stats["paused"] == "retract" and stats["running"] == 0 and stats["waiting"] == 1
    assert stats["kv_blocks_used"] == 0
    again = await servicer.Pause(scheduler_pb2.PauseRequest(mode="retract"), None)
    assert again.already_paused and again.requests == 0
    late = tokenized("late", sample_prompt(5))
    await submit(servicer, late)  # queues while paused
    assert servicer.loop.engine.stats()["waiting"] == 2
    assert (await servicer.Continue(scheduler_pb2.ContinueRequest(), None)).was_paused
    assert not (await servicer.Continue(scheduler_pb2.ContinueRequest(), None)).was_paused
    outs = await outputs.finished({"long", "late"})
    paused_tokens = [t for o in outs["long"] for t in o.token_ids]
    assert outs["long"][-1].finish_reason == "length" and len(paused_tokens) == 40
    plain = tokenized("plain", sample_prompt(30))
    plain.meta.sampling.max_new_tokens = 40
    await submit(servicer, plain)
    plain_outs = await outputs.finished({"plain"})
    assert [t for o in plain_outs["plain"] for t in o.token_ids] == paused_tokens


async def test_service_abort_mode_ends_requests_and_refuses_unknown_modes(
    served: tuple[SchedulerServicer, Outputs],
) -> None:
    servicer, outputs = served
    busy = tokenized("busy", sample_prompt(20))
    busy.meta.sampling.max_new_tokens = 200
    await submit(servicer, busy)
    await _tokens_seen(outputs, "busy", 1)
    with pytest.raises(MeshError, match="mode: must be one of abort, retract, in_place"):
        await servicer.Pause(scheduler_pb2.PauseRequest(mode="later"), None)
    assert servicer.loop.engine.paused is None
    reply = await servicer.Pause(scheduler_pb2.PauseRequest(mode="abort"), None)
    assert reply.requests == 1
    outs = await outputs.finished({"busy"})
    assert outs["busy"][-1].finish_reason == "abort"
    await submit(servicer, tokenized("after", sample_prompt(4)))
    assert servicer.loop.engine.stats()["waiting"] == 1  # paused: it waits
    await servicer.Continue(scheduler_pb2.ContinueRequest(), None)
    assert (await outputs.finished({"after"}))["after"][-1].finish_reason == "length"


# -- property test ------------------------------------------------------------------------


class PauseMachine(PolicyMachine):
    """PolicyMachine's random traffic with pauses (every mode, also twice) and resumes mixed
    in: while paused nothing is planned, a retract frees every block, and every request still
    ends exactly once, its outputs being exactly its tokens."""

    @precondition(lambda self: not self.scheduled)  # never while a plan executes
    @rule(mode=st.sampled_from(PAUSE_MODES))
    def pause(self, mode: str) -> None:
        s = self.s
        running = sum(not q.aborted for q in s.running)
        live = {q.rid for q in s.waiting} | {q.rid for q in s.running if not q.aborted}
        n = s.pause(mode)
        if mode == "abort":
            assert n == len(live)
            self.aborted |= live
        else:
            assert n == running
        if mode == "retract":
            assert not s.running and s.blocks.num_used == 0

    @precondition(lambda self: not self.scheduled and self.s.paused is not None)
    @rule()
    def step_while_paused(self) -> None:
        assert self.s.schedule() is None
        self.collect(self.s.postprocess(None, None))

    @rule()
    def resume(self) -> None:
        was = self.s.paused is not None
        assert self.s.resume() == was

    @rule()
    def reset_prefix_cache(self) -> None:
        s = self.s
        live = bool(s.waiting or s.running)
        done = s.reset_prefix_cache()
        assert done == (not live or (s.paused is not None and not s.running))
        if done:
            assert s.blocks.num_cached == 0 and s.blocks.num_used == 0

    def teardown(self) -> None:
        self.s.resume()
        super().teardown()


TestPauseMachine = PauseMachine.TestCase
TestPauseMachine.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPauseMachine.pytestmark = [pytest.mark.timeout(900)]  # type: ignore[attr-defined]
