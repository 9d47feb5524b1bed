"""Thinking budgets end to end (SGLang's max_thinking_tokens over gRPC and /generate, vLLM's
thinking_token_budget on the OpenAI routes): on a gateway with a reasoning parser, once the
output has written its budget of tokens inside a thinking its prompt opened, the engine writes
the closing tag and the answer follows. The default model has random weights and never closes
a thinking on its own. SGLang's require_reasoning puts a constraint after the thinking. Without
a reasoning parser both are refused by name."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from helpers import extra_gateway

from meshlm.launch.process import ServiceProcess
from sglang.runtime.v1 import sglang_pb2 as pb

PROMPT = "Why is the sky blue?\n<think>\n"  # a thinking opened, as a chat template opens it


@pytest.fixture(scope="module")
def reasoning_gateway(mesh) -> Iterator[ServiceProcess]:
    yield from extra_gateway(mesh, "budget", reasoning_parser="qwen3")


def _ids(gateway: ServiceProcess, text: str) -> list[int]:
    r = httpx.post(f"{gateway.http_address}/v1/tokenize", timeout=10,
                   json={"prompt": text, "add_special_tokens": False})
    return list(r.json()["tokens"])


def test_the_thinking_closes_when_its_budget_is_spent(reasoning_gateway) -> None:
    closing = _ids(reasoning_gateway, "</think>")
    base = reasoning_gateway.http_address
    for budget in (0, 7):
        r = httpx.post(f"{base}/generate", timeout=60, json={
            "text": PROMPT, "max_thinking_tokens": budget,
            "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "seed": 11,
                                "ignore_eos": True}})
        assert r.status_code == 200, r.text
        ids = r.json()["output_ids"]
        assert ids[budget:budget + len(closing)] == closing, (budget, ids)
        assert len(ids) == 24  # the answer goes on after it
    free = httpx.post(f"{base}/generate", timeout=60, json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 1.0,
                                            "seed": 11, "ignore_eos": True}})
    assert "</think>" not in free.json()["text"]


def test_vllms_budget_on_a_chat_continued_in_thought(reasoning_gateway, model) -> None:
    """The assistant's turn continued after "<think>\\n": the chat's thinking is cut at its
    budget, and the reasoning parser splits it from the answer."""
    closing = _ids(reasoning_gateway, "</think>")
    client = openai.OpenAI(base_url=f"{reasoning_gateway.http_address}/v1", api_key="x")
    reply = client.chat.completions.create(
        model=model, max_tokens=20, temperature=0, messages=[
            {"role": "user", "content": "Why is the sky blue?"},
            {"role": "assistant", "content": "<think>\n"}],
        extra_body={"thinking_token_budget": 5, "continue_final_message": True,
                    "add_generation_prompt": False, "return_token_ids": True,
                    "ignore_eos": True, "separate_reasoning": False})
    choice = reply.choices[0]
    assert choice.model_dump()["token_ids"][5:5 + len(closing)] == closing
    assert "</think>" in choice.message.content


def test_require_reasoning_puts_the_constraint_after_the_thinking(reasoning_gateway) -> None:
    r = httpx.post(f"{reasoning_gateway.http_address}/generate", timeout=60, json={
        "text": PROMPT, "require_reasoning": True, "max_thinking_tokens": 6,
        "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "seed": 2,
                            "regex": "(yes|no)"}})
    assert r.status_code == 200, r.text
    thought, _, answer = r.json()["text"].partition("</think>")
    assert answer.strip() in ("yes", "no"), r.json()["text"]
    assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"


def test_without_a_reasoning_parser_budgets_are_refused_by_name(mesh, stub, client,
                                                                model) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.TextGenerate(pb.TextGenerateRequest(text="hi", max_thinking_tokens=8),
                               timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("max_thinking_tokens: needs a gateway started with "
                                          "--reasoning-parser")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", max_tokens=2,
                                  extra_body={"thinking_token_budget": 8})
    assert info.value.body["param"] == "thinking_token_budget", info.value.body
