"""Bad input is refused by the gateway with INVALID_ARGUMENT / HTTP 400 naming the field,
before any internal service does work, and the mesh keeps serving."""

from __future__ import annotations

import grpc
import httpx
import pytest
from helpers import mesh_credentials, scheduler_load

from sglang.runtime.v1 import sglang_pb2 as pb

CASES = [
    ("empty text", pb.TextGenerateRequest(text=""), "text"),
    ("min_new_tokens past max_new_tokens 0", pb.TextGenerateRequest(
        text="hi", sampling_params=pb.SamplingParams(max_new_tokens=0, min_new_tokens=1)),
     "min_new_tokens"),
    ("max_new_tokens negative", pb.TextGenerateRequest(
        text="hi", sampling_params=pb.SamplingParams(max_new_tokens=-3)), "max_new_tokens"),
    ("temperature < 0", pb.TextGenerateRequest(
        text="hi", sampling_params=pb.SamplingParams(temperature=-0.5)), "temperature"),
    ("top_p 0", pb.TextGenerateRequest(
        text="hi", sampling_params=pb.SamplingParams(top_p=0.0)), "top_p"),
    ("top_p > 1", pb.TextGenerateRequest(
        text="hi", sampling_params=pb.SamplingParams(top_p=1.5)), "top_p"),
    ("prompt longer than context", pb.TextGenerateRequest(text="word " * 5000), "text"),
]


@pytest.mark.parametrize("name,request_,field", CASES, ids=[c[0] for c in CASES])
def test_grpc_invalid_argument_names_field(mesh, stub, name, request_, field):
    creds = mesh_credentials(mesh)
    before = scheduler_load(mesh, creds)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.TextGenerate(request_, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    after = scheduler_load(mesh, creds)
    assert (after.finished_total, after.aborted_total, after.generated_tokens_total) == (
        before.finished_total, before.aborted_total, before.generated_tokens_total)


def test_generate_input_ids_checked(stub):
    for req, field in [
        (pb.GenerateRequest(), "input_ids"),
        (pb.GenerateRequest(input_ids=[10**7]), "input_ids"),
        (pb.GenerateRequest(input_ids=[1] * 4000), "input_ids"),
        (pb.GenerateRequest(input_ids=[1, 2],
                            sampling_params=pb.SamplingParams(max_new_tokens=10**6)),
         "max_new_tokens"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()


@pytest.mark.parametrize("body,field", [
    ({"text": "", "sampling_params": {}}, "text"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 2}}, "top_p"),
    ({"text": "hi", "input_ids": [1, 2]}, "input_ids"),
    ({"sampling_params": {}}, "text"),
    ({"text": "hi", "sampling_params": {"no_such_knob": 1}}, "no_such_knob"),
])
def test_http_400_names_field(mesh, body, field):
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.text


def test_http_malformed_json(mesh):
    base = mesh.addresses.gateway_http
    r = httpx.post(f"{base}/generate", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.text
    r = httpx.post(f"{base}/v1/runtime/text_generate", content=b"[1,", timeout=30)
    assert r.status_code == 400
    assert r.json()["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_mesh_still_serves_after_bad_input(stub):
    out = list(stub.TextGenerate(pb.TextGenerateRequest(
        text="still here", sampling_params=pb.SamplingParams(max_new_tokens=4, ignore_eos=True))))
    assert out[-1].finished and out[-1].meta_info["completion_tokens"] == "4"
