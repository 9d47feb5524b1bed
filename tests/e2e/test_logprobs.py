"""Logprobs end to end, over gRPC and HTTP: one per output token, top alternatives sorted with
the greedy token first, prompt logprobs from logprob_start_len (null at position 0), token texts
exactly when return_text_in_logprobs was asked, and bad options refused by name."""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
import httpx
import pytest
from helpers import collect_text, text_request

from sglang.runtime.v1 import sglang_pb2 as pb

PROMPT = "Once upon a time there was"
NEW = 8


def _prompt_ids(stub) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).tokens)


def _joined(metas: list[dict[str, Any]], key: str) -> list[Any]:
    """A key's entries over a stream's messages (each message carries its own tokens')."""
    return [e for m in metas for e in m.get(key, [])]


def _decode(meta_info: Any) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in meta_info.items() if "logprobs" in k}


def _check_entry(entry: list[Any], token_id: int, text: bool) -> None:
    logprob, tid, token_text = entry
    assert tid == token_id
    assert isinstance(logprob, float) and math.isfinite(logprob) and logprob <= 0, entry
    assert isinstance(token_text, str) if text else token_text is None, entry


def _check_top(top: list[list[Any]], k: int, text: bool) -> None:
    assert len(top) == k
    for entry in top:
        _check_entry(entry, entry[1], text)
    values = [e[0] for e in top]
    assert values == sorted(values, reverse=True), top


def check_output(meta: dict[str, Any], ids: list[int], *, k: int, text: bool) -> None:
    entries = meta["output_token_logprobs"]
    assert len(entries) == len(ids) > 0
    for entry, token_id in zip(entries, ids, strict=True):
        _check_entry(entry, token_id, text)
    if k == 0:
        assert "output_top_logprobs" not in meta
        return
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(ids)
    for top, entry in zip(tops, entries, strict=True):
        _check_top(top, k, text)
        # Greedy (temperature 0) picks the most likely token: the top-1 alternative.
        assert top[0][1] == entry[1], (top, entry)
        assert top[0][0] == pytest.approx(entry[0], abs=1e-4)


def check_input(meta: dict[str, Any], prompt: list[int], start: int, *, k: int,
                text: bool) -> None:
    entries = meta["input_token_logprobs"]
    if start < 0:
        assert entries == []
        return
    assert [e[1] for e in entries] == prompt[start:]  # positions [start, prompt_len)
    for i, entry in enumerate(entries):
        if start + i == 0:
            assert entry[0] is None  # nothing precedes the first token
            assert isinstance(entry[2], str) if text else entry[2] is None
        else:
            _check_entry(entry, prompt[start + i], text)
    if k:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(entries)
        for i, top in enumerate(tops):
            if start + i == 0:
                assert top is None
            else:
                _check_top(top, k, text)


# ---- gRPC ------------------------------------------------------------------------------------


def test_grpc_text_generate_stream_with_prompt_logprobs_and_texts(stub):
    prompt = _prompt_ids(stub)
    req = text_request(PROMPT, max_new_tokens=NEW, ignore_eos=True)
    req.return_logprob = True
    req.top_logprobs_num = 3
    req.logprob_start_len = 0
    req.return_text_in_logprobs = True
    _, msgs = collect_text(stub, req)
    metas = [_decode(m.meta_info) for m in msgs]
    for m, meta in zip(msgs, metas, strict=True):
        # Each message carries the entries of its own tokens.
        assert len(meta["output_token_logprobs"]) == len(m.output_ids)
        assert len(meta["output_top_logprobs"]) == len(m.output_ids)
    ids = [t for m in msgs for t in m.output_ids]
    assert len(ids) == NEW == int(msgs[-1].meta_info["completion_tokens"])
    joined = {k: _joined(metas, k) for k in metas[0]}
    check_output(joined, ids, k=3, text=True)
    check_input(joined, prompt, 0, k=3, text=True)


def test_grpc_generate_non_streaming_from_a_later_prompt_position(stub):
    prompt = _prompt_ids(stub)
    (msg,) = list(stub.Generate(pb.GenerateRequest(
        input_ids=prompt, return_logprob=True, top_logprobs_num=2, logprob_start_len=2,
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True),
    ), timeout=120))
    meta = _decode(msg.meta_info)
    check_output(meta, list(msg.output_ids), k=2, text=False)
    check_input(meta, prompt, 2, k=2, text=False)


def test_grpc_output_logprobs_only_by_default(stub):
    req = text_request(PROMPT, stream=False, max_new_tokens=NEW, ignore_eos=True)
    req.return_logprob = True
    (msg,) = list(stub.TextGenerate(req, timeout=120))
    meta = _decode(msg.meta_info)
    assert set(meta) == {"output_token_logprobs", "input_token_logprobs"}
    check_output(meta, list(msg.output_ids), k=0, text=False)
    check_input(meta, [], -1, k=0, text=False)


def test_no_logprobs_unless_asked(stub):
    (msg,) = list(stub.TextGenerate(text_request(PROMPT, stream=False, max_new_tokens=4),
                                    timeout=120))
    assert not [k for k in msg.meta_info if "logprobs" in k]


def test_a_stop_string_cuts_logprobs_with_the_tokens(stub):
    full, _ = collect_text(stub, text_request(PROMPT, max_new_tokens=24, ignore_eos=True))
    assert len(full) > 8
    stop = full[5:8]
    req = text_request(PROMPT, max_new_tokens=24, ignore_eos=True, stop=[stop])
    req.return_logprob = True
    text, msgs = collect_text(stub, req)
    assert msgs[-1].meta_info["finish_reason"] == "stop" and text == full[: full.index(stop)]
    ids = [t for m in msgs for t in m.output_ids]
    entries = _joined([_decode(m.meta_info) for m in msgs], "output_token_logprobs")
    assert [e[1] for e in entries] == ids


@pytest.mark.parametrize(("changes", "field"), [
    ({"top_logprobs_num": 21}, "top_logprobs_num"),
    ({"top_logprobs_num": -1}, "top_logprobs_num"),
    ({"logprob_start_len": -2}, "logprob_start_len"),
    ({"logprob_start_len": 10_000}, "logprob_start_len"),  # past the prompt: the tokenizer says
])
def test_bad_logprob_options_are_invalid_argument(stub, changes, field):
    req = text_request(PROMPT, max_new_tokens=4)
    req.return_logprob = True
    for name, value in changes.items():
        setattr(req, name, value)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.TextGenerate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: "), err.value.details()


# ---- HTTP ------------------------------------------------------------------------------------

BODY = {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}}


def test_http_generate_returns_json_arrays(mesh, stub):
    prompt = _prompt_ids(stub)
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate",
                   json={**BODY, "return_text_in_logprobs": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert isinstance(meta["output_token_logprobs"], list)  # arrays, not JSON text
    check_output(meta, body["output_ids"], k=2, text=True)
    check_input(meta, prompt, 0, k=2, text=True)
    assert meta["completion_tokens"] == NEW


def test_http_generate_sse_logprobs_are_cumulative(mesh, stub):
    prompt = _prompt_ids(stub)
    events = []
    with httpx.stream("POST", f"{mesh.addresses.gateway_http}/generate",
                      json={**BODY, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    counts = [len(e["meta_info"]["output_token_logprobs"]) for e in events]
    assert counts == [len(e["output_ids"]) for e in events] and counts[-1] == NEW
    check_output(events[-1]["meta_info"], events[-1]["output_ids"], k=2, text=False)
    check_input(events[-1]["meta_info"], prompt, 0, k=2, text=False)


def test_http_generate_input_ids_with_texts(mesh, stub):
    prompt = _prompt_ids(stub)
    body = {**{k: v for k, v in BODY.items() if k != "text"}, "input_ids": prompt,
            "logprob_start_len": 1, "return_text_in_logprobs": True}
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    check_output(meta, r.json()["output_ids"], k=2, text=True)
    check_input(meta, prompt, 1, k=2, text=True)


def test_http_transcoded_meta_info_carries_json_text(mesh):
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/runtime/text_generate",
                   json={**BODY, "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    (line,) = [json.loads(x) for x in r.text.splitlines() if x.strip()]
    result = line["result"]
    check_output(_decode(result["meta_info"]), result["output_ids"], k=2, text=False)


def test_http_bad_top_logprobs_num_is_400(mesh):
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate",
                   json={**BODY, "top_logprobs_num": 100}, timeout=30)
    assert r.status_code == 400 and "top_logprobs_num" in r.text
