"""Policy (no torch): token budget, chunked prefill, admission, preemption, prefix reuse, aborts,
finish rules, and a property test over random traffic on a small cache."""

from __future__ import annotations

import subprocess
import sys
import weakref
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from meshlm.scheduler.engine.policy import BatchPlanner
from meshlm.scheduler.engine.sequence import (
    ItemResult,
    Plan,
    SamplingParams,
    Sequence,
    SequenceStatus,
    StepOutput,
)
from meshlm.scheduler.engine.slot_table import SlotTable

EOS = 2
STOP = 9
BS = 4


def make(**kw: object) -> BatchPlanner:
    args: dict[str, object] = {
        "max_running": 4,
        "max_model_len": 64,
        "num_blocks": 64,
        "block_size": BS,
        "max_batched_tokens": 100,
        "eos_token_ids": {EOS},
        "vocab_size": 100,
    }
    args.update(kw)
    return BatchPlanner(**args)  # type: ignore[arg-type]


def params(**kw: object) -> SamplingParams:
    return SamplingParams(**kw)  # type: ignore[arg-type]


def prompt(n: int, first: int = 10) -> list[int]:
    return [first + i % 50 for i in range(n)]


def by_position(seq: Sequence) -> int:
    """A deterministic "model": the token sampled after n tokens depends on n and the first
    prompt token only, so a recomputed sequence samples what it would have anyway."""
    return 10 + (seq.num_tokens * 7 + seq.token_ids[0]) % 80


class FakeRunner:
    """Carries out plans as the model runner would, on a fake KV cache of token ids (slot ->
    token), and checks what the runner relies on: each item continues where its sequence
    stopped, samples exactly at the end of its tokens, has blocks for them, and every
    position it attends to holds that sequence's token (shared prefix blocks included)."""

    def __init__(self, s: BatchPlanner, sample: Callable[[Sequence], int] = by_position) -> None:
        self.s = s
        self.sample = sample
        self.kv: dict[int, int] = {}
        self.plans: list[Plan] = []
        self.outs: dict[str, list[StepOutput]] = {}  # every output of step(), by rid

    def slot(self, seq: Sequence, pos: int) -> int:
        bs = self.s.blocks.block_size
        return seq.table.blocks[pos // bs] * bs + pos % bs

    def run(self, plan: Plan) -> list[ItemResult]:
        s = self.s
        assert 0 < plan.num_tokens <= s.max_batched_tokens
        assert len({id(q) for q in plan.seqs}) == len(plan.items)
        for item in plan.items:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING and seq.row is not None
            assert item.start == seq.num_computed_tokens and item.num_tokens > 0
            assert item.end <= seq.num_tokens
            assert item.sample == (item.end == seq.num_tokens)
            assert len(seq.table.blocks) >= s.blocks.blocks_for(item.end)
            for pos in range(item.start, item.end):
                self.kv[self.slot(seq, pos)] = seq.token_ids[pos]
        results = []
        for item in plan.items:
            seq = item.seq
            got = [self.kv.get(self.slot(seq, pos)) for pos in range(item.end)]
            assert got == seq.token_ids[: item.end], f"{seq.rid}: KV does not hold its tokens"
            results.append(
                ItemResult(
                    token=self.sample(seq) if item.sample else None,
                    input_logprobs=prompt_logprobs(item.seq, item.start, item.end),
                )
            )
        self.plans.append(plan)
        return results

    def step(self) -> tuple[Plan | None, list[StepOutput]]:
        plan = self.s.schedule()
        outs = self.s.postprocess(plan, self.run(plan) if plan else None)
        for o in outs:
            self.outs.setdefault(o.rid, []).append(o)
        return plan, outs

    def drain(self, max_steps: int = 1000) -> dict[str, list[StepOutput]]:
        """Step until idle; every output so far (of steps run by this runner), by rid."""
        for _ in range(max_steps):
            if not self.s.has_work():
                return self.outs
            self.step()
        raise AssertionError("scheduler did not go idle")


def prompt_logprobs(seq: Sequence, start: int, end: int) -> list[float | None]:
    """What a runner reports for a chunk [start, end): the logprob of prompt position p comes
    from the logits at p - 1, so the chunk covers p in (start, end] (and p = 0, which has
    none, with the first chunk), from the asked start on. The fake logprob of p is p."""
    first = seq.input_logprob_start
    if first is None or not seq.wants_prompt_logprobs:
        return []
    out: list[float | None] = []
    for p in range(first, seq.num_prompt_tokens):
        if p == 0 and start == 0:
            out.append(None)
        elif start < p <= end:
            out.append(float(p))
    return out


_runners: weakref.WeakKeyDictionary[BatchPlanner, FakeRunner] = weakref.WeakKeyDictionary()


def step(s: BatchPlanner, token: int = 7) -> tuple[Plan | None, list[StepOutput]]:
    """One step in which the "model" samples `token` (one fake KV cache per scheduler)."""
    runner = _runners.setdefault(s, FakeRunner(s))
    runner.sample = lambda _: token
    return runner.step()


def tokens_of(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def rids(plan: Plan | None) -> list[str]:
    return [q.rid for q in plan.seqs] if plan else []


def shape(plan: Plan | None) -> list[tuple[str, int, int, bool]]:
    return [(i.seq.rid, i.start, i.num_tokens, i.sample) for i in plan.items] if plan else []


# -- basics -------------------------------------------------------------------------------


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


def test_bad_budget_is_refused() -> None:
    with pytest.raises(ValueError):
        make(max_batched_tokens=0)


def test_results_must_match_the_plan() -> None:
    s = make()
    s.add("a", prompt(3), params())
    plan = s.schedule()
    assert plan is not None
    with pytest.raises(ValueError):  # one result per item
        s.postprocess(plan, [])
    with pytest.raises(RuntimeError, match="no token sampled"):
        s.postprocess(plan, [ItemResult()])


# -- budget and chunking ------------------------------------------------------------------


def test_step_never_exceeds_budget_and_fills_it() -> None:
    s = make(max_running=8, max_batched_tokens=16)
    for i in range(6):
        s.add(f"r{i}", prompt(5 + 3 * i, first=10 + i), params(max_new_tokens=4 + i))
    runner = FakeRunner(s)  # asserts num_tokens <= 16 on every plan
    outs = runner.drain()
    assert sorted(outs) == [f"r{i}" for i in range(6)]
    sizes = [p.num_tokens for p in runner.plans]
    # Every prompt token and every token but the last of each completion, once (no reuse).
    assert max(sizes) == 16 and sum(sizes) == sum(5 + 3 * i + 4 + i - 1 for i in range(6))
    assert s.stats()["cached_tokens_total"] == 0


def test_decodes_go_before_prompt_chunks() -> None:
    s = make(max_batched_tokens=5)
    runner = FakeRunner(s)
    for rid in ("a", "b"):
        s.add(rid, prompt(2), params(max_new_tokens=20))
    runner.step()  # both prompts in one step
    s.add("c", prompt(12), params())
    plan, _ = runner.step()
    assert shape(plan) == [("a", 2, 1, True), ("b", 2, 1, True), ("c", 0, 3, False)]
    # A budget the decodes use up leaves the prompt waiting.
    s2 = make(max_batched_tokens=2)
    for rid in ("a", "b"):
        s2.add(rid, prompt(1), params(max_new_tokens=20))
    step(s2)
    s2.add("c", prompt(3), params())
    plan, _ = step(s2)
    assert shape(plan) == [("a", 1, 1, True), ("b", 1, 1, True)]
    assert s2.stats()["waiting"] == 1


def test_long_prompt_is_chunked_in_order_and_samples_last() -> None:
    s = make(max_batched_tokens=10)
    s.add("long", prompt(25), params(max_new_tokens=2))
    runner = FakeRunner(s)
    shapes, firsts = [], []
    for _ in range(3):
        plan, outs = runner.step()
        shapes += shape(plan)
        firsts.append([o.new_token_ids for o in outs])
    assert shapes == [("long", 0, 10, False), ("long", 10, 10, False), ("long", 20, 5, True)]
    assert firsts[:2] == [[], []] and len(firsts[2][0]) == 1
    assert s.stats()["chunked_prefills_total"] == 2
    assert [i.reset_row for p in runner.plans for i in p.items] == [True, False, False]


def test_chunks_interleave_with_decodes() -> None:
    s = make(max_batched_tokens=8)
    runner = FakeRunner(s)
    s.add("a", prompt(3), params(max_new_tokens=10))
    runner.step()
    s.add("b", prompt(20), params(max_new_tokens=1))
    a_tokens = []
    for _ in range(3):
        plan, outs = runner.step()
        a_tokens += tokens_of([o for o in outs if o.rid == "a"])
        assert plan is not None and plan.items[0].seq.rid == "a" and plan.items[0].num_tokens == 1
    # b took 7, 7, then its last 6 tokens, a decoded every step.
    assert [(r, st_, n) for r, st_, n, _ in shape(runner.plans[1])] == [("a", 3, 1), ("b", 0, 7)]
    assert [(r, st_, n) for r, st_, n, _ in shape(runner.plans[2])] == [("a", 4, 1), ("b", 7, 7)]
    assert [(r, st_, n) for r, st_, n, _ in shape(runner.plans[3])] == [("a", 5, 1), ("b", 14, 6)]
    assert len(a_tokens) == 3


def test_admitted_prompt_chunks_go_before_new_admissions() -> None:
    s = make(max_batched_tokens=6)
    s.add("a", prompt(8), params())
    s.add("b", prompt(8, first=40), params())
    runner = FakeRunner(s)
    plan, _ = runner.step()
    assert shape(plan) == [("a", 0, 6, False)]
    plan, _ = runner.step()
    assert shape(plan) == [("a", 6, 2, True), ("b", 0, 4, False)]


# -- admission ----------------------------------------------------------------------------


def test_admission_needs_blocks_for_the_whole_prompt_fifo() -> None:
    s = make(num_blocks=6, max_batched_tokens=8)
    s.add("a", prompt(16), params(max_new_tokens=1))  # 4 blocks, though only 8 tokens fit now
    s.add("b", prompt(12, first=60), params(max_new_tokens=1))  # 3 blocks: not yet
    s.add("c", prompt(2, first=70), params(max_new_tokens=1))  # would fit, but FIFO
    runner = FakeRunner(s)
    plan, _ = runner.step()
    assert shape(plan) == [("a", 0, 8, False)] and s.blocks.num_used == 4
    plan, outs = runner.step()  # a has budget left over after its last chunk; b still waits
    assert shape(plan) == [("a", 8, 8, True)] and s.stats()["waiting"] == 2
    assert [o.finish_reason for o in outs] == ["length"]
    plan, _ = runner.step()
    assert shape(plan) == [("b", 0, 8, False)]
    runner.drain()
    admitted = [
        next(i for i, p in enumerate(runner.plans) if r in [q.rid for q in p.seqs]) for r in "abc"
    ]
    assert admitted == sorted(admitted) and admitted[1] == 2


def test_admission_needs_a_free_row() -> None:
    s = make(max_running=2)
    for i in range(3):
        s.add(f"r{i}", prompt(2), params(max_new_tokens=2))
    plan, _ = step(s)
    assert rids(plan) == ["r0", "r1"]
    assert s.stats()["free_slots"] == 0 and s.stats()["waiting"] == 1
    plan, outs = step(s)  # no row for r2; r0 and r1 finish
    assert rids(plan) == ["r0", "r1"]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert s.stats()["free_slots"] == 2
    plan, _ = step(s)
    assert plan is not None and [q.rid for q in plan.seqs] == ["r2"] and plan.seqs[0].row == 0


def test_watermark_holds_back_admission_unless_alone() -> None:
    s = make(num_blocks=8, watermark_blocks=2)
    s.add("a", prompt(24), params(max_new_tokens=1))  # 6 blocks: 2 left, the reserve
    s.add("b", prompt(4, first=60), params(max_new_tokens=1))  # 1 block: would eat into it
    plan, _ = step(s)
    assert rids(plan) == ["a"]
    s2 = make(num_blocks=8, watermark_blocks=2)
    s2.add("big", prompt(28), params(max_new_tokens=1))  # 7 blocks: alone, may use the reserve
    plan, _ = step(s2)
    assert rids(plan) == ["big"]


# -- preemption ---------------------------------------------------------------------------


def test_preempts_newest_first_to_the_front_and_recomputes() -> None:
    s = make(num_blocks=6, max_batched_tokens=100)
    runner = FakeRunner(s)
    for rid, first in (("a", 10), ("b", 30), ("c", 50)):
        s.add(rid, prompt(8, first), params(max_new_tokens=6))
    runner.step()  # all three admitted: 2 blocks each, cache full
    s.add("d", prompt(2, 70), params(max_new_tokens=6))
    assert s.blocks.num_free == 0
    c = s.running[2]
    plan, _ = runner.step()  # a needs a block: c (newest) goes; b takes the other one freed
    assert rids(plan) == ["a", "b"]
    assert [q.rid for q in s.waiting] == ["c", "d"]  # the front, ahead of d
    assert c.status is SequenceStatus.WAITING and c.table.blocks == [] and c.row is None
    assert c.num_computed_tokens == 0 and c.num_tokens == 9
    assert s.stats()["preempted_total"] == 1 and s.blocks.num_used == 6
    outs = runner.drain()
    for rid in "abcd":
        toks = tokens_of(outs[rid])
        assert len(toks) == 6 and outs[rid][-1].completion_tokens == 6
    # c's tokens are continuous: the same a run without preemption samples.
    alone = make(num_blocks=64)
    alone.add("c", prompt(8, 50), params(max_new_tokens=6))
    assert tokens_of(outs["c"]) == tokens_of(FakeRunner(alone).drain()["c"])
    assert s.stats()["preempted_total"] >= 1 and s.blocks.num_used == 0


def test_decode_with_nothing_newer_preempts_itself_and_resumes_from_its_prefix() -> None:
    s = make(num_blocks=4)
    runner = FakeRunner(s)
    s.add("a", prompt(4), params(max_new_tokens=2))
    s.add("b", prompt(8, 40), params(max_new_tokens=3))
    runner.step()  # a: 1 block, b: 2 blocks (both full, so cached), 1 free
    b = s.running[1]
    plan, outs = runner.step()  # a takes the free block; b, scheduled after it, has none
    assert shape(plan) == [("a", 4, 1, True)]
    assert [q.rid for q in s.waiting] == ["b"] and b.num_computed_tokens == 0
    assert [(o.rid, o.finish_reason) for o in outs] == [("a", "length")]
    assert s.stats()["preempted_total"] == 1 and b.num_preemptions == 1
    plan, _ = runner.step()
    # b's 8 prompt tokens are cached: only the token it had sampled is computed again.
    assert shape(plan) == [("b", 8, 1, True)] and plan is not None and plan.items[0].reset_row
    b_outs = runner.drain()["b"]
    assert b_outs[-1].cached_tokens == 0  # the first admission's figure, not the recompute's
    alone = make()
    alone.add("b", prompt(8, 40), params(max_new_tokens=3))
    assert tokens_of(b_outs) == tokens_of(FakeRunner(alone).drain()["b"])


def test_preempted_prefill_regathers_prompt_logprobs() -> None:
    s = make(num_blocks=6, max_batched_tokens=3, prefix_cache=False)
    runner = FakeRunner(s)
    s.add("a", prompt(2), params(max_new_tokens=10, ignore_eos=True))
    runner.step()  # a: 1 block
    s.add("b", prompt(14, 40), params(max_new_tokens=1, return_logprob=True, logprob_start_len=0))
    b = s.waiting[0]  # 4 blocks, 2 tokens a step beside a's decode
    before: tuple[int, int] = (0, 0)
    for _ in range(20):
        before = (b.num_computed_tokens, len(b.input_logprobs))
        runner.step()
        if s.stats()["preempted_total"]:
            break
    # a needed its third block while b (newest) was part-way through its prompt.
    assert b.status is SequenceStatus.WAITING and 0 < before[0] < 14 and before[1] > 0
    assert b.input_logprobs == [] and b.num_computed_tokens == 0
    outs = runner.drain()
    first = outs["b"][0]
    assert first.input_logprob_start == 0
    assert first.input_logprobs == [None] + [float(p) for p in range(1, 14)]


# -- prefix cache -------------------------------------------------------------------------


def test_same_prompt_reuses_full_blocks_and_shares_refs() -> None:
    s = make()
    runner = FakeRunner(s)
    s.add("a", prompt(10), params(max_new_tokens=4))
    runner.step()
    s.add("b", prompt(10), params(max_new_tokens=4))
    plan, _ = runner.step()
    a, b = s.running
    assert b.num_cached_tokens == 8 and b.table.blocks[:2] == a.table.blocks[:2]
    assert [s.blocks.blocks[i].ref_count for i in a.table.blocks[:2]] == [2, 2]
    assert ("b", 8, 2, True) in shape(plan)  # only the uncached tail is computed
    outs = runner.drain()
    assert outs["b"][-1].cached_tokens == 8 and outs["a"][-1].cached_tokens == 0
    assert tokens_of(outs["a"]) == tokens_of(outs["b"])  # the fake model is deterministic
    assert s.stats()["cached_tokens_total"] == 8 and s.stats()["prompt_tokens_total"] == 20
    assert s.blocks.num_used == 0 and s.stats()["kv_blocks_cached"] >= 2


def test_whole_block_prompt_still_computes_its_last_token() -> None:
    s = make()
    runner = FakeRunner(s)
    s.add("a", prompt(8), params(max_new_tokens=1))
    runner.drain()
    s.add("b", prompt(8), params(max_new_tokens=1))
    plan, outs = runner.step()
    assert shape(plan) == [("b", 4, 4, True)]  # not 8: the last token's logits are needed
    assert outs[0].cached_tokens == 4


def test_prefix_cache_off_reuses_nothing() -> None:
    s = make(prefix_cache=False)
    runner = FakeRunner(s)
    s.add("a", prompt(10), params(max_new_tokens=1))
    runner.drain()
    s.add("b", prompt(10), params(max_new_tokens=1))
    plan, _ = runner.step()
    assert shape(plan) == [("b", 0, 10, True)] and s.stats()["kv_blocks_cached"] == 0


@pytest.mark.parametrize(("start", "cached"), [(0, 0), (1, 0), (5, 4), (8, 4), (9, 8), (12, 8)])
def test_prompt_logprobs_limit_reuse(start: int, cached: int) -> None:
    s = make()
    runner = FakeRunner(s)
    s.add("a", prompt(13), params(max_new_tokens=1))
    runner.drain()
    s.add("b", prompt(13), params(max_new_tokens=1, return_logprob=True, logprob_start_len=start))
    outs = runner.drain()["b"]
    assert outs[0].cached_tokens == cached
    assert outs[0].input_logprob_start == start
    want = [None if p == 0 else float(p) for p in range(start, 13)]
    assert outs[0].input_logprobs == want


def test_prompt_logprobs_gathered_over_chunks() -> None:
    s = make(max_batched_tokens=4)
    s.add("a", prompt(11), params(max_new_tokens=2, return_logprob=True, logprob_start_len=3))
    outs = FakeRunner(s).drain()["a"]
    assert outs[0].input_logprobs == [float(p) for p in range(3, 11)]
    assert outs[1].input_logprobs == []  # only on the first output


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
    results = _runners[s].run(plan)
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
    s.add("zero", prompt(1), params(max_new_tokens=0))
    assert s.schedule() is None and s.has_work()
    outs = {o.rid: o for o in s.postprocess(None, None)}
    assert {r: o.finish_reason for r, o in outs.items()} == {
        "long": "error",
        "empty": "error",
        "oov": "error",
        "neg": "error",
        "temp": "error",
        "lp": "error",
        "zero": "length",
    }
    assert "max_model_len" in (outs["long"].error or "")
    assert not s.has_work() and s.stats()["finished_total"] == 7
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


# -- property test ------------------------------------------------------------------------

BASES = [[10 + i for i in range(24)], [40 + i for i in range(24)]]
# The tokens the fake model cycles through: mostly plain ones, so that sequences get long.
TOKENS = st.lists(st.sampled_from([7, 11, 12, 13, STOP, EOS]), min_size=1, max_size=6)
# base, shared prefix length, tail length, max_new_tokens, stop id?, ignore_eos, logprob start
REQUEST = st.tuples(
    st.integers(0, 1),
    st.integers(0, 24),
    st.integers(0, 7),
    st.integers(0, 16),
    st.integers(0, 1),
    st.booleans(),
    st.integers(-6, 12),
)


class PolicyMachine(RuleBasedStateMachine):
    """Random add / schedule / postprocess (random tokens, EOS and stop ids, errors) / abort /
    reset_prefix_cache on 12 blocks of 4 with prompts sharing prefixes. Blocks and rows never
    leak or double-free, ref counts are the running tables', every request gets exactly one
    finished output with nothing after it, and its tokens are exactly its outputs' tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.setup(0, True)

    def setup(self, watermark: int, prefix_cache: bool) -> None:
        self.s = make(
            max_running=3,
            max_model_len=40,
            num_blocks=12,
            max_batched_tokens=10,
            watermark_blocks=watermark,
            prefix_cache=prefix_cache,
        )
        self.tokens: list[int] = [7]
        self.runner = FakeRunner(self.s, self.sample)
        self.plan: Plan | None = None
        self.results: list[ItemResult] | None = None
        self.scheduled = False
        self.next_id = 0
        self.seqs: dict[str, Sequence] = {}
        self.got: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.added: set[str] = set()
        self.aborted: set[str] = set()  # abort accepted: must end with "abort"

    @initialize(watermark=st.integers(0, 2), prefix_cache=st.booleans())
    def configure(self, watermark: int, prefix_cache: bool) -> None:
        self.setup(watermark, prefix_cache)

    def sample(self, seq: Sequence) -> int:
        return self.tokens[seq.num_tokens % len(self.tokens)]

    @precondition(lambda self: len(self.s.waiting) < 6)  # a bounded backlog keeps runs short
    @rule(reqs=st.lists(REQUEST, min_size=1, max_size=3))
    def add(self, reqs: list[tuple[int, int, int, int, int, bool, int]]) -> None:
        for base, shared, tail, max_new, stops, ignore_eos, logprobs in reqs:
            rid = f"r{self.next_id}"
            self.next_id += 1
            ids = BASES[base][:shared] + [60 + self.next_id % 7] * tail
            if shared == 0 and tail == 7:
                ids = [5] * 40  # too long for max_model_len: an error at once
            p = params(
                max_new_tokens=max_new,
                stop_token_ids=(STOP,) * stops,
                ignore_eos=ignore_eos,
                return_logprob=logprobs >= 0,
                logprob_start_len=max(logprobs, -1),
            )
            self.s.add(rid, ids, p)
            self.added.add(rid)
            live = [q for q in self.s.waiting if q.rid == rid]
            if live:
                self.seqs[rid] = live[0]

    @precondition(lambda self: not self.scheduled)
    @rule()
    def schedule(self) -> None:
        self.plan = self.s.schedule()
        assert not any(q.aborted for q in self.s.running)  # released before planning
        self.results = self.runner.run(self.plan) if self.plan else None
        self.scheduled = True

    @precondition(lambda self: self.scheduled)
    @rule(tokens=TOKENS, fail=st.integers(0, 19))
    def postprocess(self, tokens: list[int], fail: int) -> None:
        error = "boom" if self.plan and fail == 0 else None
        self.collect(self.s.postprocess(self.plan, self.results, error))
        self.tokens = tokens
        self.plan, self.results, self.scheduled = None, None, False

    @precondition(lambda self: not self.scheduled)
    @rule(n=st.integers(1, 8), tokens=TOKENS)
    def steps(self, n: int, tokens: list[int]) -> None:
        """A few whole steps, so that sequences grow long enough to need preemption."""
        self.tokens = tokens
        for _ in range(n):
            plan = self.s.schedule()
            self.collect(self.s.postprocess(plan, self.runner.run(plan) if plan else None))
            self.blocks_and_rows_match_running()

    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        rid = f"r{pick % (self.next_id + 1)}"  # mostly known rids, sometimes an unknown one
        if self.s.abort(rid):
            assert rid in self.added and rid not in self.finished
            self.aborted.add(rid)

    @rule()
    def reset_prefix_cache(self) -> None:
        s = self.s
        live = bool(s.waiting or s.running)
        done = s.reset_prefix_cache()
        assert done == (not live)
        if done:
            assert s.blocks.num_cached == 0 and s.blocks.num_used == 0

    def collect(self, outs: list[StepOutput]) -> None:
        for o in outs:
            assert o.rid not in self.finished, f"output after finish: {o}"
            if o.rid in self.aborted:
                assert o.finished and o.finish_reason == "abort" and not o.new_token_ids, o
            seq = self.seqs.get(o.rid)
            start = seq.input_logprob_start if seq else None
            if o.rid not in self.got and o.new_token_ids and start is not None:
                # Gathered over chunks, preemptions and prefix hits: every position, once.
                assert o.input_logprob_start == start
                want = [None if p == 0 else float(p) for p in range(start, o.prompt_tokens)]
                assert o.input_logprobs == want
            got = self.got.setdefault(o.rid, [])
            got += o.new_token_ids
            assert o.completion_tokens == len(got)
            if o.finished:
                self.finished.add(o.rid)
                assert o.finish_reason in ("stop", "length", "abort", "error")
                if seq is not None:
                    assert seq.completion_ids == got

    @invariant()
    def blocks_and_rows_match_running(self) -> None:
        s = self.s
        s.blocks.check()
        refs = Counter(b for q in s.running for b in q.table.blocks)
        assert refs == Counter({b.block_id: b.ref_count for b in s.blocks.blocks if b.ref_count})
        assert s.blocks.num_free + s.blocks.num_used == s.blocks.num_blocks
        rows = [q.row for q in s.running]
        assert None not in rows and len(set(rows)) == len(rows) <= s.max_running
        assert s.rows.num_used == len(s.running)
        for q in s.running:
            assert q.status is SequenceStatus.RUNNING
            assert q.num_computed_tokens < q.num_tokens
            assert len(q.table.blocks) >= s.blocks.blocks_for(q.num_tokens - 1)
            assert len(q.table.blocks) >= s.blocks.blocks_for(q.num_prompt_tokens)
        for q in s.waiting:
            assert q.status is SequenceStatus.WAITING and not q.table.blocks and q.row is None
            assert q.num_computed_tokens == 0

    def teardown(self) -> None:
        s = self.s
        if self.scheduled:
            self.collect(s.postprocess(self.plan, self.results))
        for _ in range(2000):  # at most ~9 live requests of < 40 tokens each
            if not s.has_work():
                break
            plan = s.schedule()
            self.collect(s.postprocess(plan, self.runner.run(plan) if plan else None))
            self.blocks_and_rows_match_running()
        assert not s.has_work()
        assert self.finished == self.added
        assert s.blocks.num_used == 0 and s.rows.num_free == s.max_running
        s.blocks.check()
        assert s.reset_prefix_cache() and s.blocks.num_cached == 0


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Passing takes seconds; a failure is shrunk for up to Hypothesis's 5 minutes, so give it
# time to print the minimal example instead of hitting the suite's 300 s timeout.
TestPolicyMachine.pytestmark = [pytest.mark.timeout(900)]  # type: ignore[attr-defined]
