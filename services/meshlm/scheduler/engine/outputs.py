"""StepOutput construction: what one request reports after a step (no torch, policy-side)."""

from __future__ import annotations

from meshlm.scheduler.engine.sequence import ItemResult, Sequence, SequenceStatus, StepOutput


def step_output(
    seq: Sequence, new: list[int] | None = None, result: ItemResult | None = None,
    error: str | None = None,
) -> StepOutput:
    """`seq`'s news: the `new` tokens (with their logprobs from `result` when it asked for
    them), its counts, its end when finished, and on its first output its prompt logprobs."""
    finished = seq.status is SequenceStatus.FINISHED
    prompt = seq.num_prompt_tokens
    out = StepOutput(seq.rid, new or [], finished, seq.finish_reason if finished else None,
                     seq.matched_token, prompt, len(seq.token_ids) - prompt,
                     seq.num_cached_tokens, error)  # positional: faster
    if seq.params.return_logprob:
        if result is not None:
            _position_logprobs(out, seq, result)
        start = seq.input_logprob_start
        if not seq.first_output_sent and start is not None:
            out.input_logprob_start = start
            out.input_logprobs, out.input_top_logprobs = (
                seq.input_logprobs, seq.input_top_logprobs
            )
            out.input_ranks = seq.input_ranks
            out.input_token_ids_logprobs = seq.input_token_ids_logprobs
    seq.first_output_sent = True
    return out


def _position_logprobs(out: StepOutput, seq: Sequence, result: ItemResult) -> None:
    """The logprobs of the position `result` sampled at: the drawn token's, the top and the
    asked ids'. A prefill-only request draws none there, but its top and asked ids' come."""
    if result.logprob is not None:
        out.output_logprobs = [result.logprob]
    elif not seq.prefill_only:
        return
    if seq.params.top_logprobs_num:
        out.output_top_logprobs = [result.top_logprobs or []]
    if result.token_ids_logprobs is not None:
        out.output_token_ids_logprobs = [result.token_ids_logprobs]
