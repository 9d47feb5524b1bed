"""Wire <-> engine conversion: sampling params in, step outputs (logprobs included) and load
figures out; the error codes are gRPC's."""

from __future__ import annotations

import json
import math

import grpc
from opentelemetry import trace

from meshlm.scheduler.engine.sequence import StepOutput
from meshlm.scheduler.tracked import Code, Tracked
from meshlm.scheduler.wire import (
    engine_params,
    fill_logprobs,
    has_logprobs,
    load_of,
    token_output,
    tracked_of,
)
from meshlm.v1 import common_pb2, scheduler_pb2


def _step(**kw: object) -> StepOutput:
    base: dict[str, object] = dict(rid="r", new_token_ids=[7], finished=False, finish_reason=None,
                                   matched_token=None, prompt_tokens=4, completion_tokens=1,
                                   cached_tokens=0)
    return StepOutput(**{**base, **kw})  # type: ignore[arg-type]


def _tracked(return_text_in_logprobs: bool = False, **kw: object) -> Tracked:
    meta = common_pb2.RequestMeta(
        route=common_pb2.Route(detokenizer="d"), return_text=True,
        sampling=common_pb2.SamplingParams(skip_special_tokens=True,
                                           return_text_in_logprobs=return_text_in_logprobs))
    return Tracked(meta=meta, prompt_tokens=4, span=trace.INVALID_SPAN,
                   **kw)  # type: ignore[arg-type]


def test_engine_params_carry_logprob_options() -> None:
    p = engine_params(common_pb2.SamplingParams(
        temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_new_tokens=3,
        return_logprob=True, top_logprobs_num=5, logprob_start_len=0,
        return_text_in_logprobs=True))
    assert (p.return_logprob, p.top_logprobs_num, p.logprob_start_len) == (True, 5, 0)
    assert p.problem() is None


def test_engine_params_without_return_logprob_ask_for_nothing() -> None:
    # Stray values (e.g. proto3's default 0 for logprob_start_len) never reach the engine.
    p = engine_params(common_pb2.SamplingParams(top_p=1.0, top_logprobs_num=5))
    assert (p.return_logprob, p.top_logprobs_num, p.logprob_start_len) == (False, 0, -1)


def test_output_logprobs_to_wire() -> None:
    out = _step(new_token_ids=[7, 8], output_logprobs=[-0.5, -1.5],
                output_top_logprobs=[[(7, -0.5), (3, -2.0)], [(8, -1.5), (7, -1.75)]])
    assert has_logprobs(out)
    msg = common_pb2.Logprobs()
    fill_logprobs(msg, out, [])
    assert list(msg.output_logprobs) == [-0.5, -1.5]
    assert [list(t.token_ids) for t in msg.output_top] == [[7, 3], [8, 7]]
    assert [list(t.logprobs) for t in msg.output_top] == [[-0.5, -2.0], [-1.5, -1.75]]
    assert not msg.input_logprobs and not msg.input_token_ids and msg.input_start == 0


def test_token_ids_logprob_in_and_out() -> None:
    asked = common_pb2.SamplingParams(top_p=1.0, max_new_tokens=1, return_logprob=True,
                                      token_ids_logprob=[9, 4])
    assert engine_params(asked).token_ids_logprob == (9, 4)
    asked.return_logprob = False  # ignored without return_logprob
    assert engine_params(asked).token_ids_logprob == ()
    out = _step(output_logprobs=[-0.5], output_token_ids_logprobs=[[(9, -3.0), (4, -0.25)]])
    msg = common_pb2.Logprobs()
    fill_logprobs(msg, out, [])
    [entry] = msg.output_token_ids_logprobs
    assert list(entry.token_ids) == [9, 4] and list(entry.logprobs) == [-3.0, -0.25]
    assert has_logprobs(_step(output_token_ids_logprobs=[[(9, -3.0)]]))


def test_prefill_only_outputs_carry_prompt_and_next_position_logprobs() -> None:
    """max_new_tokens 0: no token, but the asked ids' logprobs at the prompt positions and at
    the position after the prompt (one entry, with no output_logprobs beside it)."""
    out = _step(new_token_ids=[], finished=True, finish_reason="length", completion_tokens=0,
                input_logprob_start=0, input_logprobs=[None, -1.0],
                input_token_ids_logprobs=[[], [(9, -2.0)]],
                output_token_ids_logprobs=[[(9, -0.5)]], output_top_logprobs=[[(3, -0.1)]])
    assert has_logprobs(out)
    msg = common_pb2.Logprobs()
    fill_logprobs(msg, out, [1, 2])
    assert not msg.output_logprobs and [list(t.token_ids) for t in msg.output_top] == [[3]]
    assert [list(t.logprobs) for t in msg.output_token_ids_logprobs] == [[-0.5]]
    assert [list(t.token_ids) for t in msg.input_token_ids_logprobs] == [[], [9]]
    assert list(msg.input_token_ids) == [1, 2]
    assert has_logprobs(_step(input_token_ids_logprobs=[[(9, -2.0)]]))


def test_input_logprobs_carry_their_prompt_ids_and_nan_for_position_0() -> None:
    out = _step(output_logprobs=[-0.25], input_logprob_start=0,
                input_logprobs=[None, -1.0, -2.0, -3.0],
                input_top_logprobs=[[], [(5, -0.5)], [(6, -0.75)], [(1, -1.0)]])
    msg = common_pb2.Logprobs()
    fill_logprobs(msg, out, [1, 2, 3, 4])
    assert list(msg.input_token_ids) == [1, 2, 3, 4]
    assert math.isnan(msg.input_logprobs[0]) and list(msg.input_logprobs[1:]) == [-1, -2, -3]
    assert [list(t.token_ids) for t in msg.input_top] == [[], [5], [6], [1]]
    # From a later position: ids of [start, prompt_tokens) only.
    msg = common_pb2.Logprobs()
    fill_logprobs(msg, _step(input_logprob_start=2, input_logprobs=[-2.0, -3.0]), [1, 2, 3, 4])
    assert msg.input_start == 2 and list(msg.input_token_ids) == [3, 4]


def test_token_output_sends_logprobs_only_when_there_are_some() -> None:
    tracked = _tracked()
    assert not token_output(_step(), tracked).HasField("logprobs")
    msg = token_output(_step(output_logprobs=[-0.5]), tracked)
    assert msg.HasField("logprobs") and list(msg.logprobs.output_logprobs) == [-0.5]


def test_token_output_header_and_prompt_ids_for_input_logprobs() -> None:
    tracked = _tracked(return_text_in_logprobs=True, prompt_ids=[1, 2, 3, 4])
    first = token_output(_step(output_logprobs=[-0.5], input_logprob_start=1,
                         input_logprobs=[-1.0, -2.0, -3.0]), tracked)
    assert first.header.meta.sampling.return_text_in_logprobs
    assert list(first.logprobs.input_token_ids) == [2, 3, 4]
    assert tracked.prompt_ids == []  # sent once: not kept for the request's lifetime
    second = token_output(_step(output_logprobs=[-0.75]), tracked)
    assert not second.HasField("header") and not second.logprobs.input_token_ids


def test_tracked_keeps_the_prompt_only_for_prompt_logprobs() -> None:
    req = scheduler_pb2.TokenizedRequest(input_ids=[1, 2, 3], meta=common_pb2.RequestMeta(
        rid="r", route=common_pb2.Route(detokenizer="d"), deadline=5.0,
        sampling=common_pb2.SamplingParams(top_p=1.0, return_logprob=True, logprob_start_len=-1,
                                           stop=["x"], skip_special_tokens=True)))
    tracked = tracked_of(req, trace.INVALID_SPAN)
    assert tracked.prompt_ids == [] and tracked.prompt_tokens == 3 and tracked.meta.deadline == 5.0
    assert tracked.meta.sampling.stop == ["x"] and tracked.meta.sampling.skip_special_tokens
    req.meta.sampling.logprob_start_len = 0
    assert tracked_of(req, trace.INVALID_SPAN).prompt_ids == [1, 2, 3]


def test_the_prompt_ids_go_back_in_the_header_when_asked() -> None:
    meta = common_pb2.RequestMeta(rid="r", return_prompt_ids=True,
                                  route=common_pb2.Route(detokenizer="d"))
    tracked = tracked_of(scheduler_pb2.TokenizedRequest(meta=meta, input_ids=[5, 6, 7]),
                         trace.INVALID_SPAN)
    first = token_output(_step(), tracked)
    assert list(first.header.prompt_ids) == [5, 6, 7]
    assert tracked.prompt_ids == []  # sent: not kept for the request's lifetime
    meta.return_prompt_ids = False
    plain = tracked_of(scheduler_pb2.TokenizedRequest(meta=meta, input_ids=[5, 6, 7]),
                       trace.INVALID_SPAN)
    assert not token_output(_step(), plain).header.prompt_ids


def test_prompt_ranks_go_beside_the_prompt_logprobs() -> None:
    msg = common_pb2.Logprobs()
    fill_logprobs(msg, _step(input_logprob_start=0, input_logprobs=[None, -1.0, -2.0],
                             input_ranks=[0, 3, 1]), [1, 2, 3])
    assert list(msg.input_ranks) == [0, 3, 1]


def test_the_first_outputs_header_carries_the_requests_meta_whole() -> None:
    meta = common_pb2.RequestMeta(
        rid="r", stream=True, return_text=True, arrival_time=1.5, after="r0", deadline=9.0,
        route=common_pb2.Route(gateway="g", scheduler="s", detokenizer="d"),
        sampling=common_pb2.SamplingParams(top_p=1.0, stop=["x"], skip_special_tokens=True))
    req = scheduler_pb2.TokenizedRequest(meta=meta, input_ids=[1, 2, 3])
    tracked = tracked_of(req, trace.INVALID_SPAN)
    req.meta.rid = "changed"  # the tracked meta is a copy, not a view of the received batch
    first = token_output(_step(), tracked)
    assert first.header.meta == meta and first.header.prompt_tokens == 3
    assert not token_output(_step(), tracked).HasField("header")


def test_error_outputs_carry_grpcs_status_numbers() -> None:
    for code in Code:
        assert code == grpc.StatusCode[code.name].value[0], code
    msg = token_output(_step(finished=True, finish_reason="error", error="late"),
                       _tracked(error_code=Code.DEADLINE_EXCEEDED))
    assert msg.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert msg.error.message == "late"


def test_load_carries_the_stats() -> None:
    stats = {"running": 2, "waiting": 1, "max_running": 8, "finished_total": 5,
             "aborted_total": 1, "generated_tokens_total": 40, "token_usage": 0.25, "paused": None}
    load = load_of("s:1", stats)
    assert (load.address, load.running, load.waiting, load.max_running) == ("s:1", 2, 1, 8)
    assert (load.finished_total, load.aborted_total, load.generated_tokens_total) == (5, 1, 40)
    assert load.token_usage == 0.25 and json.loads(load.json_info) == stats
