"""Wire <-> engine conversion for the scheduler (the one place it happens): a tokenized request's
sampling params and meta in, step outputs (logprobs included, the meta sent on whole in each
request's first output's header) and load figures out."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace

from meshlm.common.packed import Plain
from meshlm.common.tracing import carrier_of
from meshlm.scheduler.engine.sequence import SamplingParams, StepOutput
from meshlm.scheduler.tracked import Tracked
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2


def engine_params(p: common_pb2.SamplingParams,
                  bad_words: Sequence[scheduler_pb2.TokenSequence] = (),
                  thinking: tuple[Sequence[int], Sequence[int]] | None = None) -> SamplingParams:
    """The engine's parameters; `thinking`: the thinking budget's tags encoded (opening,
    closing), with p.thinking_budget."""
    budget = None
    if p.HasField("thinking_budget") and thinking is not None:
        budget = (p.thinking_budget.tokens, tuple(thinking[0]), tuple(thinking[1]))
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
        logit_bias=tuple(sorted(p.logit_bias.items())),
        allowed_token_ids=tuple(p.allowed_token_ids),
        grammar=p.grammar,
        bad_words=tuple(tuple(word.ids) for word in bad_words),
        thinking=budget,
    )


def thinking_tags(req: scheduler_pb2.TokenizedRequest) -> tuple[list[int], list[int]] | None:
    """The thinking budget's tags as the tokenizer encoded them, if the request has a budget."""
    if not req.meta.sampling.HasField("thinking_budget"):
        return None
    return list(req.thinking_open.ids), list(req.thinking_close.ids)


def tracked_of(req: scheduler_pb2.TokenizedRequest, span: trace.Span) -> Tracked:
    """What the engine loop keeps of a request for its outputs: its meta (a copy: a reference
    would keep the whole received batch alive), and its prompt when prompt logprobs will need
    their ids or the client asked for them back (return_prompt_ids)."""
    meta = common_pb2.RequestMeta()
    meta.CopyFrom(req.meta)
    tracked = Tracked(meta=meta, prompt_tokens=len(req.input_ids), span=span)
    if meta.return_prompt_ids or (meta.sampling.return_logprob
                                  and meta.sampling.logprob_start_len >= 0):
        tracked.prompt_ids = list(req.input_ids)
    return tracked


def token_item(out: StepOutput, tracked: Tracked) -> detokenizer_pb2.TokenOutput | Plain:
    """StepOutput -> what the detokenizer stream queues: a running request's new ids and counts
    packed (common/packed.py), anything more (its first output, its last, logprobs, an
    embedding) as a whole TokenOutput."""
    if (tracked.header_sent and not out.finished and out.embedding is None
            and not tracked.return_logprob):
        return plain_item(out)
    return token_output(out, tracked)


def plain_item(out: StepOutput) -> Plain:
    """A running request's new ids and counts, packed (its header gone, no logprobs)."""
    return (out.rid, out.new_token_ids, out.prompt_tokens, out.completion_tokens,
            out.cached_tokens, "")


def token_output(out: StepOutput, tracked: Tracked) -> detokenizer_pb2.TokenOutput:
    """StepOutput -> wire. The first output of a request carries its header (`tracked` then
    records it as sent, with the prompt's ids when the client asked for them back), and the
    prompt ids go out once, with the prompt logprobs."""
    msg = detokenizer_pb2.TokenOutput(
        rid=out.rid, token_ids=out.new_token_ids, finished=out.finished,
        finish_reason=out.finish_reason or "", prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
    )
    if out.matched_token is not None:
        msg.matched_token = out.matched_token
    if out.error is not None:
        msg.error.code = int(tracked.error_code)
        msg.error.message = out.error
    if out.embedding is not None:
        msg.embedding.extend(out.embedding)
    if not tracked.header_sent:
        tracked.header_sent = True
        msg.header.meta.CopyFrom(tracked.meta)
        msg.header.prompt_tokens = tracked.prompt_tokens
        msg.header.trace.update(carrier_of(tracked.span))
        if tracked.meta.return_prompt_ids:
            msg.header.prompt_ids.extend(tracked.prompt_ids)
    if has_logprobs(out):
        fill_logprobs(msg.logprobs, out, tracked.prompt_ids)
        if out.input_logprobs:
            tracked.prompt_ids = []
    elif not tracked.return_logprob:
        tracked.prompt_ids = []  # sent in the header
    return msg


def has_logprobs(out: StepOutput) -> bool:
    """Whether the engine put logprobs in this output (return_logprob requests only)."""
    return bool(out.output_logprobs or out.output_top_logprobs or out.input_logprobs
                or out.input_top_logprobs or out.output_token_ids_logprobs
                or out.input_token_ids_logprobs)


def fill_logprobs(msg: common_pb2.Logprobs, out: StepOutput, prompt_ids: Sequence[int]) -> None:
    """A StepOutput's logprobs -> wire (into `msg`). `prompt_ids` is the request's prompt,
    needed only when the output carries prompt logprobs (their positions' ids go with them)."""
    msg.output_logprobs.extend(out.output_logprobs)
    msg.output_top.extend(_top_pb(t) for t in out.output_top_logprobs)
    msg.output_token_ids_logprobs.extend(_top_pb(t) for t in out.output_token_ids_logprobs)
    if out.input_logprobs or out.input_top_logprobs or out.input_token_ids_logprobs:
        start = out.input_logprob_start
        msg.input_start = start
        msg.input_token_ids.extend(prompt_ids[start:start + len(out.input_logprobs)])
        msg.input_logprobs.extend(math.nan if x is None else x for x in out.input_logprobs)
        msg.input_ranks.extend(out.input_ranks)
        msg.input_top.extend(_top_pb(t) for t in out.input_top_logprobs)
        msg.input_token_ids_logprobs.extend(_top_pb(t) for t in out.input_token_ids_logprobs)


def _top_pb(pairs: list[tuple[int, float]]) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=[t for t, _ in pairs], logprobs=[p for _, p in pairs])


def load_of(address: str, stats: dict[str, Any]) -> scheduler_pb2.Load:
    """The engine's stats() -> GetLoad's answer (every figure also in json_info)."""
    return scheduler_pb2.Load(
        address=address, running=stats["running"], waiting=stats["waiting"],
        max_running=stats["max_running"], finished_total=stats["finished_total"],
        aborted_total=stats["aborted_total"],
        generated_tokens_total=stats["generated_tokens_total"],
        token_usage=stats["token_usage"], json_info=json.dumps(stats),
    )
