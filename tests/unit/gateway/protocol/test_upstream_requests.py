"""Upstream's newer request fields at the gateway: session_id and priority are carried on (the
routing key, the scheduler's queue order), seed=16 reaches the engine's params, and what meshlm
does not serve yet (reasoning budgets) is refused UNIMPLEMENTED naming the field; in gRPC
messages and in native /generate bodies alike. Guided decoding's constraints, structural tags
among them, become the grammar the engine follows."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
import llguidance
import orjson
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.mesh.wire import tokenizer_request
from meshlm.gateway.protocol import native
from meshlm.gateway.protocol.choices import fan_out
from meshlm.gateway.protocol.validation import Limits, validate_generate, validate_text_generate
from meshlm.v1 import common_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

LIMITS = Limits(max_model_len=256, vocab_size=100)
TAG = orjson.dumps({"type": "structural_tag", "format": {
    "type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}}).decode()
GUIDED = [("json_schema", "{}"), ("regex", "a+"), ("ebnf", 'root ::= "a"'),
               ("choice", pb.ChoiceConstraint(values=["yes", "no"])), ("structural_tag", TAG)]


def _refusal(fn: Any, *args: Any) -> MeshError:
    with pytest.raises(MeshError) as info:
        fn(*args)
    return info.value


def test_session_id_and_priority_are_carried_and_default_to_none_and_zero() -> None:
    v = validate_text_generate(pb.TextGenerateRequest(text="a", session_id="conv-9",
                                                      priority=-4), LIMITS)
    assert (v.session_id, v.priority) == ("conv-9", -4)
    v = validate_generate(pb.GenerateRequest(input_ids=[1, 2], priority=7), LIMITS)
    assert (v.session_id, v.priority) == (None, 7)
    v = validate_text_generate(pb.TextGenerateRequest(text="a"), LIMITS)
    assert (v.session_id, v.priority) == (None, 0)


def test_the_priority_rides_in_every_childs_request_meta() -> None:
    v = validate_text_generate(pb.TextGenerateRequest(
        text="a", priority=12, sampling_params=pb.SamplingParams(n=2, seed=5)), LIMITS)
    metas = [tokenizer_request(v, child, common_pb2.Route(), {}, 0.0, None, 256).meta
             for child in fan_out("r", v.n, v.sampling)]
    assert [(m.rid, m.priority, m.sampling.seed) for m in metas] == [("r-0", 12, 5),
                                                                     ("r-1", 12, 6)]


@pytest.mark.parametrize("fields,name", [
    ({"require_reasoning": True, "sampling_params": pb.SamplingParams(regex="a+")},
     "require_reasoning"),
    ({"max_thinking_tokens": 0}, "max_thinking_tokens"),
    ({"max_thinking_tokens": 512, "require_reasoning": False}, "max_thinking_tokens"),
])
def test_reasoning_options_need_a_reasoning_parser(fields: dict[str, Any], name: str) -> None:
    for validate, req in ((validate_text_generate, pb.TextGenerateRequest(text="a", **fields)),
                          (validate_generate, pb.GenerateRequest(input_ids=[1], **fields))):
        err = _refusal(validate, req, LIMITS)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.message.startswith(f"{name}: needs a gateway started with --reasoning-parser")


def test_reasoning_options_with_a_reasoning_parser() -> None:
    """max_thinking_tokens: a budget between the parser's tags (at most the context);
    require_reasoning: the constraint applies once the thinking ends (SGLang's meaning)."""
    limits = dataclasses.replace(LIMITS, thinking_tags=("<think>", "</think>"))
    for asked, kept in ((0, 0), (40, 40), (10**6, LIMITS.max_model_len)):
        v = validate_text_generate(pb.TextGenerateRequest(text="a", max_thinking_tokens=asked),
                                   limits)
        assert v.sampling.thinking_budget == common_pb2.ThinkingBudget(
            tokens=kept, open="<think>", close="</think>")
    assert not validate_text_generate(pb.TextGenerateRequest(text="a"), limits).sampling.HasField(
        "thinking_budget")
    v = validate_generate(pb.GenerateRequest(input_ids=[1], require_reasoning=True,
                                             sampling_params=pb.SamplingParams(
                                                 regex="(yes|no)")), limits)
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), v.sampling.grammar)
    assert matcher.consume_tokens(list(b"hmm, no?</think>yes")) and matcher.is_accepting()
    assert not validate_text_generate(pb.TextGenerateRequest(
        text="a", require_reasoning=True), LIMITS).sampling.grammar  # nothing to put after it


def test_require_reasoning_false_is_the_default_and_accepted() -> None:
    assert validate_text_generate(pb.TextGenerateRequest(text="a", require_reasoning=False),
                                  LIMITS).priority == 0


@pytest.mark.parametrize("kind,value", GUIDED, ids=[k for k, _ in GUIDED])
def test_guided_decoding_becomes_a_grammar(kind: str, value: Any) -> None:
    params = pb.SamplingParams(guided_decoding=pb.GuidedDecoding(**{kind: value}))
    request = pb.TextGenerateRequest(text="a", sampling_params=params)
    grammar = validate_text_generate(request, LIMITS).sampling.grammar
    assert grammar  # an llguidance grammar (its JSON or Lark text), carried to the engine
    # The same constraint by upstream's older fields gives the same grammar.
    if kind in ("json_schema", "regex"):
        older = pb.SamplingParams(**{kind: value})
        assert validate_text_generate(pb.TextGenerateRequest(
            text="a", sampling_params=older), LIMITS).sampling.grammar == grammar


def test_seed_at_upstreams_number_reaches_the_internal_params() -> None:
    v = validate_text_generate(pb.TextGenerateRequest.FromString(
        b"\x0a\x01a" + b"\x12\x03" + bytes([16 << 3, 1, 42])), LIMITS)  # text, {seed: 42}
    assert v.sampling.HasField("seed") and v.sampling.seed == 42


def test_native_body_takes_upstreams_fields_one_per_prompt_or_one_for_all() -> None:
    reqs, batch = native.native_generate_requests(orjson.dumps({
        "text": ["a", "b"], "priority": [5, -1], "session_id": "conv",
        "require_reasoning": False, "sampling_params": {"seed": 3}}))
    assert batch and [(r.priority, r.session_id, r.sampling_params.seed) for r in reqs] == [
        (5, "conv", 3), (-1, "conv", 3)]
    one = native.native_generate_request(orjson.dumps({
        "input_ids": [1, 2], "max_thinking_tokens": 9,
        "sampling_params": {"guided_decoding": {"choice": {"values": ["x"]}}}}))
    assert isinstance(one, pb.GenerateRequest) and one.max_thinking_tokens == 9
    assert one.sampling_params.guided_decoding.choice.values == ["x"]


def test_native_constraint_params_go_where_the_proto_has_them() -> None:
    """SGLang's native ebnf and structural_tag are guided_decoding's; json_schema and
    structural_tag may be an object or its text."""
    one = native.native_generate_request(orjson.dumps(
        {"text": "a", "sampling_params": {"ebnf": "root ::= \"a\""}}))
    assert one.sampling_params.guided_decoding.ebnf == 'root ::= "a"'
    one = native.native_generate_request(orjson.dumps(
        {"text": "a", "sampling_params": {"json_schema": {"type": "integer"}}}))
    assert orjson.loads(one.sampling_params.json_schema) == {"type": "integer"}
    for tag in (TAG, orjson.loads(TAG)):
        one = native.native_generate_request(orjson.dumps(
            {"text": "a", "sampling_params": {"structural_tag": tag}}))
        assert orjson.loads(one.sampling_params.guided_decoding.structural_tag) == orjson.loads(
            TAG)
    err = _refusal(validate_text_generate, pb.TextGenerateRequest(
        text="a", sampling_params=pb.SamplingParams(guided_decoding=pb.GuidedDecoding(
            structural_tag='{"format": {"type": "tag"}}'))), LIMITS)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == ("sampling_params.guided_decoding.structural_tag.format.begin: is "
                           "required")


def test_native_fields_sglang_clients_send_at_their_defaults() -> None:
    """A client sending SGLang's whole request object: unserved fields at their defaults are
    taken (log_metrics, spaces_between_special_tokens: any value), sampling_seed is the seed;
    any other value of an unserved field is UNIMPLEMENTED by name."""
    one = native.native_generate_request(orjson.dumps({
        "text": "a", "return_hidden_states": False, "return_routed_experts": False,
        "custom_logit_processor": None, "log_metrics": True, "sampling_params": {
            "sampling_seed": 7, "stop_regex": [], "custom_params": None,
            "spaces_between_special_tokens": False}}))
    assert one.sampling_params.seed == 7
    for doc, path in (({"return_hidden_states": True}, "return_hidden_states"),
                      ({"custom_logit_processor": "{}"}, "custom_logit_processor"),
                      ({"sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
                      ({"sampling_params": {"custom_params": {"thinking_budget": 9}}},
                       "sampling_params.custom_params")):
        err = _refusal(native.native_generate_request, orjson.dumps({"text": "a", **doc}))
        assert err.code == grpc.StatusCode.UNIMPLEMENTED and err.message.startswith(f"{path}: ")
    err = _refusal(native.native_generate_request, orjson.dumps(
        {"text": "a", "sampling_params": {"seed": 1, "sampling_seed": 2}}))
    assert err.message.startswith("sampling_params.sampling_seed: give seed or sampling_seed")
