"""Helpers for the policy tests (no torch): a planner on a small cache, and a fake runner that
carries out its plans on a fake KV cache of token ids, checking what the real runner relies on."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from meshlm.scheduler.engine.policy import BatchPlanner
from meshlm.scheduler.engine.sequence import (
    ItemResult,
    Plan,
    SamplingParams,
    Sequence,
    SequenceStatus,
    StepOutput,
)

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
                    token=self.sample(seq) if item.sample and not seq.prefill_only else None,
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


def runner_of(s: BatchPlanner) -> FakeRunner:
    """The fake runner `step` uses for `s` (one fake KV cache per planner)."""
    return _runners.setdefault(s, FakeRunner(s))


def step(s: BatchPlanner, token: int = 7) -> tuple[Plan | None, list[StepOutput]]:
    """One step in which the "model" samples `token` (one fake KV cache per planner)."""
    runner = runner_of(s)
    runner.sample = lambda _: token
    return runner.step()


def tokens_of(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def rids(plan: Plan | None) -> list[str]:
    return [q.rid for q in plan.seqs] if plan else []


def shape(plan: Plan | None) -> list[tuple[str, int, int, bool]]:
    return [(i.seq.rid, i.start, i.num_tokens, i.sample) for i in plan.items] if plan else []
