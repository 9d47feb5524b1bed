"""The detokenizer's wire conversion: what passes through from a scheduler's output to its
gateway's, untouched."""

from __future__ import annotations

from opentelemetry import trace

from meshlm.detokenizer.decode_state import DecodeState
from meshlm.detokenizer.wire import text_ids, text_output
from meshlm.v1 import common_pb2, detokenizer_pb2


def test_ids_counts_logprobs_and_the_prompts_ids_pass_through() -> None:
    out = detokenizer_pb2.TokenOutput(
        rid="r", token_ids=[7, 8], prompt_tokens=3, completion_tokens=2, cached_tokens=1,
        logprobs=common_pb2.Logprobs(output_logprobs=[-0.5, -0.25]),
        header=common_pb2.RequestHeader(prompt_ids=[1, 2, 3]))
    text_out = text_output(out)
    assert list(text_out.token_ids) == [7, 8] and list(text_out.prompt_ids) == [1, 2, 3]
    assert (text_out.prompt_tokens, text_out.completion_tokens, text_out.cached_tokens) == (
        3, 2, 1)
    assert list(text_out.logprobs.output_logprobs) == [-0.5, -0.25]
    assert not text_out.text and not text_out.finished
    later = text_output(detokenizer_pb2.TokenOutput(rid="r", token_ids=[9]))
    assert not later.prompt_ids and not later.HasField("logprobs")


def test_a_matched_stop_token_is_cut_from_the_text_unless_kept() -> None:
    def state(keep: bool) -> DecodeState:
        return DecodeState(gateway="g", scheduler="s", decoder=None,
                           span=trace.INVALID_SPAN, stop_token_text=keep)

    last = detokenizer_pb2.TokenOutput(rid="r", token_ids=[7, 3], finished=True,
                                       finish_reason="stop", matched_token=3)
    assert list(text_ids(last, state(False))) == [7]
    assert list(text_ids(last, state(True))) == [7, 3]  # no_stop_trim
    cut = detokenizer_pb2.TokenOutput(rid="r", token_ids=[7, 3], finished=True,
                                      finish_reason="length")
    assert list(text_ids(cut, state(False))) == [7, 3]
    running = detokenizer_pb2.TokenOutput(rid="r", token_ids=[3])
    assert list(text_ids(running, state(False))) == [3]
