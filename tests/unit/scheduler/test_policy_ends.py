"""Policy (no torch): how requests end: aborts, prefix cache resets, finish rules, errors;
and the stats."""

from __future__ import annotations

import pytest
from policy_helpers import BS, EOS, STOP, FakeRunner, make, params, prompt, rids, runner_of, step

from meshlm.scheduler.engine.policy import BatchPlanner
from meshlm.scheduler.engine.sequence import StepOutput

# -- aborts and reset ---------------------------------------------------------------------


def test_abort_frees_blocks_before_the_next_schedule() -> None:
    s = make(num_blocks=4)
    runner = FakeRunner(s)
    s.add("a", prompt(12), params())
    runner.step()
    s.add("b", prompt(12, 40), params())  # needs the 3 blocks a holds
    assert s.blocks.num_used == 3
    assert s.abort("a")
    assert s.blocks.num_used == 3  # released by the next schedule, not by abort()
    plan = s.schedule()
    assert plan is not None and rids(plan) == ["b"]  # a's blocks went to b
    assert s.blocks.num_used == 3 and all(
        s.blocks.blocks[i].ref_count == 1 for i in plan.seqs[0].table.blocks
    )
    outs = s.postprocess(plan, runner.run(plan))
    assert [(o.rid, o.finish_reason) for o in outs if o.finished] == [("a", "abort")]
    s2 = make()
    s2.add("a", prompt(12), params())
    step(s2)
    s2.abort("a")
    assert s2.schedule() is None and s2.blocks.num_used == 0


def test_abort_waiting_is_immediate() -> None:
    s = make(max_running=1)
    s.add("a", prompt(1), params())
    s.add("b", prompt(1), params())
    assert s.abort("b") and not s.abort("b") and not s.abort("nope")
    assert s.stats()["waiting"] == 1
    _, outs = step(s)
    assert [(o.rid, o.finish_reason, o.new_token_ids) for o in outs if o.finished] == [
        ("b", "abort", [])
    ]
    assert s.stats()["aborted_total"] == 1


def test_abort_during_execute_drops_token_and_frees_once() -> None:
    s = make(max_running=2)
    s.add("a", prompt(1), params())
    s.add("b", prompt(1), params())
    step(s)
    plan = s.schedule()
    assert plan is not None and len(plan.items) == 2
    results = runner_of(s).run(plan)
    assert s.abort("a")  # while the plan "executes"
    outs = s.postprocess(plan, results)
    a = [o for o in outs if o.rid == "a"]
    assert len(a) == 1 and a[0].finish_reason == "abort" and a[0].new_token_ids == []
    assert a[0].completion_tokens == 1  # the prefill token; the decode token was dropped
    assert s.stats()["free_slots"] == 1 and s.stats()["running"] == 1
    assert s.blocks.num_used == 1
    s.add("a", prompt(1), params())  # the rid is free again
    assert s.abort_all() == 2
    outs = s.postprocess(None, None)
    assert sorted(o.rid for o in outs) == ["a", "b"]
    assert s.stats()["free_slots"] == 2 and s.blocks.num_used == 0 and not s.has_work()


def test_abort_between_steps_is_released_without_a_plan() -> None:
    s = make()
    s.add("a", prompt(1), params())
    step(s)
    s.abort("a")
    assert s.schedule() is None  # nothing left to decode
    outs = s.postprocess(None, None)
    assert [(o.rid, o.finish_reason) for o in outs] == [("a", "abort")]
    assert not s.has_work() and s.stats()["free_slots"] == 4


def test_abort_preempted_sequence() -> None:
    s = make(num_blocks=4)
    runner = FakeRunner(s)
    s.add("a", prompt(4), params(max_new_tokens=8, ignore_eos=True))
    s.add("b", prompt(12, 40), params(max_new_tokens=8))
    runner.step()
    runner.step()  # a needs a block: b preempted, back to waiting
    assert s.waiting and s.waiting[0].rid == "b"
    assert s.abort("b")
    outs = runner.drain()
    assert outs["b"][-1].finish_reason == "abort" and len(outs["b"]) == 2  # token, abort
    assert s.blocks.num_used == 0


def test_reset_prefix_cache_refused_while_live() -> None:
    s = make()
    runner = FakeRunner(s)
    s.add("a", prompt(10), params(max_new_tokens=1))
    assert not s.reset_prefix_cache()  # waiting
    runner.drain()
    s.add("b", prompt(30, 40), params(max_new_tokens=3))
    runner.step()
    assert not s.reset_prefix_cache()  # running
    assert s.stats()["kv_blocks_cached"] == 2  # a's, unreferenced
    runner.drain()
    assert s.reset_prefix_cache() and s.stats()["kv_blocks_cached"] == 0
    s.add("c", prompt(10), params(max_new_tokens=1))
    assert runner.drain()["c"][0].cached_tokens == 0


# -- finish rules and errors --------------------------------------------------------------


def finish(s: BatchPlanner, rid: str, tokens: list[int]) -> StepOutput:
    outs: list[StepOutput] = []
    for t in tokens:
        outs += [o for o in step(s, t)[1] if o.rid == rid]
        if outs and outs[-1].finished:
            return outs[-1]
    raise AssertionError(f"{rid} did not finish: {outs}")


def test_finish_on_eos_with_matched_token() -> None:
    s = make()
    s.add("r", prompt(2), params())
    out = finish(s, "r", [7, 8, EOS, 9])
    assert (out.finish_reason, out.matched_token, out.completion_tokens) == ("stop", EOS, 3)
    assert out.new_token_ids == [EOS] and s.stats()["free_slots"] == 4
    assert s.blocks.num_used == 0


def test_ignore_eos_and_stop_token_ids() -> None:
    s = make()
    s.add("r", prompt(1), params(ignore_eos=True, stop_token_ids=(STOP,)))
    out = finish(s, "r", [EOS, EOS, STOP])
    assert (out.finish_reason, out.matched_token, out.completion_tokens) == ("stop", STOP, 3)


def test_min_new_tokens_defers_stop() -> None:
    s = make()
    s.add("r", prompt(1), params(min_new_tokens=2, stop_token_ids=(STOP,)))
    out = finish(s, "r", [EOS, STOP, EOS])
    assert (out.finish_reason, out.completion_tokens) == ("stop", 3)


def test_max_new_tokens_and_max_model_len() -> None:
    s = make(max_model_len=10)
    s.add("n", prompt(1), params(max_new_tokens=3))
    s.add("m", prompt(8), params(max_new_tokens=100))
    outs = FakeRunner(s, lambda _: 7).drain()
    assert (outs["n"][-1].finish_reason, outs["n"][-1].completion_tokens) == ("length", 3)
    assert (outs["m"][-1].finish_reason, outs["m"][-1].completion_tokens) == ("length", 2)
    assert outs["n"][-1].matched_token is None


def test_unusable_requests_finish_with_error_at_once() -> None:
    s = make(max_model_len=10)
    s.add("long", prompt(10), params())
    s.add("empty", [], params())
    s.add("oov", [5, 100], params())
    s.add("neg", [5, -1], params())
    s.add("temp", prompt(1), params(temperature=-1.0))
    s.add("lp", prompt(1), params(logprob_start_len=-2))
    assert s.schedule() is None and s.has_work()
    outs = {o.rid: o for o in s.postprocess(None, None)}
    assert {r: o.finish_reason for r, o in outs.items()} == {
        "long": "error",
        "empty": "error",
        "oov": "error",
        "neg": "error",
        "temp": "error",
        "lp": "error",
    }
    assert "max_model_len" in (outs["long"].error or "")
    assert not s.has_work() and s.stats()["finished_total"] == 6
    assert s.blocks.num_used == 0


def test_duplicate_live_rid_is_refused() -> None:
    s = make()
    s.add("dup", prompt(1), params())
    with pytest.raises(ValueError, match="duplicate"):
        s.add("dup", prompt(1), params())
    step(s)
    with pytest.raises(ValueError, match="duplicate"):  # running
        s.add("dup", prompt(1), params())


def test_execute_error_finishes_plan_with_error() -> None:
    s = make()
    s.add("a", prompt(5), params())
    plan = s.schedule()
    outs = s.postprocess(plan, None, "boom")
    assert [(o.rid, o.finish_reason, o.error) for o in outs] == [("a", "error", "boom")]
    assert s.stats()["free_slots"] == 4 and s.blocks.num_used == 0


def test_stats_and_token_usage() -> None:
    s = make(num_blocks=20, max_model_len=10)
    s.add("a", prompt(4), params(max_new_tokens=3))
    step(s)
    st_ = s.stats()
    assert (st_["kv_blocks_used"], st_["kv_blocks_total"], st_["kv_block_size"]) == (1, 20, BS)
    assert st_["token_usage"] == pytest.approx(1 / 20)
    assert st_["running"] == 1 and st_["generated_tokens_total"] == 1
    step(s)  # the decode of token 5 takes a second block
    assert s.stats()["token_usage"] == pytest.approx(2 / 20)
    assert s.stats()["kv_tokens_used"] == 6  # 8 slots, 2 not yet used
