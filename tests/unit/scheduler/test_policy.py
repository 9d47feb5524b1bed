"""Policy (no torch): admission, budgets, slots, finish rules, aborts, and a property test."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meshlm.scheduler.engine.policy import Scheduler
from meshlm.scheduler.engine.sequence import Plan, SamplingParams, StepOutput
from meshlm.scheduler.engine.slot_table import SlotTable

EOS = 2


def make(**kw: object) -> Scheduler:
    args: dict[str, object] = {
        "max_running": 4,
        "max_model_len": 64,
        "max_prefill_tokens": 100,
        "eos_token_ids": {EOS},
        "vocab_size": 100,
    }
    args.update(kw)
    return Scheduler(**args)  # type: ignore[arg-type]


def params(**kw: object) -> SamplingParams:
    return SamplingParams(**kw)  # type: ignore[arg-type]


def step(s: Scheduler, token: int = 7) -> tuple[Plan | None, list[StepOutput]]:
    plan = s.schedule()
    tokens = [token] * len(plan.seqs) if plan else None
    return plan, s.postprocess(plan, tokens)


def test_policy_does_not_import_torch() -> None:
    code = (
        "import sys, meshlm.scheduler.engine.policy, meshlm.scheduler.engine.sequence; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_slot_table_verb_pair() -> None:
    table = SlotTable(2)
    a, b = table.allocate(), table.allocate()
    assert (a, b) == (0, 1) and not table.can_allocate()
    with pytest.raises(RuntimeError):
        table.allocate()
    table.free(a)
    with pytest.raises(RuntimeError):
        table.free(a)
    assert table.allocate() == 0 and table.num_used == 2


def test_prefill_budget_and_fifo() -> None:
    s = make(max_prefill_tokens=100)
    for rid, n in (("a", 60), ("b", 30), ("c", 20), ("d", 5)):
        s.add(rid, [5] * n, params())
    plan = s.schedule()
    assert plan is not None and plan.is_prefill
    assert [q.rid for q in plan.seqs] == ["a", "b"]  # c would exceed 100; FIFO, no skipping
    assert plan.num_tokens == 90


def test_prompt_longer_than_budget_runs_alone() -> None:
    s = make(max_prefill_tokens=10)
    s.add("long", [5] * 50, params())
    s.add("short", [5] * 2, params())
    plan = s.schedule()
    assert plan is not None and [q.rid for q in plan.seqs] == ["long"]


def test_slots_limit_admission_and_free_on_finish() -> None:
    s = make(max_running=2)
    for i in range(3):
        s.add(f"r{i}", [5, 6], params(max_new_tokens=2))
    plan, outs = step(s)
    assert plan is not None and plan.is_prefill and len(plan.seqs) == 2
    assert s.stats()["free_slots"] == 0 and s.stats()["waiting"] == 1
    plan, outs = step(s)  # no slot for r2: decode, and both finish (max_new_tokens=2)
    assert plan is not None and not plan.is_prefill
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert s.stats()["free_slots"] == 2
    plan, outs = step(s)
    assert plan is not None and [q.rid for q in plan.seqs] == ["r2"] and plan.seqs[0].slot == 0


def test_decode_not_starved_by_arrivals() -> None:
    s = make(max_running=8)
    s.add("a", [5], params(max_new_tokens=50))
    kinds = []
    for i in range(6):
        s.add(f"n{i}", [5], params(max_new_tokens=50))
        plan, _ = step(s)
        assert plan is not None
        kinds.append(plan.is_prefill)
    assert kinds == [True, False, True, False, True, False]


def test_decode_plan_holds_every_running_sequence() -> None:
    s = make()
    for i in range(3):
        s.add(f"r{i}", [5] * (i + 1), params())
    step(s)
    plan = s.schedule()
    assert plan is not None and not plan.is_prefill and len(plan.seqs) == 3
    assert plan.num_tokens == 3


def finish(s: Scheduler, rid: str, tokens: list[int]) -> StepOutput:
    outs: list[StepOutput] = []
    for t in tokens:
        outs += [o for o in step(s, t)[1] if o.rid == rid]
        if outs and outs[-1].finished:
            return outs[-1]
    raise AssertionError(f"{rid} did not finish: {outs}")


def test_finish_on_eos_with_matched_token() -> None:
    s = make()
    s.add("r", [5, 6], params())
    out = finish(s, "r", [7, 8, EOS, 9])
    assert (out.finish_reason, out.matched_token, out.completion_tokens) == ("stop", EOS, 3)
    assert out.new_token_ids == [EOS] and s.stats()["free_slots"] == 4


def test_ignore_eos_and_stop_token_ids() -> None:
    s = make()
    s.add("r", [5], params(ignore_eos=True, stop_token_ids=(9,)))
    out = finish(s, "r", [EOS, EOS, 9])
    assert (out.finish_reason, out.matched_token, out.completion_tokens) == ("stop", 9, 3)


def test_min_new_tokens_defers_stop() -> None:
    s = make()
    s.add("r", [5], params(min_new_tokens=2, stop_token_ids=(9,)))
    out = finish(s, "r", [EOS, 9, EOS])
    assert (out.finish_reason, out.completion_tokens) == ("stop", 3)


def test_max_new_tokens_and_max_model_len() -> None:
    s = make(max_model_len=10)
    s.add("n", [5], params(max_new_tokens=3))
    s.add("m", [5] * 8, params(max_new_tokens=100))
    outs: dict[str, StepOutput] = {}
    while s.has_work():
        for o in step(s)[1]:
            outs[o.rid] = o
    assert (outs["n"].finish_reason, outs["n"].completion_tokens) == ("length", 3)
    assert (outs["m"].finish_reason, outs["m"].completion_tokens) == ("length", 2)
    assert outs["n"].matched_token is None


def test_unusable_requests_finish_with_error_at_once() -> None:
    s = make(max_model_len=10)
    s.add("long", [5] * 10, params())
    s.add("empty", [], params())
    s.add("oov", [5, 100], params())
    s.add("temp", [5], params(temperature=-1.0))
    s.add("zero", [5], params(max_new_tokens=0))
    assert s.schedule() is None and s.has_work()
    outs = {o.rid: o for o in s.postprocess(None, None)}
    assert {r: o.finish_reason for r, o in outs.items()} == {
        "long": "error",
        "empty": "error",
        "oov": "error",
        "temp": "error",
        "zero": "length",
    }
    assert "max_model_len" in (outs["long"].error or "")
    assert not s.has_work() and s.stats()["finished_total"] == 5
    with pytest.raises(ValueError):
        s.add("dup", [5], params())
        s.add("dup", [5], params())


def test_abort_waiting_is_immediate() -> None:
    s = make(max_running=1)
    s.add("a", [5], params())
    s.add("b", [5], params())
    assert s.abort("b") and not s.abort("b") and not s.abort("nope")
    assert s.stats()["waiting"] == 1
    plan, outs = step(s)
    assert [(o.rid, o.finish_reason, o.new_token_ids) for o in outs if o.finished] == [
        ("b", "abort", [])
    ]
    assert s.stats()["aborted_total"] == 1


def test_abort_during_execute_drops_token_and_frees_once() -> None:
    s = make(max_running=2)
    s.add("a", [5], params())
    s.add("b", [5], params())
    step(s)
    plan = s.schedule()
    assert plan is not None and len(plan.seqs) == 2
    assert s.abort("a")  # while the plan "executes"
    outs = s.postprocess(plan, [7, 7])
    a = [o for o in outs if o.rid == "a"]
    assert len(a) == 1 and a[0].finish_reason == "abort" and a[0].new_token_ids == []
    assert a[0].completion_tokens == 1  # the prefill token; the decode token was dropped
    assert s.stats()["free_slots"] == 1 and s.stats()["running"] == 1
    s.add("a", [5], params())  # the rid is free again
    assert s.abort_all() == 2
    outs = s.postprocess(None, None)
    assert sorted(o.rid for o in outs) == ["a", "b"] and s.stats()["free_slots"] == 2


def test_abort_between_steps_is_released_without_a_plan() -> None:
    s = make()
    s.add("a", [5], params())
    step(s)
    s.abort("a")
    assert s.schedule() is None  # nothing left to decode
    outs = s.postprocess(None, None)
    assert [(o.rid, o.finish_reason) for o in outs] == [("a", "abort")]
    assert not s.has_work() and s.stats()["free_slots"] == 4


def test_execute_error_finishes_plan_with_error() -> None:
    s = make()
    s.add("a", [5], params())
    plan = s.schedule()
    outs = s.postprocess(plan, None, "boom")
    assert [(o.rid, o.finish_reason, o.error) for o in outs] == [("a", "error", "boom")]
    assert s.stats()["free_slots"] == 4


def test_token_usage() -> None:
    s = make(max_running=2, max_model_len=10)
    s.add("a", [5] * 4, params())
    step(s)
    assert s.stats()["token_usage"] == pytest.approx(5 / 20)


class PolicyMachine(RuleBasedStateMachine):
    """Random add / schedule / postprocess / abort: slots never leak or double-free, and every
    request gets exactly one finished output, with nothing after it."""

    def __init__(self) -> None:
        super().__init__()
        self.s = make(max_running=3, max_model_len=12, max_prefill_tokens=10)
        self.plan: Plan | None = None
        self.scheduled = False
        self.next_id = 0
        self.finished: set[str] = set()
        self.added: set[str] = set()
        self.aborted: set[str] = set()  # abort accepted: must end with "abort"

    @rule(n=st.integers(0, 14), max_new=st.integers(0, 5), stop=st.booleans())
    def add(self, n: int, max_new: int, stop: bool) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.s.add(rid, [5] * n, params(max_new_tokens=max_new, stop_token_ids=(9,) * stop))
        self.added.add(rid)

    @precondition(lambda self: not self.scheduled)
    @rule()
    def schedule(self) -> None:
        self.plan = self.s.schedule()
        self.scheduled = True

    @precondition(lambda self: self.scheduled)
    @rule(tokens=st.lists(st.sampled_from([7, 9, EOS]), min_size=3, max_size=3), fail=st.booleans())
    def postprocess(self, tokens: list[int], fail: bool) -> None:
        plan = self.plan
        ids = [tokens[i % 3] for i in range(len(plan.seqs))] if plan else None
        self.collect(self.s.postprocess(plan, ids, "boom" if plan and fail else None))
        self.plan, self.scheduled = None, False

    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        rid = f"r{pick % (self.next_id + 1)}"  # mostly known rids, sometimes an unknown one
        if self.s.abort(rid):
            assert rid in self.added and rid not in self.finished
            self.aborted.add(rid)

    def collect(self, outs: list[StepOutput]) -> None:
        for o in outs:
            assert o.rid not in self.finished, f"output after finish: {o}"
            if o.rid in self.aborted:
                assert o.finished and o.finish_reason == "abort" and not o.new_token_ids, o
            if o.finished:
                self.finished.add(o.rid)
                assert o.finish_reason in ("stop", "length", "abort", "error")

    @invariant()
    def slots_match_running(self) -> None:
        s = self.s
        slots = [q.slot for q in s.running]
        assert None not in slots and len(set(slots)) == len(slots)
        assert s.slots.num_used == len(s.running) == len(set(slots))
        assert s.slots.num_free + s.slots.num_used == s.max_running
        assert set(slots) == s.slots._used

    def teardown(self) -> None:
        if self.scheduled:
            self.collect(
                self.s.postprocess(self.plan, [7] * len(self.plan.seqs) if self.plan else None)
            )
        for _ in range(100):
            if not self.s.has_work():
                break
            plan = self.s.schedule()
            self.collect(self.s.postprocess(plan, [7] * len(plan.seqs) if plan else None))
        assert not self.s.has_work()
        assert self.finished == self.added
        assert self.s.slots.num_free == self.s.max_running


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
