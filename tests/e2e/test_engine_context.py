"""The context length is the engine's: a mesh whose schedulers run with MESHLM_MAX_MODEL_LEN
below the checkpoint's (the default model has 2048 positions) validates against it, reports it
(/v1/models, Tokenize, GetModelInfo) and refuses what cannot fit, with the words SGLang's and
vLLM's clients look for, instead of cutting a generation short."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from helpers import own_mesh

from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

CONTEXT = 256


@pytest.fixture(scope="module")
def short_mesh(tmp_path_factory):
    with own_mesh(tmp_path_factory.mktemp("short"),
                  env={"MESHLM_MAX_MODEL_LEN": str(CONTEXT)}) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def stub(short_mesh):
    with grpc.insecure_channel(short_mesh.addresses.gateway_grpc) as channel:
        yield sglang_pb2_grpc.SglangServiceStub(channel)


@pytest.fixture(scope="module")
def http(short_mesh):
    with httpx.Client(base_url=short_mesh.addresses.gateway_http, timeout=120) as client:
        yield client


def test_the_engines_context_length_is_reported(http, stub):
    [card] = http.get("/v1/models").json()["data"]
    assert card["max_model_len"] == CONTEXT
    assert stub.Tokenize(pb.TokenizeRequest(text="hi")).max_model_len == CONTEXT
    assert http.post("/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == CONTEXT
    facts = json.loads(stub.GetModelInfo(pb.GetModelInfoRequest()).json_info)
    assert facts["max_model_len"] == CONTEXT
    assert http.get("/model_info").json()["max_model_len"] == CONTEXT


def test_a_completion_that_cannot_fit_is_too_large(http, stub):
    req = pb.GenerateRequest(input_ids=[5] * 200, sampling_params=pb.SamplingParams(
        max_new_tokens=100))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is too large" in err.value.details()
    assert "Requested token count exceeds the model's maximum context" in err.value.details()
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 300})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and "max_tokens is too large: 300" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_a_prompt_over_the_engines_context_is_longer_than_it(http, stub):
    text = "hello " * 400  # about 400 tokens: within the checkpoint's 2048, over the engine's
    with pytest.raises(grpc.RpcError) as err:
        list(stub.TextGenerate(pb.TextGenerateRequest(text=text)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is longer than the model's context length" in err.value.details()
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                              "content": text}]})
    assert r.status_code == 400, r.text
    assert "is longer than the model's context length" in r.json()["error"]["message"]
    ids = pb.GenerateRequest(input_ids=[5] * CONTEXT)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(ids))
    assert "is longer than the model's context length" in err.value.details()


def test_what_fits_is_generated_whole(stub):
    req = pb.GenerateRequest(input_ids=[5] * 200, sampling_params=pb.SamplingParams(
        max_new_tokens=CONTEXT - 200, ignore_eos=True, temperature=0.0))
    final = list(stub.Generate(req))[-1]
    assert final.meta_info["finish_reason"] == "length"
    assert int(final.meta_info["completion_tokens"]) == CONTEXT - 200
