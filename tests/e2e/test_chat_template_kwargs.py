"""chat_template_kwargs (vLLM's and SGLang's field): the client's variables reach the
checkpoint's chat template, on a chat completion and on /v1/tokenize alike, and the names the
tokenizer sets itself are refused. The mesh serves a copy of the default model whose template
ends a prompt with "/no_think" when it is given enable_thinking: false (as Qwen3's does)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from helpers import chatml, own_mesh

from meshlm.common.default_model import ensure_default_model
from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

USER = [{"role": "user", "content": "Name three rivers."}]
NO_THINK = "/no_think"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    model = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(ensure_default_model(None), model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] += ("{%- if enable_thinking is defined and not enable_thinking %}"
                                f"{{{{- '{NO_THINK}' }}}}{{%- endif %}}")
    config_path.write_text(json.dumps(config))
    with own_mesh(tmp_path_factory.mktemp("mesh"), model_path=str(model)) as m:
        yield m


def prompt_tokens(mesh: Mesh, text: str) -> int:
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{mesh.addresses.gateway_http}/tokenize",
                      json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_the_variables_reach_the_template(mesh: Mesh, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id

    def chat(**extra: object) -> int:
        reply = client.chat.completions.create(model=model, messages=USER, max_tokens=2,
                                               temperature=0, extra_body=extra)
        return reply.usage.prompt_tokens

    plain = prompt_tokens(mesh, chatml(USER))
    with_flag = prompt_tokens(mesh, chatml(USER) + NO_THINK)
    assert with_flag > plain
    assert chat() == plain
    assert chat(chat_template_kwargs={"enable_thinking": True}) == plain
    assert chat(chat_template_kwargs={"enable_thinking": False}) == with_flag
    # /v1/tokenize renders a chat the same way.
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/tokenize", timeout=60, json={
        "messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == with_flag
    # And so does the ChatComplete RPC, which takes the OpenAI body.
    body = {"model": model, "messages": USER, "max_tokens": 1,
            "chat_template_kwargs": {"enable_thinking": False}}
    with grpc.insecure_channel(mesh.addresses.gateway_grpc) as ch:
        [whole] = list(sglang_pb2_grpc.SglangServiceStub(ch).ChatComplete(
            pb.OpenAIRequest(json_body=json.dumps(body).encode()), timeout=60))
    assert json.loads(whole.json_chunk)["usage"]["prompt_tokens"] == with_flag


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"bos_token": "x"}, "chat_template_kwargs.bos_token"),
    ([1], "chat_template_kwargs"),
])
def test_the_tokenizers_own_names_and_non_objects_are_400(mesh: Mesh, client: openai.OpenAI,
                                                          kwargs: object, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=USER, max_tokens=2,
                                       extra_body={"chat_template_kwargs": kwargs})
    assert info.value.body["param"] == param
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/tokenize", timeout=60,
                   json={"messages": USER, "chat_template_kwargs": kwargs})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{param}: ")


def test_a_plain_prompt_takes_no_template_variables(mesh: Mesh) -> None:
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/tokenize", timeout=60,
                   json={"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "chat_template_kwargs: is for a chat's messages"
