"""Wire conversion for the detokenizer (the one place it happens): a request's header (the
gateway's RequestMeta, as the scheduler sent it on) becomes its decode state, and each
TokenOutput the TextOutput its gateway gets."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from opentelemetry import trace
from tokenizers import Tokenizer

from meshlm.detokenizer.decode_state import DecodeState
from meshlm.detokenizer.incremental import make_detokenizer
from meshlm.v1 import common_pb2, detokenizer_pb2, gateway_pb2


def decode_state(header: common_pb2.RequestHeader, tokenizer: Tokenizer,
                 span: trace.Span) -> DecodeState:
    """A request's state from its header: its gateway and scheduler, and (return_text) an
    incremental detokenizer with its stop strings and decode options."""
    meta = header.meta
    sampling = meta.sampling
    decoder = None
    if meta.return_text:
        decoder = make_detokenizer(tokenizer, skip_special_tokens=sampling.skip_special_tokens,
                                   stop=list(sampling.stop), include_stop=sampling.no_stop_trim)
    return DecodeState(gateway=meta.route.gateway, scheduler=meta.route.scheduler,
                       decoder=decoder, span=span,
                       logprob_texts=sampling.return_text_in_logprobs,
                       stop_token_text=sampling.no_stop_trim)


def text_ids(out: detokenizer_pb2.TokenOutput, state: DecodeState) -> Sequence[int]:
    """The ids of `out` whose text the client gets: a stop token that ended the request (an
    end-of-sequence id or one of stop_token_ids, matched by the scheduler) is cut from the
    text as a stop string is (SGLang and vLLM do the same), unless no_stop_trim keeps it.
    Its id stays among the output's ids."""
    ids = out.token_ids
    if (out.finished and out.HasField("matched_token") and not state.stop_token_text
            and ids and ids[-1] == out.matched_token):
        return ids[:-1]
    return ids


def text_output(out: detokenizer_pb2.TokenOutput) -> gateway_pb2.TextOutput:
    """What passes through as it came: the token ids, the counts, the embedding, the
    logprobs (their texts are added later) and the prompt's ids; no text, not finished."""
    text_out = gateway_pb2.TextOutput(
        rid=out.rid, token_ids=out.token_ids, prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
    )
    if out.embedding:
        text_out.embedding.extend(out.embedding)
    if out.HasField("logprobs"):
        text_out.logprobs.CopyFrom(out.logprobs)
    if out.header.prompt_ids:  # the first output of a request that asked for them
        text_out.prompt_ids.extend(out.header.prompt_ids)
    return text_out


def end_as_scheduled(text_out: gateway_pb2.TextOutput, out: detokenizer_pb2.TokenOutput) -> None:
    """Finish `text_out` as the scheduler finished `out`: its reason, matched token, error."""
    text_out.finished = True
    text_out.finish_reason = out.finish_reason
    if out.HasField("matched_token"):
        text_out.matched_token = out.matched_token
    if out.HasField("error"):
        text_out.error.CopyFrom(out.error)


def lost_output(rid: str, address: str) -> gateway_pb2.TextOutput:
    """The final output of a request whose gateway stream (to `address`) failed."""
    return gateway_pb2.TextOutput(
        rid=rid, finished=True, finish_reason="error",
        error=common_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                message=f"the detokenizer lost its stream to the gateway at "
                                        f"{address}"))
