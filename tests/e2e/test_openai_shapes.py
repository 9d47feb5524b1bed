"""The OpenAI routes in the shapes SGLang's and vLLM's own test suites check, end to end: a
stream's finish_reason rides on its last text and logprobs (no empty closing chunk), every
completion chunk with text carries its logprobs, chat deltas say "reasoning_content": null,
`logprobs: 0` gives the chosen token's entry per position (streaming and echoed), a token-id
prompt is echoed without special tokens, and chat's continue_final_message and echo (vLLM's)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest
from helpers import chatml

from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2 as pb

PROMPT = "Once upon a time"
USER = [{"role": "user", "content": "Tell me a story about the sea."}]
OPENED = [*USER, {"role": "assistant", "content": "Once upon a time, a"}]


def _events(mesh: Mesh, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed POST to an OpenAI route, as sent (no client library)."""
    keys = mesh.options.api_keys
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    events = []
    with httpx.stream("POST", f"{mesh.addresses.gateway_http}{path}", json=body,
                      headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(orjson.loads(line[len("data: "):]))
    return events


def _check_positions(lp: Any, top: int, first_is_none: bool = False) -> None:
    """Each position's top_logprobs: null where the token has no logprob (the prompt's first),
    else between max(top, 1) and top + 1 entries, the chosen token's among them."""
    for i, (token, value, alternatives) in enumerate(
            zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)):
        if i == 0 and first_is_none:
            assert value is None and alternatives is None
            continue
        assert max(top, 1) <= len(alternatives) <= top + 1
        assert alternatives[token] == pytest.approx(value)


@pytest.mark.parametrize("top", [0, 2])
def test_completion_stream_ends_with_its_last_text_and_logprobs(client, model, top) -> None:
    ask = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
           "logprobs": top, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**ask).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True)]
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "".join(c.text for c in chunks) == whole.text
    # No chunk without text or tokens: the last one brings the last token.
    assert all(c.text and c.logprobs.tokens for c in chunks)
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens
    for c in [whole, *chunks]:
        _check_positions(c.logprobs, top)


def test_logprobs_zero_with_echo_streamed_and_not(client, model, stub) -> None:
    prompt_tokens = len(stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).tokens)
    ask = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
           "logprobs": 0, "echo": True}
    whole = client.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.text.startswith(PROMPT)
    assert len(choice.logprobs.tokens) == whole.usage.prompt_tokens + 4 == prompt_tokens + 4
    _check_positions(choice.logprobs, 0, first_is_none=True)
    chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True)]
    assert chunks[0].text.startswith(PROMPT) and "".join(c.text for c in chunks) == choice.text
    _check_positions(chunks[0].logprobs, 0, first_is_none=True)
    for c in chunks[1:]:
        _check_positions(c.logprobs, 0)
    assert [t for c in chunks for t in c.logprobs.tokens] == choice.logprobs.tokens


def test_a_token_id_prompt_is_echoed_without_special_tokens(client, model, stub) -> None:
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=True)).tokens)
    plain = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=False))
                 .tokens)
    assert len(ids) == len(plain) + 1  # the bos token leads
    for stream in (False, True):
        reply = client.completions.create(model=model, prompt=ids, max_tokens=3,
                                          temperature=0, echo=True, stream=stream)
        chunks = list(reply) if stream else [reply]
        assert chunks[0].choices[0].text.startswith(PROMPT)


def test_chat_stream_deltas_as_sglang_sends_them(mesh, model) -> None:
    events = _events(mesh, "/v1/chat/completions", {
        "model": model, "messages": USER, "max_tokens": 8, "temperature": 0, "stream": True,
        "logprobs": True, "ignore_eos": True})
    choices = [e["choices"][0] for e in events]
    assert choices[0]["delta"] == {"role": "assistant", "content": "",
                                   "reasoning_content": None}
    assert all(c["delta"]["reasoning_content"] is None for c in choices)
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    # Every chunk after the role's brings text with its tokens' logprobs, the last one too.
    for c in choices[1:]:
        assert c["delta"]["content"] and c["logprobs"]["content"]
    assert sum(len(c["logprobs"]["content"]) for c in choices[1:]) == 8


def test_chat_continue_final_message_and_echo(client, model, stub) -> None:
    ask = {"model": model, "messages": OPENED, "max_tokens": 6, "temperature": 0,
           "extra_body": {"continue_final_message": True, "add_generation_prompt": False}}
    reply = client.chat.completions.create(**ask)
    # The prompt is the conversation with the assistant's turn left open, not closed.
    opened = chatml(OPENED[:1]) + OPENED[1]["content"]
    prompt = list(stub.Tokenize(pb.TokenizeRequest(text=opened, add_special_tokens=False))
                  .tokens)
    assert reply.usage.prompt_tokens == len(prompt)
    same = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == same.choices[0].text
    echoed = client.chat.completions.create(
        **{**ask, "extra_body": {**ask["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == OPENED[1]["content"] + same.choices[0].text
    chunks = list(client.chat.completions.create(
        **{**ask, "extra_body": {"continue_final_message": True, "echo": True}}, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        echoed.choices[0].message.content
    # Echo repeats only an assistant's message; a user's last message is not echoed.
    plain = {"model": model, "messages": USER, "max_tokens": 6, "temperature": 0}
    assert client.chat.completions.create(**plain, extra_body={"echo": True}).choices[0] \
        .message.content == client.chat.completions.create(**plain).choices[0].message.content


def test_continue_final_message_with_a_generation_prompt_is_400(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=OPENED, extra_body={
            "continue_final_message": True, "add_generation_prompt": True})
    assert info.value.body["param"] == "continue_final_message"


def _folded(chunks: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """What a stream says, whichever way its tokens were grouped into chunks: the text, each
    token's logprob entry, the finish; every chat delta's reasoning_content."""
    choices = [c["choices"][0] for c in chunks]
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
    if chat:
        entries = [e for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
    else:
        entries = [list(x) for c in choices if c.get("logprobs") for x in zip(
            c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"],
            c["logprobs"]["top_logprobs"], strict=True)]
    reasoning = {c["delta"].get("reasoning_content", "absent") for c in choices} if chat else None
    return {"text": text, "entries": entries, "finish": [c["finish_reason"] for c in choices][-1],
            "reasoning": reasoning, "last_has_text": bool(
                choices[-1]["delta"].get("content") if chat else choices[-1]["text"])}


@pytest.mark.parametrize(("rpc", "path", "body"), [
    ("ChatComplete", "/v1/chat/completions",
     {"messages": OPENED, "continue_final_message": True, "echo": True, "logprobs": True,
      "top_logprobs": 0}),
    ("Complete", "/v1/completions", {"prompt": [1, 5, 6, 7], "echo": True, "logprobs": 0}),
], ids=["chat", "completion"])
def test_the_grpc_rpcs_answer_as_the_http_routes(mesh, model, stub, rpc, path, body) -> None:
    """The OpenAI-shaped RPCs stream what the routes stream: finish on the last text,
    reasoning_content null, continue_final_message and echo, logprobs 0."""
    body = {**body, "model": model, "max_tokens": 6, "temperature": 0, "stream": True}
    chat = rpc == "ChatComplete"
    over_http = _folded(_events(mesh, path, body), chat)
    over_grpc = _folded([orjson.loads(c.json_chunk) for c in getattr(stub, rpc)(
        pb.OpenAIRequest(json_body=orjson.dumps(body)), timeout=120)], chat)
    assert over_grpc == over_http
    assert over_grpc["finish"] == "length" and over_grpc["last_has_text"]
    if chat:
        assert over_grpc["text"].startswith(OPENED[1]["content"])  # echoed, then continued
        assert over_grpc["reasoning"] == {None}
    else:
        assert over_grpc["entries"][0][2] is None  # the prompt's first position
        assert all(len(e[2]) == 1 for e in over_grpc["entries"][1:])  # logprobs 0: the chosen
