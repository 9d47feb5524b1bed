"""How often a request's outputs leave the scheduler.

A request's first output leaves at once (it carries the header: the detokenizer and gateway
learn that it runs, the client gets its first token), and so does its last. Between them its
tokens leave in pieces of at least `hold` tokens:

- a streaming request: `--stream-interval` (default 1: every output at once; SGLang's flag of
  the same name, with its meaning: the first token, then every n-th);
- a request that does not stream (read whole, at its end): `HOLD_TOKENS`, as SGLang sends such
  requests' tokens every 50. The detokenizer and the gateway then handle one output where they
  handled fifty.

Never held back: a request with stop strings (the detokenizer matches them, and would match
them late, the engine computing past the stop meanwhile) and an embedding (one output anyway).
"""

from __future__ import annotations

import dataclasses

from meshlm.scheduler.engine.sequence import StepOutput
from meshlm.scheduler.tracked import Tracked
from meshlm.v1 import common_pb2

HOLD_TOKENS = 50


def hold_tokens(meta: common_pb2.RequestMeta, stream_interval: int) -> int:
    """The tokens per piece of a request's outputs (1: each output leaves at once)."""
    if meta.embed or meta.sampling.stop:
        return 1
    return stream_interval if meta.stream else HOLD_TOKENS


def release(tracked: Tracked, out: StepOutput) -> StepOutput | None:
    """`out`, joined to what `tracked` held before it, when it is due to leave now; else None
    (it is held). Due: the request's first output, its last, and `tracked.hold` tokens."""
    if tracked.held is not None:
        out = merge(tracked.held, out)
        tracked.held = None
    if out.finished or not tracked.header_sent or len(out.new_token_ids) >= tracked.hold:
        return out
    tracked.held = out
    return None


def merge(earlier: StepOutput, later: StepOutput) -> StepOutput:
    """One output with the tokens (and their logprobs) of two consecutive ones; counts, finish
    and error are the later one's, the prompt's logprobs whichever carries them (a request's
    first output)."""
    first = earlier if earlier.input_logprobs or earlier.input_top_logprobs \
        or earlier.input_token_ids_logprobs else later
    return dataclasses.replace(
        later,
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        output_logprobs=earlier.output_logprobs + later.output_logprobs,
        output_top_logprobs=earlier.output_top_logprobs + later.output_top_logprobs,
        output_token_ids_logprobs=(earlier.output_token_ids_logprobs
                                   + later.output_token_ids_logprobs),
        input_logprob_start=first.input_logprob_start,
        input_logprobs=first.input_logprobs,
        input_ranks=first.input_ranks,
        input_top_logprobs=first.input_top_logprobs,
        input_token_ids_logprobs=first.input_token_ids_logprobs,
    )
