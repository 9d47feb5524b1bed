"""Prefill-only requests and token_ids_logprob end to end, over gRPC (TextGenerate, Generate),
SGLang's native /generate and the transcoded /v1/runtime routes.

max_new_tokens 0 computes the prompt and finishes "length" with no token; with return_logprob
its meta_info has the prompt logprobs from logprob_start_len and, for the position after the
prompt, the top and asked ids' logprobs (SGLang's prefill-only scoring). token_ids_logprob asks
for given ids' logprobs at every output position and at the prompt positions with logprobs
(output_token_ids_logprobs, input_token_ids_logprobs); an id outside the vocabulary is refused
("out of vocabulary"), and on /generate a nested list for one prompt ("flat list of
integers")."""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
import httpx
import pytest
from helpers import collect_text, generate_events, text_request

from sglang.runtime.v1 import sglang_pb2 as pb

PROMPT = "In the beginning the prefill computed every position of the prompt"
OUT_OF_VOCABULARY = 10**7  # within int32, past any vocabulary of the test model


def _ids(stub, text: str = PROMPT) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=text)).tokens)


def _decode(meta_info: Any) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in meta_info.items() if "logprobs" in k}


def _asked(prompt: list[int]) -> list[int]:
    """Ids to ask for: two of the prompt's (so their input entries can be checked against
    input_token_logprobs) and one repeated."""
    return [prompt[3], prompt[5], prompt[3]]


def _check_entries(entries: list[list[Any]], ids: list[int]) -> None:
    assert [e[1] for e in entries] == ids
    for logprob, _, text in entries:
        assert isinstance(logprob, float) and math.isfinite(logprob) and logprob <= 0
        assert text is None


def check_prefill(meta: dict[str, Any], prompt: list[int], asked: list[int], *, top: int,
                  start: int = 0) -> None:
    """A prefill's logprobs: nothing drawn; the position after the prompt (top and asked);
    the prompt's positions from `start`, the asked ids' agreeing with the prompt tokens'."""
    assert meta["output_token_logprobs"] == []
    [after] = meta["output_token_ids_logprobs"]
    _check_entries(after, asked)
    assert after[0] == after[2]  # a repeated id is answered twice
    if top:
        [best] = meta["output_top_logprobs"]
        _check_entries(best, [e[1] for e in best])
        assert len(best) == top and [e[0] for e in best] == sorted(
            (e[0] for e in best), reverse=True)
        assert best[0][0] >= max(e[0] for e in after) - 1e-4
    inputs, per_position = meta["input_token_logprobs"], meta["input_token_ids_logprobs"]
    assert [e[1] for e in inputs] == prompt[start:]
    assert len(per_position) == len(inputs)
    for p, (entry, asked_here) in enumerate(zip(inputs, per_position, strict=True), start):
        if p == 0:
            assert entry[0] is None and asked_here is None
            continue
        _check_entries(asked_here, asked)
        for logprob, token_id, _ in asked_here:
            if token_id == prompt[p]:  # the same logprob, reached two ways
                assert logprob == pytest.approx(entry[0], abs=1e-4)


# ---- gRPC ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_grpc_text_generate_prefill_only(stub, stream):
    prompt = _ids(stub)
    req = text_request(PROMPT, stream=stream, max_new_tokens=0)
    req.return_logprob, req.top_logprobs_num, req.logprob_start_len = True, 3, 0
    req.token_ids_logprob.extend(_asked(prompt))
    text, msgs = collect_text(stub, req)
    final = msgs[-1]
    assert final.finished and text == "" and not [t for m in msgs for t in m.output_ids]
    assert final.meta_info["finish_reason"] == "length"
    assert final.meta_info["completion_tokens"] == "0"
    assert final.meta_info["prompt_tokens"] == str(len(prompt))
    metas = [_decode(m.meta_info) for m in msgs]
    joined = {k: [e for m in metas for e in m.get(k, [])] for k in metas[0]}
    check_prefill(joined, prompt, _asked(prompt), top=3)


def test_grpc_prefill_agrees_with_the_first_generated_token(stub):
    """The position after the prompt is the one a generation draws its first token at."""
    prompt = _ids(stub)
    asked = _asked(prompt)

    def run(max_new_tokens: int) -> tuple[list[int], dict[str, Any]]:
        (msg,) = list(stub.Generate(pb.GenerateRequest(
            input_ids=prompt, return_logprob=True, top_logprobs_num=1, token_ids_logprob=asked,
            sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                              ignore_eos=True)), timeout=120))
        assert msg.finished and msg.meta_info["finish_reason"] == "length"
        return list(msg.output_ids), _decode(msg.meta_info)

    none, prefill = run(0)
    drawn, generation = run(3)
    assert none == [] and len(drawn) == 3
    assert prefill["output_top_logprobs"][0][0][1] == drawn[0]  # greedy: the top-1
    for ours, theirs in zip(prefill["output_token_ids_logprobs"][0],
                            generation["output_token_ids_logprobs"][0], strict=True):
        assert ours[1] == theirs[1] and ours[0] == pytest.approx(theirs[0], abs=1e-4)
    # Generating, the asked ids come at every output position, and no prompt positions
    # without logprob_start_len.
    assert len(generation["output_token_ids_logprobs"]) == 3
    for entries in generation["output_token_ids_logprobs"]:
        _check_entries(entries, asked)
    assert generation["input_token_ids_logprobs"] == []


def test_grpc_prefill_without_logprobs_warms_the_prefix_cache(stub):
    prompt = _ids(stub, " ".join([PROMPT] * 3))  # past a KV block or two

    def generate(max_new_tokens: int, **fields: Any) -> pb.GenerateResponse:
        (msg,) = list(stub.Generate(pb.GenerateRequest(
            input_ids=prompt, sampling_params=pb.SamplingParams(
                temperature=0.0, max_new_tokens=max_new_tokens), **fields), timeout=120))
        assert msg.finished and msg.meta_info["finish_reason"] == "length"
        return msg

    plain = generate(0)
    assert list(plain.output_ids) == [] and plain.meta_info["completion_tokens"] == "0"
    assert not [k for k in plain.meta_info if "logprobs" in k]
    assert int(generate(1).meta_info["cached_tokens"]) > 0  # the prefill left it cached
    # Prompt logprobs from a later position: the asked ids' there too.
    meta = _decode(generate(0, return_logprob=True, logprob_start_len=4,
                            token_ids_logprob=_asked(prompt)).meta_info)
    check_prefill(meta, prompt, _asked(prompt), top=0, start=4)
    assert "output_top_logprobs" not in meta


@pytest.mark.parametrize("call", ["TextGenerate", "Generate"])
@pytest.mark.parametrize(("ids", "words"), [([1, OUT_OF_VOCABULARY], "out of vocabulary"),
                                            ([-1], "non-negative")])
def test_grpc_token_ids_outside_the_vocabulary_are_refused(stub, call, ids, words):
    for return_logprob in (True, False):  # checked even where it would be ignored
        if call == "TextGenerate":
            req: Any = text_request(PROMPT, max_new_tokens=0)
        else:
            req = pb.GenerateRequest(input_ids=_ids(stub),
                                     sampling_params=pb.SamplingParams(max_new_tokens=0))
        req.return_logprob = return_logprob
        req.token_ids_logprob.extend(ids)
        with pytest.raises(grpc.RpcError) as err:
            list(getattr(stub, call)(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert details.startswith(f"token_ids_logprob[{len(ids) - 1}]: ") and words in details


def test_grpc_token_ids_logprob_is_ignored_without_return_logprob(stub):
    req = text_request(PROMPT, stream=False, max_new_tokens=2)
    req.token_ids_logprob.extend([1, 2])
    (msg,) = list(stub.TextGenerate(req, timeout=120))
    assert msg.finished and not [k for k in msg.meta_info if "logprobs" in k]


# ---- native /generate ------------------------------------------------------------------------


def _native_body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "token_ids_logprob": _asked(prompt),
            "sampling_params": {"max_new_tokens": 0}, **extra}


def test_native_generate_prefill_only(mesh, stub):
    prompt = _ids(stub)
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", json=_native_body(prompt),
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert body["text"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    check_prefill(meta, prompt, _asked(prompt), top=2)


def test_native_generate_prefill_only_streams_one_event(mesh, stub):
    prompt = _ids(stub)
    events = list(generate_events(mesh.addresses.gateway_http,
                                  _native_body(prompt, stream=True)))
    last = events[-1]
    assert last["text"] == "" and last["meta_info"]["finish_reason"]["type"] == "length"
    check_prefill(last["meta_info"], prompt, _asked(prompt), top=2)


def test_native_batch_takes_one_list_per_prompt(mesh, stub):
    texts = ["A first prompt to prefill", "A second, longer prompt to prefill and score"]
    ids = [_ids(stub, t) for t in texts]
    asked = [[ids[0][1]], [ids[1][2], ids[1][1]]]
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", timeout=120, json={
        "text": texts, "return_logprob": True, "token_ids_logprob": asked,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    results = r.json()
    for result, want in zip(results, asked, strict=True):
        per_token = result["meta_info"]["output_token_ids_logprobs"]
        assert len(per_token) == len(result["output_ids"]) == 2
        for entries in per_token:
            _check_entries(entries, want)


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"text": PROMPT, "return_logprob": True, "token_ids_logprob": [[1, 2]]},
     "token_ids_logprob", "flat list of integers"),
    ({"text": PROMPT, "return_logprob": True, "token_ids_logprob": [3, OUT_OF_VOCABULARY]},
     "token_ids_logprob[1]", "out of vocabulary"),
    ({"text": PROMPT, "return_logprob": True, "token_ids_logprob": [2**40]},
     "token_ids_logprob[0]", "out of vocabulary"),
    ({"text": [PROMPT, PROMPT], "token_ids_logprob": [[1], [2], [3]]},
     "token_ids_logprob", "3 lists for 2 prompts"),
])
def test_native_generate_refusals(mesh, body, field, words):
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}: ") and words in message, message


# ---- transcoded /v1/runtime ------------------------------------------------------------------


def test_transcoded_text_generate_prefill_only(mesh, stub):
    prompt = _ids(stub)
    body = {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "token_ids_logprob": _asked(prompt), "sampling_params": {"max_new_tokens": 0}}
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/runtime/text_generate", json=body,
                   timeout=120)
    assert r.status_code == 200, r.text
    lines = [json.loads(x)["result"] for x in r.text.splitlines()]
    final = lines[-1]
    assert final["finished"] and final["meta_info"]["finish_reason"] == "length"
    assert final["meta_info"]["completion_tokens"] == "0"
    metas = [_decode(x["meta_info"]) for x in lines]
    joined = {k: [e for m in metas for e in m.get(k, [])] for k in metas[0]}
    check_prefill(joined, prompt, _asked(prompt), top=0)


def test_transcoded_generate_token_ids_at_every_output_position(mesh, stub):
    prompt = _ids(stub)
    body = {"input_ids": prompt, "stream": False, "return_logprob": True,
            "token_ids_logprob": _asked(prompt),
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/runtime/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    [line] = [json.loads(x)["result"] for x in r.text.splitlines()]
    per_token = json.loads(line["meta_info"]["output_token_ids_logprobs"])
    assert len(per_token) == len(line["output_ids"]) == 3
    for entries in per_token:
        _check_entries(entries, _asked(prompt))


@pytest.mark.parametrize(("asked", "words"), [([[1, 2]], "flat list of integers"),
                                              ([OUT_OF_VOCABULARY], "out of vocabulary")])
def test_transcoded_refusals(mesh, asked, words):
    body = {"text": PROMPT, "return_logprob": True, "token_ids_logprob": asked}
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/runtime/text_generate", json=body,
                   timeout=30)
    assert r.status_code == 400, r.text
    status = r.json()
    assert status["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert status["message"].startswith("token_ids_logprob") and words in status["message"]
