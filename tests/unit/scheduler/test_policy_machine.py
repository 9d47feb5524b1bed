"""Policy (no torch): a property test over random traffic on a small cache."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from policy_helpers import EOS, STOP, FakeRunner, make, params

from meshlm.scheduler.engine.sequence import ItemResult, Plan, Sequence, SequenceStatus, StepOutput

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
