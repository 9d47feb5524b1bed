"""Two generations of SGLang clients against the real gateway: one built from the RFC's proto
(disaggregated_params at 13 / 12, no seed) and one from upstream's main (session_id at 13 / 12,
seed at 16, priority), their message types built here from the descriptors written down in
tests/sglang_upstream.py (not fetched), their bytes sent over gRPC as they are. Then, over gRPC
and HTTP (native /generate and the transcoded /v1/runtime routes): seed=16 gives the same
tokens for the same seed, reasoning options are refused by name where the gateway has no
reasoning parser, and guided decoding's constraints (a structural tag among them) are
followed."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest
from sglang_upstream import PACKAGE, client_types, rfc_era
from sglang_upstream import UPSTREAM as UPSTREAM_TABLE

from sglang.runtime.v1 import sglang_pb2 as pb

RFC = client_types("rfc_era", rfc_era())
UPSTREAM = client_types("upstream_era", UPSTREAM_TABLE)


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


NEEDS_A_PARSER = "needs a gateway started with --reasoning-parser"
REASONING = [
    ({"require_reasoning": True, "sampling_params": {"regex": "a+"}}, "require_reasoning"),
    ({"max_thinking_tokens": 256}, "max_thinking_tokens"),
]


@pytest.mark.parametrize("fields,name", REASONING, ids=[n for _, n in REASONING])
def test_reasoning_options_without_a_reasoning_parser_are_400_everywhere(mesh, stub, fields,
                                                                          name):
    """They need the thinking's tags (tests/e2e/test_thinking_budget.py serves them)."""
    from google.protobuf import json_format

    for method, prompt in ((stub.TextGenerate, {"text": "hi"}),
                           (stub.Generate, {"input_ids": [1, 2]})):
        cls = pb.TextGenerateRequest if "text" in prompt else pb.GenerateRequest
        with pytest.raises(grpc.RpcError) as err:
            list(method(json_format.ParseDict({**prompt, **fields}, cls()), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{name}: {NEEDS_A_PARSER}")
    base = mesh.addresses.gateway_http
    for path, prompt in (("/generate", {"text": "hi"}), ("/generate", {"input_ids": [1, 2]}),
                         ("/v1/runtime/text_generate", {"text": "hi"}),
                         ("/v1/runtime/generate", {"input_ids": [1, 2]})):
        r = httpx.post(f"{base}{path}", json={**prompt, **fields}, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert f"{name}: {NEEDS_A_PARSER}" in r.text, (path, r.text)
    # Without a constraint to put after the thinking, require_reasoning changes nothing.
    r = httpx.post(f"{base}/generate", timeout=30, json={
        "text": "hi", "require_reasoning": True, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def test_guided_decoding_is_followed_by_both_eras(mesh, stub):
    """The RFC's and main's guided_decoding (and SGLang's native ebnf) constrain the output."""
    from google.protobuf import json_format

    tag = json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "y", "content": {"type": "const_string", "value": "es"},
        "end": ""}})
    for guided in ({"choice": {"values": ["yes", "no"]}}, {"regex": "(yes|no)!"},
                   {"structural_tag": tag}):
        request = json_format.ParseDict({"text": "hi", "sampling_params": {
            "max_new_tokens": 20, "guided_decoding": guided}}, pb.TextGenerateRequest())
        messages = list(stub.TextGenerate(request, timeout=30))
        text = "".join(m.text for m in messages)
        assert text in ("yes", "no", "yes!", "no!"), text
        assert messages[-1].meta_info["finish_reason"] == "stop"
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", timeout=30, json={
        "text": "hi", "sampling_params": {"max_new_tokens": 20, "ebnf": 'root ::= "a" "b"?'}})
    assert r.status_code == 200, r.text
    assert r.json()["text"] in ("a", "ab")
