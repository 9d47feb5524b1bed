"""The OpenAI-compatible API end to end, driven by the official `openai` package: chat and
completions (streaming and not, n > 1, logprobs, seeds, stop), embeddings on an embedding
checkpoint, models, errors through the package's exceptions, the ChatComplete RPC over gRPC,
and an abort when a streaming client leaves."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import openai
import pytest
from helpers import chatml, gateway_load, openai_client, own_mesh, text_request, wait_until
from test_embedding_api import HIDDEN, embedding_checkpoint

from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

USER = [{"role": "user", "content": "Tell me a story about the sea."}]


# ---- models ----------------------------------------------------------------------------------


def test_models_lists_the_served_checkpoint(client: openai.OpenAI, stub) -> None:
    [card] = client.models.list().data
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert card.object == "model" and card.id == info.model_path.rstrip("/").split("/")[-1]


# ---- chat ------------------------------------------------------------------------------------


def test_chat_applies_the_checkpoints_template_and_generates(client, model, stub) -> None:
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=10,
                                           temperature=0)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == model and reply.created > 0
    [choice] = reply.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    # The prompt is the template's rendering, tokenized without extra special tokens.
    prompt = list(stub.Tokenize(pb.TokenizeRequest(text=chatml(USER), add_special_tokens=False))
                  .tokens)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.total_tokens == len(prompt) + reply.usage.completion_tokens
    # The same tokens as a completion give the same text.
    same = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    assert choice.message.content == same.choices[0].text and choice.message.content


def test_add_special_tokens_as_vllm(client, model, mesh, stub) -> None:
    """vLLM's add_special_tokens: on by default for a completion's text (the bos), off for a
    chat (its template writes its own); either way round when asked, /v1/tokenize alike."""
    text = "Once upon a time"
    bare = len(stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=False)).tokens)

    def completion(**extra: object) -> int:
        return client.completions.create(model=model, prompt=text, max_tokens=1,
                                         extra_body=extra).usage.prompt_tokens

    assert completion() == completion(add_special_tokens=True) == bare + 1
    assert completion(add_special_tokens=False) == bare

    def chat(**extra: object) -> int:
        return client.chat.completions.create(model=model, messages=USER, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens

    templated = chat()
    assert chat(add_special_tokens=False) == templated
    assert chat(add_special_tokens=True) == templated + 1  # a second bos, as asked
    counts = [httpx.post(f"{mesh.addresses.gateway_http}/v1/tokenize", timeout=60,
                         json={"messages": USER, **extra}).json()["count"]
              for extra in ({}, {"add_special_tokens": True})]
    assert counts == [templated, templated + 1]


def test_chat_streaming_role_first_then_content_finish_and_usage(client, model) -> None:
    whole = client.chat.completions.create(model=model, messages=USER, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=model, messages=USER, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    *body, finish, usage = chunks
    # The finish comes with the last text.
    assert finish.choices[0].finish_reason == whole.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in [*body, finish]) == \
        whole.choices[0].message.content
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in body)
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.usage.completion_tokens == whole.usage.completion_tokens
    plain = list(client.chat.completions.create(model=model, messages=USER, max_tokens=3,
                                                stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    # vLLM's continuous_usage_stats: every chunk carries the usage so far.
    running = list(client.chat.completions.create(
        model=model, messages=USER, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in running)
    counts = [c.usage.completion_tokens for c in running]
    assert counts == sorted(counts) and counts[0] < counts[-1] == whole.usage.completion_tokens
    # As vLLM's tests read them: the role's chunk counts no token yet, each later chunk more
    # than the one before, and the last (usage alone) as many as the finish's.
    assert counts[0] == 0
    for before, chunk in zip(running, running[1:], strict=False):
        assert chunk.usage.completion_tokens > before.usage.completion_tokens or (
            not chunk.choices and chunk.usage.completion_tokens == before.usage.completion_tokens)
    assert {c.usage.prompt_tokens for c in running} == {whole.usage.prompt_tokens}


def test_chat_n_samples_with_a_seed_repeat_and_differ(client, model) -> None:
    def ask(seed: int) -> list[str]:
        reply = client.chat.completions.create(model=model, messages=USER, max_tokens=10, n=3,
                                               temperature=1.0, seed=seed,
                                               extra_body={"ignore_eos": True})
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert reply.usage.completion_tokens == 3 * 10  # every sample's tokens count
        return [c.message.content for c in reply.choices]

    first = ask(7)
    assert ask(7) == first  # reproducible
    assert len(set(first)) > 1  # the samples differ from each other
    assert ask(8) != first


def test_chat_n_samples_stream_with_their_index(client, model) -> None:
    whole = client.chat.completions.create(model=model, messages=USER, max_tokens=6, n=2,
                                           temperature=1.0, seed=3)
    chunks = list(client.chat.completions.create(model=model, messages=USER, max_tokens=6, n=2,
                                                 temperature=1.0, seed=3, stream=True))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content


def test_chat_logprobs_and_top_logprobs(client, model) -> None:
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    for entry in content:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    streamed = list(client.chat.completions.create(
        model=model, messages=USER, max_tokens=6, temperature=0, logprobs=True, stream=True))
    tokens = [e.token for c in streamed if c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]
    plain = client.chat.completions.create(model=model, messages=USER, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stop_string_ends_the_text_before_it(client, model) -> None:
    def complete(keep: str = "", **kwargs: object) -> tuple[str, str | None]:
        choice = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True, **({keep: True} if keep else {})},
            **kwargs).choices[0]
        return choice.text, choice.finish_reason

    def chat(keep: str = "", **kwargs: object) -> tuple[str, str | None]:
        choice = client.chat.completions.create(
            model=model, messages=USER, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True, **({keep: True} if keep else {})},
            **kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason

    for ask in (complete, chat):
        text, reason = ask()
        assert reason == "length"
        # Three ASCII characters from the middle of the greedy text.
        at = next(i for i in range(len(text) // 3, len(text) - 3) if text[i:i + 3].isascii())
        stop = text[at:at + 3]
        assert ask(stop=["never said", stop]) == (text[:text.index(stop)], "stop")
        # Kept in the text by vLLM's include_stop_str_in_output or SGLang's no_stop_trim.
        kept = (text[:text.index(stop) + len(stop)], "stop")
        assert ask("include_stop_str_in_output", stop=[stop]) == kept
        assert ask("no_stop_trim", stop=[stop]) == kept


# ---- completions -----------------------------------------------------------------------------


def test_completion_matches_text_generate(client, model, stub) -> None:
    prompt = "The quick brown fox"
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    expected = "".join(m.text for m in stub.TextGenerate(
        text_request(prompt, stream=False, max_new_tokens=10), timeout=120))
    assert reply.choices[0].text == expected and expected
    assert reply.usage.completion_tokens == 10 or reply.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_completion_batch_of_prompts_with_n_samples(client, model) -> None:
    prompts = ["The sea", [5, 6, 7, 8]]
    reply = client.completions.create(model=model, prompt=prompts, max_tokens=5, n=2,
                                      temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0)
             for p in prompts]
    texts = [c.text for c in reply.choices]
    assert texts == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert reply.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)


def test_completion_logprobs_and_echo(client, model) -> None:
    reply = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                      temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(value)
    echoed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                       temperature=0, logprobs=0, echo=True)
    choice = echoed.choices[0]
    assert choice.text == "Once upon a time" + reply.choices[0].text
    assert choice.logprobs.token_logprobs[0] is None  # the prompt's first token has none
    assert len(choice.logprobs.tokens) == echoed.usage.prompt_tokens + 5
    assert choice.logprobs.tokens[-5:] == lp.tokens


# ---- errors ----------------------------------------------------------------------------------


def test_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    error = info.value.body
    assert info.value.status_code == 404 and error["code"] == "model_not_found"
    assert error["param"] == "model" and "gpt-4o" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 17}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
])
def test_bad_chat_fields_are_400_naming_the_field(client, model, kwargs, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=USER, **kwargs)
    assert info.value.body["param"] == param
    assert info.value.body["message"].startswith(f"{param}: ")
    assert info.value.body["type"] == "invalid_request_error"


def test_too_long_for_the_context_is_400(client, model, stub) -> None:
    context = json.loads(stub.GetModelInfo(pb.GetModelInfoRequest()).json_info)[
        "max_model_len"]
    long_text = "word " * context
    for call in (
        lambda: client.completions.create(model=model, prompt=long_text, max_tokens=4),
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": long_text}], max_tokens=4),
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=context),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["code"] == "context_length_exceeded"
        assert info.value.body["param"] in ("prompt", "messages", "max_tokens")


# ---- gRPC ------------------------------------------------------------------------------------


def test_chat_complete_rpc(mesh, stub, client, model) -> None:
    request = {"model": model, "messages": USER, "max_tokens": 8, "temperature": 0}
    [whole] = list(stub.ChatComplete(pb.OpenAIRequest(json_body=json.dumps(request).encode()),
                                     timeout=120))
    assert whole.finished
    body = json.loads(whole.json_chunk)
    http = client.chat.completions.create(**request)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == http.choices[0].message.content
    assert body["usage"]["prompt_tokens"] == http.usage.prompt_tokens
    chunks = list(stub.ChatComplete(pb.OpenAIRequest(json_body=json.dumps(
        {**request, "stream": True}).encode()), timeout=120))
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    events = [json.loads(c.json_chunk) for c in chunks]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "",
                                                "reasoning_content": None}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == \
        http.choices[0].message.content
    # The same RPC transcoded to HTTP: NDJSON lines of {"result": chunk}, bytes as base64.
    transcoded = httpx.post(f"{mesh.addresses.gateway_http}/v1/runtime/chat_complete", json={
        "json_body": base64.b64encode(json.dumps(request).encode()).decode()}, timeout=120)
    [line] = [json.loads(x) for x in transcoded.text.splitlines()]
    assert line["result"]["finished"] is True
    assert json.loads(base64.b64decode(line["result"]["json_chunk"]))["choices"] == \
        body["choices"]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.ChatComplete(pb.OpenAIRequest(json_body=b'{"messages": []}'), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith("messages: ")


# ---- abort -----------------------------------------------------------------------------------


def test_a_streaming_client_that_leaves_aborts_its_request(client, model, stub) -> None:
    before = gateway_load(stub)["aborted_total"]
    stream = client.chat.completions.create(
        model=model, messages=USER, max_tokens=1500, stream=True,
        extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_until(lambda: gateway_load(stub)["aborted_total"] > before, 30, "the abort")
    wait_until(lambda: gateway_load(stub)["running"] == 0, 30, "nothing running")


# ---- embeddings ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A small embedding-only checkpoint (as test_embedding_api builds it), its own mesh."""
    model_path = tmp_path_factory.mktemp("openai-embedder")
    embedding_checkpoint(model_path)
    with own_mesh(tmp_path_factory.mktemp("openai-embed-mesh"), model_path=str(model_path)) as m:
        yield m


def test_embeddings(embed_mesh: Mesh) -> None:
    client = openai_client(embed_mesh)
    model = client.models.list().data[0].id
    with grpc.insecure_channel(embed_mesh.addresses.gateway_grpc) as channel:
        stub = sglang_pb2_grpc.SglangServiceStub(channel)
        texts = ["The quick brown fox", "A different sentence"]
        expected = [list(stub.TextEmbed(pb.TextEmbedRequest(text=t), timeout=60).embedding)
                    for t in texts]
        tokens = list(stub.Tokenize(pb.TokenizeRequest(text=texts[0])).tokens)
        rpc = stub.OpenAIEmbed(pb.OpenAIRequest(json_body=json.dumps(
            {"input": texts[1]}).encode()), timeout=60)
    # Unless told otherwise the package asks for base64 and decodes it; floats when asked.
    for options in ({}, {"encoding_format": "float"}):
        reply = client.embeddings.create(model=model, input=texts, **options)
        assert [d.index for d in reply.data] == [0, 1]
        for got, want in zip(reply.data, expected, strict=True):
            assert len(got.embedding) == HIDDEN
            assert np.allclose(got.embedding, want, atol=1e-5)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(tokens)
    by_ids = client.embeddings.create(model=model, input=[tokens])
    assert np.allclose(by_ids.data[0].embedding, expected[0], atol=1e-5)
    assert by_ids.usage.prompt_tokens == len(tokens)
    assert rpc.status_code == 200
    assert np.allclose(json.loads(rpc.json_body)["data"][0]["embedding"], expected[1], atol=1e-5)
    encoded = client.embeddings.create(model=model, input=texts[0], encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(encoded.data[0].embedding), dtype="<f4")
    assert np.allclose(vector, expected[0], atol=1e-5)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=model, input="x", dimensions=8)
    assert info.value.body["param"] == "dimensions"
