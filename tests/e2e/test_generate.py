"""The README's mesh serves: TextGenerate and Generate stream, Tokenize/Detokenize round-trip,
HTTP /generate answers JSON and streams SSE, the transcoded RPCs answer over HTTP/JSON."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import pytest
from helpers import collect_text, text_request

from sglang.runtime.v1 import sglang_pb2 as pb


def test_text_generate_streams_deltas_then_final(stub):
    text, msgs = collect_text(stub, text_request("The quick brown fox", max_new_tokens=24,
                                                 ignore_eos=True))
    assert len(msgs) >= 2, "streaming should give several messages"
    assert all(not m.finished for m in msgs[:-1]) and msgs[-1].finished
    final = msgs[-1].meta_info
    assert final["finish_reason"] == "length"
    assert final["completion_tokens"] == "24"
    assert int(final["prompt_tokens"]) > 1
    assert final["id"] and final["cached_tokens"] == "0"
    assert text, "some text was generated"
    # Non-streaming gives one message with the same (greedy) text.
    once = list(stub.TextGenerate(text_request("The quick brown fox", stream=False,
                                               max_new_tokens=24, ignore_eos=True)))
    assert len(once) == 1 and once[0].finished and once[0].text == text


def test_generate_streams_output_ids(stub):
    ids = list(stub.Tokenize(pb.TokenizeRequest(text="Once upon a time")).tokens)
    msgs = list(stub.Generate(pb.GenerateRequest(
        input_ids=ids, stream=True,
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))))
    out = [t for m in msgs for t in m.output_ids]
    assert len(out) == 12 and msgs[-1].finished
    assert msgs[-1].meta_info["prompt_tokens"] == str(len(ids))
    # Same prompt as text gives the same tokens' text.
    text, _ = collect_text(stub, text_request("Once upon a time", max_new_tokens=12,
                                              ignore_eos=True))
    assert stub.Detokenize(pb.DetokenizeRequest(tokens=out)).text == text


def test_stop_token_ids_finish_with_stop(stub):
    first_ids = list(list(stub.Generate(pb.GenerateRequest(
        input_ids=list(stub.Tokenize(pb.TokenizeRequest(text="Hello")).tokens),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=8,
                                          ignore_eos=True)))
    )[0].output_ids)
    stop_at = first_ids[3]
    text, msgs = collect_text(stub, text_request("Hello", max_new_tokens=8, ignore_eos=True,
                                                 stop_token_ids=[stop_at]))
    meta = msgs[-1].meta_info
    assert meta["finish_reason"] == "stop"
    assert meta["matched_stop"] == str(stop_at)
    k = first_ids.index(stop_at)
    assert int(meta["completion_tokens"]) == k + 1
    # The stop token's text is cut, as a stop string's is; no_stop_trim keeps it.
    def text_of(ids: list[int]) -> str:
        return stub.Detokenize(pb.DetokenizeRequest(tokens=ids)).text

    assert text == text_of(first_ids[:k])
    kept, _ = collect_text(stub, text_request("Hello", max_new_tokens=8, ignore_eos=True,
                                              stop_token_ids=[stop_at], no_stop_trim=True))
    assert kept == text_of(first_ids[: k + 1]) and kept != text


def test_stop_string_ends_text_before_it(stub, mesh):
    full, _ = collect_text(stub, text_request("In the beginning", max_new_tokens=32,
                                              ignore_eos=True))
    assert len(full) > 6
    stop = full[4:7]
    text, msgs = collect_text(stub, text_request("In the beginning", max_new_tokens=32,
                                                 ignore_eos=True, stop=[stop]))
    meta = msgs[-1].meta_info
    assert meta["finish_reason"] == "stop" and meta["matched_stop"] == stop
    assert text == full[: full.index(stop)]
    # no_stop_trim (meshlm's field 102, SGLang's native sampling parameter) keeps it.
    kept, msgs = collect_text(stub, text_request("In the beginning", max_new_tokens=32,
                                                 ignore_eos=True, stop=[stop], no_stop_trim=True))
    assert msgs[-1].meta_info["finish_reason"] == "stop"
    assert kept == full[: full.index(stop) + len(stop)]
    native = httpx.post(f"{mesh.addresses.gateway_http}/generate", timeout=60, json={
        "text": "In the beginning", "sampling_params": {
            "temperature": 0, "max_new_tokens": 32, "ignore_eos": True, "stop": stop,
            "no_stop_trim": True}}).json()
    assert native["text"] == kept and native["meta_info"]["finish_reason"]["type"] == "stop"


def test_tokenize_detokenize_round_trip(stub):
    text = "Héllo, wörld! 你好 🙂"
    tok = stub.Tokenize(pb.TokenizeRequest(text=text))
    assert tok.count == len(tok.tokens) > 0 and tok.input_text == text
    assert tok.max_model_len > 0
    plain = stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=False))
    assert len(plain.tokens) == tok.count - 1  # the BOS token
    assert stub.Detokenize(pb.DetokenizeRequest(tokens=plain.tokens)).text == text


def test_model_info_and_list_models(stub):
    models = stub.ListModels(pb.ListModelsRequest()).models
    assert len(models) == 1 and models[0].id and models[0].max_model_len > 0
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert json.loads(info.json_info)["config"]["architectures"] == ["LlamaForCausalLM"]
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy


def test_classify_needs_a_classifier(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Classify(pb.ClassifyRequest(text="x"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_http_generate_json_and_sse(mesh):
    base = mesh.addresses.gateway_http
    body = {"text": "The quick brown fox",
            "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}}
    r = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["meta_info"]["finish_reason"]["type"] == "length"
    assert whole["meta_info"]["completion_tokens"] == 10
    events = []
    with httpx.stream("POST", f"{base}/generate", json={**body, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative
    assert texts[-1] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_http_transcoded_rpcs(mesh):
    base = mesh.addresses.gateway_http
    r = httpx.post(f"{base}/v1/runtime/tokenize", json={"text": "hello world"})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(r.json()["tokens"])
    r = httpx.get(f"{base}/v1/runtime/models")
    assert r.status_code == 200 and r.json()["models"][0]["id"]
    lines = []
    with httpx.stream("POST", f"{base}/v1/runtime/text_generate", timeout=60, json={
            "text": "hi", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
    }) as resp:
        assert resp.status_code == 200
        lines = [json.loads(x) for x in resp.iter_lines() if x.strip()]
    assert lines[-1]["result"]["finished"] is True
    assert lines[-1]["result"]["meta_info"]["finish_reason"] == "length"
    r = httpx.get(f"{base}/health")
    assert r.status_code == 200
    r = httpx.get(f"{base}/v1/models")
    assert r.json()["data"][0]["object"] == "model"


def test_seeded_sampling_is_reproducible_and_batch_independent(stub):
    from concurrent.futures import ThreadPoolExecutor

    def sample(text: str, seed: int | None) -> str:
        params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
        if seed is not None:
            params["seed"] = seed
        return collect_text(stub, text_request(text, **params))[0]

    alone = sample("Roll the dice", 1234)
    assert sample("Roll the dice", 1234) == alone
    with ThreadPoolExecutor(max_workers=12) as pool:
        jobs = [pool.submit(sample, "Roll the dice", 1234) for _ in range(4)]
        jobs += [pool.submit(sample, f"noise {i}", None) for i in range(8)]
        together = [j.result() for j in jobs[:4]]
    assert together == [alone] * 4
    assert {sample("Roll the dice", s) for s in (1, 2, 3)} != {alone}  # the seed matters


def test_http_generate_accepts_seed(mesh):
    body = {"text": "Roll the dice", "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 7}}
    first = httpx.post(f"{mesh.addresses.gateway_http}/generate", json=body, timeout=60)
    second = httpx.post(f"{mesh.addresses.gateway_http}/generate", json=body, timeout=60)
    assert first.status_code == 200, first.text
    assert first.json()["output_ids"] == second.json()["output_ids"]
    bad = httpx.post(f"{mesh.addresses.gateway_http}/generate", timeout=60, json={
        "text": "x", "sampling_params": {"seed": -1}})
    assert bad.status_code == 400 and "seed" in bad.text


def test_http_generate_batches_match_single_requests(mesh):
    """SGLang's batched /generate: a list of texts (or of id lists), per-prompt sampling params;
    each prompt's greedy output is what it gets alone, numbered by "index"."""
    base = mesh.addresses.gateway_http
    prompts = ["The cat", "Once upon a time", "A"]
    params = [{"max_new_tokens": n, "temperature": 0} for n in (4, 6, 3)]
    alone = [httpx.post(f"{base}/generate", json={"text": t, "sampling_params": p},
                        timeout=60).json() for t, p in zip(prompts, params, strict=True)]
    r = httpx.post(f"{base}/generate", json={"text": prompts, "sampling_params": params},
                   timeout=60)
    assert r.status_code == 200, r.text
    batch = r.json()
    assert [x["index"] for x in batch] == [0, 1, 2]
    assert [x["text"] for x in batch] == [x["text"] for x in alone]
    assert [x["meta_info"]["completion_tokens"] for x in batch] == [4, 6, 3]

    ids = [[5, 6, 7], [8, 9]]
    r = httpx.post(f"{base}/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "n": 2}})
    body = r.json()
    assert [x["index"] for x in body] == [0, 1, 2, 3]
    assert all(len(x["output_ids"]) == 2 for x in body)
    assert body[0]["output_ids"] == body[1]["output_ids"]  # greedy: both samples agree

    events = []
    with httpx.stream("POST", f"{base}/generate", timeout=60, json={
            "text": prompts, "sampling_params": params, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    last = {e["index"]: e for e in events}
    assert sorted(last) == [0, 1, 2]
    assert [last[i]["text"] for i in range(3)] == [x["text"] for x in alone]
    assert all(last[i]["meta_info"]["finish_reason"] == {"type": "length", "length": n}
               for i, n in enumerate((4, 6, 3)))


def test_the_schedulers_engine_thread_has_its_own_os_name(mesh):
    """`top -H` (and make bench's CPU figures) tell the engine's thread, with the OpenMP
    workers it starts, from the scheduler's event loop and gRPC threads."""
    pid = mesh.service("scheduler").pid
    tasks = Path(f"/proc/{pid}/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    assert "meshlm-engine" in names
    assert any(name != "meshlm-engine" for name in names)  # the event loop's thread, at least


def test_logit_bias_and_allowed_token_ids(stub, mesh):
    """SGLang's native logit_bias ({"<id>": bias}) over HTTP, meshlm's field 103 over gRPC, and
    OpenAI's on /v1/completions: -100 keeps a token out, +100 all but forces it."""
    base = mesh.addresses.gateway_http

    def native(bias: dict[str, float]) -> dict:
        r = httpx.post(f"{base}/generate", timeout=60, json={"text": "Once upon a time",
                       "sampling_params": {"temperature": 0, "max_new_tokens": 4,
                                           "ignore_eos": True, "logit_bias": bias}})
        assert r.status_code == 200, r.text
        return r.json()

    first = native({})["output_ids"][0]
    assert native({str(first): -100})["output_ids"][0] != first
    forced = native({"77": 100})
    assert forced["output_ids"] == [77] * 4
    msgs = list(stub.TextGenerate(text_request("Once upon a time", stream=False, max_new_tokens=4,
                                               ignore_eos=True, logit_bias={77: 100.0})))
    assert msgs[-1].text == forced["text"]
    openai = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "logit_bias": {"77": 100}}).json()
    assert openai["choices"][0]["text"] == forced["text"]
    # vLLM's allowed_token_ids (meshlm's field 104): only those are drawn, sampling or not.
    for temperature in (0, 1):
        r = httpx.post(f"{base}/generate", timeout=60, json={"input_ids": [5, 6, 7],
                       "sampling_params": {"temperature": temperature, "max_new_tokens": 16,
                                           "ignore_eos": True, "allowed_token_ids": [77, 78]}})
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 16 and set(r.json()["output_ids"]) <= {77, 78}
    only = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "allowed_token_ids": [77]}).json()
    assert only["choices"][0]["text"] == forced["text"]
    bad = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "prompt": "a", "logit_bias": {"77": 1000}})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == \
        "logit_bias: the bias of token 77 must be in [-100, 100], got 1000"
    oov = httpx.post(f"{base}/generate", timeout=60, json={
        "text": "a", "sampling_params": {"logit_bias": {"99999": 1}}})
    assert oov.status_code == 400
    assert oov.json()["error"]["message"].startswith(
        "sampling_params.logit_bias: token id 99999 is out of range")
