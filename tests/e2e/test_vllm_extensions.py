"""vLLM's extensions of the OpenAI routes, end to end with the official `openai` package:
return_token_ids (the output's and the prompt's ids, carried back through the mesh with the
first output), return_tokens_as_token_ids ("token_id:<id>" in logprobs), prompt_logprobs
(each prompt token's logprob and rank, and the most likely ones), logprob_token_ids (the asked
ids listed in place of the most likely), bad_words, truncate_prompt_tokens with
truncation_side, use_beam_search refused, cache_salt (the prefix cache split by salt), and
the /version and /load routes, as vLLM's own server tests read them."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from helpers import chatml, wait_until

from sglang.runtime.v1 import sglang_pb2 as pb

PROMPT = "Hello, world! How are you today?"
USER = [{"role": "user", "content": "Repeat after me: I love cats"}]


def tokens(stub, text: str, special: bool = True) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=special)).tokens)


def decoded(stub, ids: list[int]) -> str:
    return stub.Detokenize(pb.DetokenizeRequest(tokens=ids)).text


def ids_of(labels: list[str]) -> list[int]:
    assert all(label.startswith("token_id:") for label in labels), labels
    return [int(label.removeprefix("token_id:")) for label in labels]


# ---- return_token_ids ------------------------------------------------------------------------


def test_completion_returns_its_prompt_and_output_ids(client, model, stub) -> None:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={"return_token_ids": True})
    choice = reply.choices[0].model_dump()
    assert choice["prompt_token_ids"] == tokens(stub, PROMPT)
    assert len(choice["token_ids"]) == reply.usage.completion_tokens == 10
    assert decoded(stub, choice["token_ids"]) == choice["text"]
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                      extra_body={"return_token_ids": False}).model_dump()
    assert "token_ids" not in plain["choices"][0]
    assert "prompt_token_ids" not in plain["choices"][0]


def test_a_batch_of_prompts_each_with_its_own_ids(client, model, stub) -> None:
    prompts = ["The sea", "A robot may not injure"]
    reply = client.completions.create(model=model, prompt=prompts, max_tokens=3, n=2,
                                      extra_body={"return_token_ids": True})
    for choice in reply.choices:
        dump = choice.model_dump()
        assert dump["prompt_token_ids"] == tokens(stub, prompts[choice.index // 2])
        assert len(dump["token_ids"]) == 3


def test_chat_returns_the_rendered_prompts_ids(client, model, stub) -> None:
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=8,
                                           temperature=0, extra_body={"return_token_ids": True})
    dump = reply.model_dump()
    assert dump["prompt_token_ids"] == tokens(stub, chatml(USER), special=False)
    assert decoded(stub, dump["choices"][0]["token_ids"]) == reply.choices[0].message.content
    plain = client.chat.completions.create(model=model, messages=USER, max_tokens=2).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_streamed_ids_line_up_with_the_logprobs(client, model, stub) -> None:
    stream = client.completions.create(
        model=model, prompt="Tell me a short fact about Python:", max_tokens=30, temperature=0,
        stream=True, logprobs=1, n=2,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    ids: dict[int, list[int]] = {0: [], 1: []}
    logprob_ids: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list[list[int]]] = {0: [], 1: []}
    for chunk in stream:
        choice = chunk.choices[0].model_dump()
        if "prompt_token_ids" in choice:
            prompts[choice["index"]].append(choice["prompt_token_ids"])
        ids[choice["index"]] += choice["token_ids"]
        logprob_ids[choice["index"]] += ids_of(choice["logprobs"]["tokens"])
    expected = tokens(stub, "Tell me a short fact about Python:")
    for index in (0, 1):
        assert prompts[index] == [expected]  # once, in the choice's first chunk
        assert len(ids[index]) == 30 and ids[index] == logprob_ids[index]


def test_a_streamed_chat_gives_the_prompt_once_then_each_chunks_ids(client, model, stub) -> None:
    stream = client.chat.completions.create(model=model, messages=USER, max_tokens=20,
                                            temperature=0, stream=True,
                                            extra_body={"return_token_ids": True})
    chunks = [chunk.model_dump() for chunk in stream]
    assert chunks[0]["prompt_token_ids"] == tokens(stub, chatml(USER), special=False)
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    content = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    assert len(ids) == 20 and decoded(stub, ids) == content


# ---- return_tokens_as_token_ids and prompt_logprobs --------------------------------------------


def test_echo_logprobs_prompt_logprobs_and_ids_agree(client, model, stub) -> None:
    """vLLM's comparison: with echo, the logprobs' ids are the prompt's then the output's."""
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=20, temperature=0, echo=True, logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                    "prompt_logprobs": 1})
    choice = reply.choices[0].model_dump()
    labelled = ids_of(choice["logprobs"]["tokens"])
    assert labelled == choice["prompt_token_ids"] + choice["token_ids"]
    for position in choice["logprobs"]["top_logprobs"][1:]:
        assert 1 <= len(position) <= 2 and all(k.startswith("token_id:") for k in position)
    prompt = choice["prompt_logprobs"]
    assert len(prompt) == len(choice["prompt_token_ids"]) and prompt[0] is None
    for token, position, value in zip(choice["prompt_token_ids"][1:], prompt[1:],
                                      choice["logprobs"]["token_logprobs"][1:], strict=False):
        assert str(token) in position and position[str(token)]["logprob"] == pytest.approx(value)
        assert 1 <= len(position) <= 2
        best = min(position.values(), key=lambda entry: entry["rank"])
        assert best["rank"] == 1 and best["logprob"] == max(e["logprob"] for e in
                                                            position.values())


def test_prompt_logprobs_ranks_agree_with_the_most_likely(client, model) -> None:
    """A prompt token among the 20 most likely has its place there as its rank; one outside
    ranks below 20."""
    reply = client.completions.create(model=model, prompt="The cat sat on the mat and then",
                                      max_tokens=1, extra_body={"prompt_logprobs": 20})
    prompt = reply.choices[0].model_dump()["prompt_logprobs"]
    assert reply.choices[0].logprobs is None  # prompt_logprobs alone asks for nothing else
    assert prompt[0] is None and len(prompt) == reply.usage.prompt_tokens
    for position in prompt[1:]:
        by_rank = sorted(position.values(), key=lambda entry: entry["rank"])
        top = [e for e in by_rank if e["rank"] <= 20]
        assert [e["rank"] for e in top[:20]] == list(range(1, 21))
        values = [e["logprob"] for e in top]
        assert values == sorted(values, reverse=True)
        for entry in position.values():
            assert isinstance(entry["decoded_token"], str)
            if entry["rank"] > 20:
                assert entry["logprob"] <= values[-1]


def test_logprob_token_ids_are_listed_after_the_chosen_token(client, model) -> None:
    asked = [100, 1000, 5]
    reply = client.chat.completions.create(
        model=model, messages=USER, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"logprob_token_ids": asked,
                                    "return_tokens_as_token_ids": True})
    natural = client.chat.completions.create(
        model=model, messages=USER, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=20, extra_body={"return_tokens_as_token_ids": True})
    for entry, plain in zip(reply.choices[0].logprobs.content,
                            natural.choices[0].logprobs.content, strict=True):
        assert entry.token == plain.token  # greedy: the same tokens
        listed = ids_of([t.token for t in entry.top_logprobs])
        assert listed[0] == ids_of([entry.token])[0]
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert set(listed) == {listed[0], *asked} and len(listed) == len(set(listed))
        # An asked id among the 20 most likely has the same logprob there.
        best = dict(zip(ids_of([t.token for t in plain.top_logprobs]),
                        [t.logprob for t in plain.top_logprobs], strict=True))
        for token, t in zip(listed, entry.top_logprobs, strict=True):
            assert t.logprob <= 0
            if token in best:
                assert t.logprob == pytest.approx(best[token], abs=1e-4)
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                           logprobs=0, extra_body={"logprob_token_ids": [7]})
    for position in completion.choices[0].logprobs.top_logprobs:
        assert 1 <= len(position) <= 2
    with pytest.raises(openai.BadRequestError, match=r"logprob_token_ids\[0\]: .*vocabulary"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=3, logprobs=0,
                                  extra_body={"logprob_token_ids": [10**6]})
    with pytest.raises(openai.BadRequestError, match="logprob_token_ids: needs logprobs"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                  extra_body={"logprob_token_ids": [7]})


@pytest.mark.parametrize("k", [0, 1])
def test_chat_prompt_logprobs_at_the_top(client, model, stub, k) -> None:
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=2,
                                           extra_body={"prompt_logprobs": k}).model_dump()
    prompt = reply["prompt_logprobs"]
    assert len(prompt) == reply["usage"]["prompt_tokens"] and prompt[0] is None
    rendered = tokens(stub, chatml(USER), special=False)
    for token, position in zip(rendered[1:], prompt[1:], strict=True):
        assert str(token) in position and 1 <= len(position) <= k + 1
    plain = client.chat.completions.create(model=model, messages=USER, max_tokens=2).model_dump()
    assert "prompt_logprobs" not in plain


def test_prompt_logprobs_refusals_and_the_streamed_zero(client, model) -> None:
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=model, prompt="hi", max_tokens=2,
                                  extra_body={"prompt_logprobs": -1})
    with pytest.raises(openai.BadRequestError, match="not available when stream"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="return_token_ids"):
        client.completions.create(model=model, prompt="hi", max_tokens=2,
                                  extra_body={"return_token_ids": "yes"})
    # 0 with stream is taken and changes nothing, as in vLLM.
    chunks = list(client.completions.create(model=model, prompt="hi", max_tokens=2,
                                            stream=True, extra_body={"prompt_logprobs": 0}))
    assert chunks[-1].choices[0].finish_reason == "length"


# ---- bad_words -------------------------------------------------------------------------------


def test_bad_words_are_never_written(client, model, stub) -> None:
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True})
    first = free.choices[0].model_dump()["token_ids"][0]
    word = decoded(stub, [first])  # the greedy answer's first token, as text
    banned = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"return_token_ids": True, "bad_words": [word]})
    assert first not in banned.choices[0].model_dump()["token_ids"]
    for words, param in (([" "], "bad_words[0]"), ("x", "bad_words")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="hi", max_tokens=2,
                                      extra_body={"bad_words": words})
        assert info.value.body["param"] == param


# ---- truncate_prompt_tokens ------------------------------------------------------------------


def test_truncation_side_controls_which_ids_are_kept(client, model) -> None:
    ids = list(range(8))
    for side, kept in (("right", ids[:4]), ("left", ids[-4:])):
        reply = client.completions.create(
            model=model, prompt=ids, max_tokens=1, temperature=0,
            extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4,
                        "truncation_side": side})
        assert reply.choices[0].model_dump()["prompt_token_ids"] == kept
        assert reply.usage.prompt_tokens == 4


def test_a_text_prompt_too_long_for_the_context_fits_once_cut(client, model, stub) -> None:
    info = client.models.list().data[0].model_dump()
    context = info["max_model_len"]
    long = "many different words here " * (context // 2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=model, prompt=long, max_tokens=2)
    reply = client.completions.create(
        model=model, prompt=long, max_tokens=2,
        extra_body={"truncate_prompt_tokens": 16, "return_token_ids": True})
    assert reply.choices[0].model_dump()["prompt_token_ids"] == tokens(stub, long)[-16:]
    # A chat's rendered prompt is cut too: to leave room for its 2 tokens it fits exactly;
    # -1 (max_model_len) cuts it to the whole context, which leaves none.
    messages = [{"role": "user", "content": long}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2,
        extra_body={"truncate_prompt_tokens": context - 2, "truncation_side": "right"})
    assert chat.usage.prompt_tokens == context - 2 and chat.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": -1})


def test_truncation_and_beam_search_refusals(client, model) -> None:
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens: must be at most"):
        client.completions.create(model=model, prompt="hi", max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 10**6})
    with pytest.raises(openai.BadRequestError, match="truncation_side"):
        client.completions.create(model=model, prompt="hi", max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 1,
                                              "truncation_side": "middle"})
    with pytest.raises(openai.APIStatusError, match="use_beam_search") as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2, n=2,
                                  extra_body={"use_beam_search": True})
    assert info.value.status_code == 501
    reply = client.completions.create(model=model, prompt="hi", max_tokens=2,
                                      extra_body={"use_beam_search": False,
                                                  "length_penalty": 1.0})
    assert reply.choices[0].finish_reason == "length"


# ---- cache_salt ------------------------------------------------------------------------------


def test_a_cache_salt_shares_cached_prompts_only_under_the_same_salt(client, model) -> None:
    prompt = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 8

    def cached(**salt: str) -> int:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                          extra_body=salt)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") >= 32  # its own: reused
    assert cached(cache_salt="tenant-b") == 0  # another tenant's: not
    assert cached() == 0 and cached() >= 32  # unsalted requests share among themselves

    def chat_cached(salt: str) -> int:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=1,
            extra_body={"cache_salt": salt})
        return reply.usage.prompt_tokens_details.cached_tokens

    assert chat_cached("tenant-a") < 32 <= chat_cached("tenant-a")
    assert chat_cached("tenant-b") == 0
    for bad in ("", "x" * 1025, 7):
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            client.completions.create(model=model, prompt="hi", max_tokens=1,
                                      extra_body={"cache_salt": bad})


# ---- /version and /load ----------------------------------------------------------------------


def test_version_is_the_servers(mesh) -> None:
    base = mesh.addresses.gateway_http
    r = httpx.get(f"{base}/version", timeout=10)
    info = httpx.get(f"{base}/get_server_info", timeout=10).json()
    assert r.status_code == 200 and r.json() == {"version": info["version"]}
    assert info["version"] not in ("", "unknown")


def test_load_counts_the_requests_in_flight(mesh, client, model) -> None:
    url = f"{mesh.addresses.gateway_http}/load"

    def load() -> int:
        r = httpx.get(url, timeout=10)
        assert r.status_code == 200
        return int(r.json()["server_load"])

    wait_until(lambda: load() == 0, timeout=30, what="no request in flight")
    stream = client.completions.create(model=model, prompt="Once", max_tokens=2000,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # running now
    assert load() == 1
    stream.close()  # the client leaves: the request ends in the mesh
    wait_until(lambda: load() == 0, timeout=30, what="the request ended")
    assert json.loads(httpx.get(url, timeout=10).text) == {"server_load": 0}


# ---- chat_template -----------------------------------------------------------------------------


def test_a_requests_own_chat_template_only_where_trusted(client, model, stub, mesh) -> None:
    """vLLM's chat_template: refused by a gateway that was not told to trust it; rendered by
    one started with --trust-request-chat-template (the prompt is the template's)."""
    own = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=USER, max_tokens=2,
                                       extra_body={"chat_template": own})
    assert info.value.body["param"] == "chat_template", info.value.body
    assert "--trust-request-chat-template" in info.value.body["message"]
    refused = httpx.post(f"{mesh.addresses.gateway_http}/v1/tokenize", timeout=10,
                         json={"messages": USER, "chat_template": own})
    assert refused.status_code == 400 and "chat_template" in refused.text
    name = f"gateway-templates-{uuid.uuid4().hex[:6]}"
    trusting = mesh.start_gateway(name, switches=("trust_request_chat_template",))
    try:
        trusted = openai.OpenAI(base_url=f"{trusting.http_address}/v1", api_key="x")
        reply = trusted.chat.completions.create(
            model=model, messages=USER, max_tokens=2,
            extra_body={"chat_template": own, "return_token_ids": True})
        assert reply.model_dump()["prompt_token_ids"] == tokens(
            stub, "<user>Repeat after me: I love cats", special=False)
        with pytest.raises(openai.BadRequestError) as info:
            trusted.chat.completions.create(model=model, messages=USER, max_tokens=2,
                                            extra_body={"chat_template": "{% if %}"})
        assert info.value.body["param"] == "chat_template", info.value.body
        # /v1/tokenize renders a chat the same way.
        counted = httpx.post(f"{trusting.http_address}/v1/tokenize", timeout=10, json={
            "messages": USER, "chat_template": own})
        assert counted.json()["tokens"] == tokens(
            stub, "<user>Repeat after me: I love cats", special=False)
    finally:
        trusting.stop(10)
        del mesh.services[name]
