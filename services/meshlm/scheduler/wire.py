"""Wire <-> engine conversion for the scheduler (the one place it happens)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshlm.scheduler.engine.sequence import SamplingParams, StepOutput
from meshlm.v1 import common_pb2


def engine_params(p: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens, stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos, seed=p.seed if p.HasField("seed") else None,
        return_logprob=p.return_logprob,
        top_logprobs_num=p.top_logprobs_num if p.return_logprob else 0,
        logprob_start_len=p.logprob_start_len if p.return_logprob else -1,
        token_ids_logprob=tuple(p.token_ids_logprob) if p.return_logprob else (),
    )


def has_logprobs(out: StepOutput) -> bool:
    """Whether the engine put logprobs in this output (return_logprob requests only)."""
    return bool(out.output_logprobs or out.output_top_logprobs or out.input_logprobs
                or out.input_top_logprobs or out.output_token_ids_logprobs)


def fill_logprobs(msg: common_pb2.Logprobs, out: StepOutput, prompt_ids: Sequence[int]) -> None:
    """A StepOutput's logprobs -> wire (into `msg`). `prompt_ids` is the request's prompt,
    needed only when the output carries prompt logprobs (their positions' ids go with them)."""
    msg.output_logprobs.extend(out.output_logprobs)
    msg.output_top.extend(_top_pb(t) for t in out.output_top_logprobs)
    msg.output_token_ids.extend(_top_pb(t) for t in out.output_token_ids_logprobs)
    if out.input_logprobs or out.input_top_logprobs:
        start = out.input_logprob_start
        msg.input_start = start
        msg.input_token_ids.extend(prompt_ids[start:start + len(out.input_logprobs)])
        msg.input_logprobs.extend(math.nan if x is None else x for x in out.input_logprobs)
        msg.input_top.extend(_top_pb(t) for t in out.input_top_logprobs)


def _top_pb(pairs: list[tuple[int, float]]) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=[t for t, _ in pairs], logprobs=[p for _, p in pairs])
