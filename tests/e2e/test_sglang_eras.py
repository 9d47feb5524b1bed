"""Two generations of SGLang clients against the real gateway: one built from the RFC's proto
(disaggregated_params at 13 / 12, no seed) and one from upstream's main (session_id at 13 / 12,
seed at 16, priority), their message types built here from descriptors written in this file,
their bytes sent over gRPC as they are. Then, over gRPC and HTTP (native /generate and the
transcoded /v1/runtime routes): seed=16 gives the same tokens for the same seed, and reasoning
options and guided decoding are refused UNIMPLEMENTED / 501 naming what is missing."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from sglang.runtime.v1 import sglang_pb2 as pb

PACKAGE = "sglang.runtime.v1"
_F = descriptor_pb2.FieldDescriptorProto
SCALARS = {"float": _F.TYPE_FLOAT, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64,
           "uint32": _F.TYPE_UINT32, "bool": _F.TYPE_BOOL, "string": _F.TYPE_STRING}

SAMPLING = """
    optional float temperature = 1
    optional float top_p = 2
    optional int32 top_k = 3
    optional float min_p = 4
    optional float frequency_penalty = 5
    optional float presence_penalty = 6
    optional float repetition_penalty = 7
    optional int32 max_new_tokens = 8
    optional int32 min_new_tokens = 9
    repeated string stop = 10
    repeated int32 stop_token_ids = 11
    optional bool ignore_eos = 12
    optional int32 n = 13
    optional string json_schema = 14
    optional string regex = 15"""
TEXT_REQUEST = """
    optional string text = 1
    optional SamplingParams sampling_params = 2
    optional bool stream = 3
    optional bool return_logprob = 4
    optional int32 top_logprobs_num = 5
    optional int32 logprob_start_len = 6
    optional bool return_text_in_logprobs = 7
    optional string rid = 8
    optional string lora_path = 9
    optional string routing_key = 10
    optional int32 routed_dp_rank = 11
    map<string,string> trace_headers = 12"""
IDS_REQUEST = """
    repeated int32 input_ids = 1
    optional SamplingParams sampling_params = 2
    optional bool stream = 3
    optional bool return_logprob = 4
    optional int32 top_logprobs_num = 5
    optional int32 logprob_start_len = 6
    optional string rid = 7
    optional string lora_path = 8
    optional string routing_key = 9
    optional int32 routed_dp_rank = 10
    map<string,string> trace_headers = 11"""
COMMON = {
    "DisaggregatedParams": """
        optional string bootstrap_host = 1
        optional int32 bootstrap_port = 2
        optional int64 bootstrap_room = 3""",
    "TextGenerateResponse": """
        optional string text = 1
        map<string,string> meta_info = 2
        optional bool finished = 3""",
    "GenerateResponse": """
        repeated int32 output_ids = 1
        map<string,string> meta_info = 2
        optional bool finished = 3""",
}
RFC_ERA = {
    **COMMON,
    "SamplingParams": SAMPLING,
    "TextGenerateRequest": TEXT_REQUEST + """
        optional DisaggregatedParams disaggregated_params = 13""",
    "GenerateRequest": IDS_REQUEST + """
        optional DisaggregatedParams disaggregated_params = 12""",
}
UPSTREAM_ERA = {
    **COMMON,
    "SamplingParams": SAMPLING + """
        optional int64 seed = 16""",
    "TextGenerateRequest": TEXT_REQUEST + """
        optional string session_id = 13
        optional DisaggregatedParams disaggregated_params = 14
        optional int32 priority = 15
        optional bool require_reasoning = 16
        optional uint32 max_thinking_tokens = 17""",
    "GenerateRequest": IDS_REQUEST + """
        optional string session_id = 12
        optional DisaggregatedParams disaggregated_params = 13
        optional int32 priority = 14
        optional bool require_reasoning = 15
        optional uint32 max_thinking_tokens = 16""",
}


def client_types(era: str, messages: dict[str, str]) -> dict[str, Any]:
    """Message classes of one client generation, from its table ("[optional | repeated] type
    name = number" a line; maps as map<string,string>). proto2 syntax: `optional` has presence
    without proto3's synthetic oneofs; the wire is the same."""
    file = descriptor_pb2.FileDescriptorProto(name=f"{era}.proto", package=PACKAGE,
                                              syntax="proto2")
    for name, spec in messages.items():
        msg = file.message_type.add(name=name)
        for line in spec.strip().splitlines():
            *label, kind, field, _, number = line.split()
            f = msg.field.add(name=field, number=int(number), label=_F.LABEL_OPTIONAL)
            if kind.startswith("map<"):
                entry = msg.nested_type.add(name=field.title().replace("_", "") + "Entry")
                entry.options.map_entry = True
                for i, part in enumerate(("key", "value"), 1):
                    entry.field.add(name=part, number=i, label=_F.LABEL_OPTIONAL,
                                    type=_F.TYPE_STRING)
                f.label, f.type = _F.LABEL_REPEATED, _F.TYPE_MESSAGE
                f.type_name = f".{PACKAGE}.{name}.{entry.name}"
            elif kind in SCALARS:
                f.type = SCALARS[kind]
                if label == ["repeated"]:
                    f.label = _F.LABEL_REPEATED
            else:
                f.type, f.type_name = _F.TYPE_MESSAGE, f".{PACKAGE}.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(
        f"{PACKAGE}.{name}")) for name in messages}


RFC = client_types("rfc_era", RFC_ERA)
UPSTREAM = client_types("upstream_era", UPSTREAM_ERA)


def call(channel: grpc.Channel, method: str, request: Any, response_type: Any) -> list[Any]:
    """One streaming RPC with the client's own bytes on the wire, its own type parsing them."""
    rpc = channel.unary_stream(f"/{PACKAGE}.SglangService/{method}")  # bytes in, bytes out
    return [response_type.FromString(raw)
            for raw in rpc(request.SerializeToString(), timeout=120)]


def text_of(msgs: list[Any]) -> str:
    assert msgs[-1].finished and msgs[-1].meta_info["finish_reason"] == "length"
    return "".join(m.text for m in msgs)


def test_rfc_era_and_upstream_era_clients_both_work(channel):
    greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    rfc = RFC["TextGenerateRequest"](text="Once upon a time", stream=True,
                                     sampling_params=RFC["SamplingParams"](**greedy))
    upstream = UPSTREAM["TextGenerateRequest"](
        text="Once upon a time", stream=True, session_id="conv-1", priority=3,
        sampling_params=UPSTREAM["SamplingParams"](**greedy))
    rfc_text = text_of(call(channel, "TextGenerate", rfc, RFC["TextGenerateResponse"]))
    assert rfc_text
    assert text_of(call(channel, "TextGenerate", upstream,
                        UPSTREAM["TextGenerateResponse"])) == rfc_text

    def seeded(seed: int) -> str:
        upstream.sampling_params.temperature, upstream.sampling_params.seed = 1.0, seed
        return text_of(call(channel, "TextGenerate", upstream, UPSTREAM["TextGenerateResponse"]))

    first = seeded(1234)
    assert seeded(1234) == first  # seed 16 is honoured, not skipped as an unknown field
    assert {seeded(s) for s in (1, 2, 3)} != {first}

    ids = [5, 6, 7, 8]
    for types, extra in ((RFC, {}), (UPSTREAM, {"session_id": "conv-1", "priority": -2})):
        req = types["GenerateRequest"](input_ids=ids, sampling_params=types["SamplingParams"](
            **greedy), **extra)
        msgs = call(channel, "Generate", req, types["GenerateResponse"])
        assert msgs[-1].finished and len([t for m in msgs for t in m.output_ids]) == 8


def test_seed_16_gives_the_same_tokens_over_grpc_and_http(mesh, stub):
    sampling = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 77}
    base = mesh.addresses.gateway_http
    msgs = list(stub.TextGenerate(pb.TextGenerateRequest(
        text="Roll the dice", sampling_params=pb.SamplingParams(**sampling)), timeout=120))
    over_grpc = [t for m in msgs for t in m.output_ids]
    native = httpx.post(f"{base}/generate", timeout=120, json={
        "text": "Roll the dice", "sampling_params": sampling})
    assert native.status_code == 200, native.text
    transcoded = httpx.post(f"{base}/v1/runtime/text_generate", timeout=120, json={
        "text": "Roll the dice", "sampling_params": sampling})
    assert transcoded.status_code == 200, transcoded.text
    (line,) = [json.loads(x) for x in transcoded.text.splitlines() if x.strip()]
    assert native.json()["output_ids"] == over_grpc == line["result"]["output_ids"]


REFUSED = [
    ({"require_reasoning": True}, "require_reasoning: reasoning models are not supported yet"),
    ({"max_thinking_tokens": 256},
     "max_thinking_tokens: reasoning models are not supported yet"),
    ({"sampling_params": {"guided_decoding": {"regex": "[ab]+"}}},
     "sampling_params.guided_decoding: constrained decoding is not supported yet"),
    ({"sampling_params": {"guided_decoding": {"choice": {"values": ["yes", "no"]}}}},
     "sampling_params.guided_decoding: constrained decoding is not supported yet"),
]


@pytest.mark.parametrize("fields,message", REFUSED, ids=["require_reasoning",
                                                          "max_thinking_tokens",
                                                          "guided_regex", "guided_choice"])
def test_unserved_options_are_unimplemented_everywhere(mesh, stub, fields, message):
    from google.protobuf import json_format

    for method, prompt in ((stub.TextGenerate, {"text": "hi"}),
                           (stub.Generate, {"input_ids": [1, 2]})):
        cls = pb.TextGenerateRequest if "text" in prompt else pb.GenerateRequest
        with pytest.raises(grpc.RpcError) as err:
            list(method(json_format.ParseDict({**prompt, **fields}, cls()), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert err.value.details() == message
    base = mesh.addresses.gateway_http
    for path, prompt in (("/generate", {"text": "hi"}), ("/generate", {"input_ids": [1, 2]}),
                         ("/v1/runtime/text_generate", {"text": "hi"}),
                         ("/v1/runtime/generate", {"input_ids": [1, 2]})):
        r = httpx.post(f"{base}{path}", json={**prompt, **fields}, timeout=30)
        assert r.status_code == 501, (path, r.text)
        assert message in r.text, (path, r.text)


def test_sglangs_native_constraint_params_are_unimplemented_too(mesh):
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", timeout=30, json={
        "text": "hi", "sampling_params": {"ebnf": "root ::= 'a'"}})
    assert r.status_code == 501, r.text
    assert "sampling_params.ebnf: constrained decoding is not supported yet" in r.text
