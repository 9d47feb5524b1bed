"""max_new_tokens 0 (SGLang's prefill-only request): the prompt is computed, chunk by chunk, and
the request finishes "length" with no token drawn; with return_logprob its one output carries the
prompt logprobs asked and, for the position after the prompt, the top and asked ids' logprobs
(no logprob of a drawn token). The policy on a fake runner, then the engine against a cache-free
full recompute of the same model."""

from __future__ import annotations

import pytest
import torch
from policy_helpers import FakeRunner, make, params, prompt
from scheduler_helpers import EngineFactory, greedy, run_all

from meshlm.scheduler.engine.engine import Engine, SamplingParams

LABELS = (5, 17, 200, 5)  # a repeat is answered twice


def test_the_prompt_is_computed_then_it_finishes_length_without_a_token() -> None:
    s = make(max_batched_tokens=8)
    s.add("p", prompt(20), params(max_new_tokens=0))
    runner = FakeRunner(s)
    outs = runner.drain()["p"]
    assert [item.num_tokens for plan in runner.plans for item in plan.items] == [8, 8, 4]
    [out] = outs  # one output: nothing before the prompt is done
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    assert (out.prompt_tokens, out.completion_tokens) == (20, 0)
    stats = s.stats()
    assert stats["generated_tokens_total"] == 0 and stats["finished_total"] == 1
    assert s.blocks.num_used == 0 and not s.running


def test_its_prompt_logprobs_come_with_its_one_output() -> None:
    s = make(max_batched_tokens=4)
    s.add("p", prompt(6), params(max_new_tokens=0, return_logprob=True, logprob_start_len=0))
    s.add("q", prompt(6), params(max_new_tokens=0, return_logprob=True, logprob_start_len=4))
    outs = FakeRunner(s).drain()
    [p], [q] = outs["p"], outs["q"]
    assert p.input_logprobs == [None, 1.0, 2.0, 3.0, 4.0, 5.0]  # the fake logprob of p is p
    assert (q.input_logprob_start, q.input_logprobs) == (4, [4.0, 5.0])
    assert p.output_logprobs == [] and p.output_top_logprobs == []


def test_it_warms_the_prefix_cache() -> None:
    s = make()
    s.add("warm", prompt(13), params(max_new_tokens=0))
    runner = FakeRunner(s)
    runner.drain()
    s.add("then", prompt(13), params(max_new_tokens=2))
    [first, *_] = runner.drain()["then"]
    assert first.cached_tokens == 12  # every full block of the prompt


def test_samples_of_one_prompt_share_it() -> None:
    s = make()
    s.add("a", prompt(9), params(max_new_tokens=0))
    s.add("b", prompt(9), params(max_new_tokens=0), after="a")
    outs = FakeRunner(s).drain()
    assert [o.finish_reason for o in outs["a"] + outs["b"]] == ["length", "length"]
    assert outs["b"][0].cached_tokens == 8


def _reference(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Cache-free log-probabilities [T, V]: row p scores the token after position p."""
    with torch.inference_mode():
        return engine.model.forward_full(torch.tensor([ids]))[0].float().log_softmax(-1)


def _pairs(logp: torch.Tensor) -> list[tuple[int, float]]:
    return [(t, logp[t].item()) for t in LABELS]


def _close(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    torch.testing.assert_close(torch.tensor([v for _, v in got]),
                               torch.tensor([v for _, v in want]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [512, 5])
def test_engine_logprobs_of_the_prompt_and_the_position_after_it(
        make_engine: EngineFactory, chunk: int) -> None:
    engine = make_engine(max_running=4, max_batched_tokens=chunk, block_size=4)
    ids = [7, 30, 200, 11, 45, 3, 99, 120, 64]
    asked = SamplingParams(temperature=0.0, max_new_tokens=0, return_logprob=True,
                           top_logprobs_num=3, logprob_start_len=0, token_ids_logprob=LABELS)
    engine.add_request("p", ids, asked)
    engine.add_request("g", ids, greedy(2, return_logprob=True, token_ids_logprob=LABELS))
    outs = run_all(engine)
    [out] = outs["p"]
    logp = _reference(engine, ids)
    assert out.finish_reason == "length" and out.new_token_ids == []
    assert out.completion_tokens == 0 and out.output_logprobs == []
    # The position after the prompt: its top 3 and the asked ids', nothing drawn.
    [top] = out.output_top_logprobs
    assert [t for t, _ in top] == logp[-1].topk(3).indices.tolist()
    [after] = out.output_token_ids_logprobs
    _close(after, _pairs(logp[-1]))
    # The prompt: position 0 has nothing, position p is scored by row p - 1.
    assert out.input_logprobs[0] is None and out.input_token_ids_logprobs[0] == []
    torch.testing.assert_close(
        torch.tensor(out.input_logprobs[1:]),
        torch.tensor([logp[p - 1, ids[p]].item() for p in range(1, len(ids))]),
        atol=1e-4, rtol=0)
    assert len(out.input_token_ids_logprobs) == len(ids)
    for p in range(1, len(ids)):
        _close(out.input_token_ids_logprobs[p], _pairs(logp[p - 1]))
    # Each prompt token's rank (1 = the most likely), within the reference's rounding.
    assert len(out.input_ranks) == len(ids) and out.input_ranks[0] == 0
    for p in range(1, len(ids)):
        row, target = logp[p - 1], logp[p - 1, ids[p]]
        assert int((row > target + 1e-4).sum()) + 1 <= out.input_ranks[p]
        assert out.input_ranks[p] <= int((row >= target - 1e-4).sum())
    # The request beside it draws as usual, its first position the one after the same prompt.
    first = outs["g"][0]
    assert len(first.new_token_ids) == 1 and first.new_token_ids[0] == logp[-1].argmax().item()
    _close(first.output_token_ids_logprobs[0], _pairs(logp[-1]))


def test_engine_without_logprobs_reports_nothing(gqa_engine: Engine) -> None:
    gqa_engine.add_request("plain", [5, 6, 7], SamplingParams(max_new_tokens=0))
    gqa_engine.add_request("asked", [5, 6, 7], SamplingParams(
        max_new_tokens=0, token_ids_logprob=LABELS))  # ignored without return_logprob
    outs = run_all(gqa_engine)
    for rid in ("plain", "asked"):
        [out] = outs[rid]
        assert out.finish_reason == "length" and out.new_token_ids == []
        assert not (out.output_logprobs or out.output_top_logprobs or out.input_logprobs
                    or out.output_token_ids_logprobs or out.input_token_ids_logprobs)
