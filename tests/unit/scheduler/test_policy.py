"""Policy (no torch): token budget, chunked prefill, admission, preemption, prefix reuse."""

from __future__ import annotations

import subprocess
import sys

import pytest
from policy_helpers import FakeRunner, make, params, prompt, rids, shape, step, tokens_of

from meshlm.scheduler.engine.sequence import ItemResult, SequenceStatus
from meshlm.scheduler.engine.slot_table import SlotTable

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
    assert s.stats()["steps_total"] == 3  # each forward pass whose results came back


def test_a_step_that_failed_is_not_counted() -> None:
    s = make()
    s.add("a", prompt(3), params(max_new_tokens=2))
    plan = s.schedule()
    assert plan is not None
    s.postprocess(plan, None, error="the forward pass failed")
    assert s.stats()["steps_total"] == 0


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
