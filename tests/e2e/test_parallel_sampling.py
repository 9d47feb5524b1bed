"""n > 1 samples of one prompt: fan-out into child requests, shared prompt KV, seeds, indices
over gRPC and /generate, and abort of the parent."""

from __future__ import annotations

import json
import random
import uuid
from collections import defaultdict

import grpc
import httpx
import pytest
from helpers import mesh_credentials, scheduler_load, text_request, wait_until

from sglang.runtime.v1 import sglang_pb2 as pb


def _gateway_requests(stub) -> tuple[int, int]:
    info = json.loads(stub.GetServerInfo(pb.GetServerInfoRequest()).json_info)
    return info["requests_in_flight"], info["request_groups"]


def _by_index(msgs) -> dict[int, list]:
    out: dict[int, list] = defaultdict(list)
    for m in msgs:
        out[int(m.meta_info["index"])].append(m)
    return out


def test_greedy_n3_gives_three_identical_finished_choices_in_order(stub):
    rid = f"par-{uuid.uuid4().hex[:8]}"
    msgs = list(stub.TextGenerate(text_request("Once upon a time", stream=False, rid=rid, n=3,
                                               ignore_eos=True), timeout=120))
    assert [int(m.meta_info["index"]) for m in msgs] == [0, 1, 2]
    assert all(m.finished and m.meta_info["finish_reason"] == "length" for m in msgs)
    assert [m.meta_info["id"] for m in msgs] == [f"{rid}-{i}" for i in range(3)]
    assert len({m.text for m in msgs}) == 1 and msgs[0].text
    assert all(int(m.meta_info["completion_tokens"]) == 16 for m in msgs)


def test_streaming_n3_tags_every_message_with_its_index(stub):
    msgs = list(stub.TextGenerate(text_request("The sea", n=3, max_new_tokens=8,
                                               ignore_eos=True), timeout=120))
    choices = _by_index(msgs)
    assert sorted(choices) == [0, 1, 2]
    for index, chunks in choices.items():
        assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        assert chunks[-1].meta_info["id"].endswith(f"-{index}")
        assert sum(len(c.output_ids) for c in chunks) == 8
    assert len({"".join(c.text for c in chunks) for chunks in choices.values()}) == 1


def test_seeded_samples_differ_from_each_other_and_repeat(stub):
    def sample() -> list[list[int]]:
        req = pb.GenerateRequest(input_ids=[5, 6, 7, 8], sampling_params=pb.SamplingParams(
            temperature=1.0, max_new_tokens=12, ignore_eos=True, n=3, seed=4242))
        return [list(m.output_ids) for m in stub.Generate(req, timeout=120)]

    first = sample()
    assert len(first) == 3 and len({tuple(s) for s in first}) == 3
    assert sample() == first


def test_followers_share_the_leaders_prompt_blocks(stub):
    rng = random.Random(uuid.uuid4().int)
    prompt = [rng.randrange(10, 1000) for _ in range(40)]  # two full 16-token blocks, unseen
    req = pb.GenerateRequest(input_ids=prompt, sampling_params=pb.SamplingParams(
        temperature=0.0, max_new_tokens=4, ignore_eos=True, n=4))
    msgs = list(stub.Generate(req, timeout=120))
    assert [int(m.meta_info["index"]) for m in msgs] == [0, 1, 2, 3]
    cached = [int(m.meta_info["cached_tokens"]) for m in msgs]
    assert cached[0] == 0
    assert all(c >= 32 for c in cached[1:]), cached
    assert len({tuple(m.output_ids) for m in msgs}) == 1


def test_http_generate_n_returns_a_list_or_indexed_events(mesh):
    base = mesh.addresses.gateway_http
    body = {"text": "The quick brown fox",
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "n": 2}}
    r = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()
    assert isinstance(results, list) and [x["index"] for x in results] == [0, 1]
    assert all(x["meta_info"]["finish_reason"]["type"] == "length" for x in results)
    assert results[0]["text"] == results[1]["text"]
    assert "index" not in results[0]["meta_info"]
    events = []
    with httpx.stream("POST", f"{base}/generate", json={**body, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    last = {c["index"]: c for c in chunks}
    assert sorted(last) == [0, 1]
    assert all(c["meta_info"]["finish_reason"]["type"] == "length" for c in last.values())
    assert last[0]["text"] == results[0]["text"]
    bad = httpx.post(f"{base}/generate", timeout=60, json={
        "text": "x", "sampling_params": {"n": 17}})
    assert bad.status_code == 400 and "sampling_params.n" in bad.text


def test_bad_n_is_invalid(stub):
    for n in (0, 17):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.TextGenerate(text_request("x", n=n), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling_params.n" in (err.value.details() or "")


def test_abort_of_the_parent_ends_every_child(mesh, stub):
    creds = mesh_credentials(mesh)
    rid = f"par-abort-{uuid.uuid4().hex[:8]}"
    stream = stub.TextGenerate(text_request("Abort us all", rid=rid, n=3, max_new_tokens=1500,
                                            ignore_eos=True))
    first = next(stream)
    assert not first.finished
    wait_until(lambda: scheduler_load(mesh, creds).running == 3, what="three children running")
    assert stub.Abort(pb.AbortRequest(rid=rid)).success
    rest = [first, *stream]
    finals = [m for m in rest if m.finished]
    assert sorted(int(m.meta_info["index"]) for m in finals) == [0, 1, 2]
    assert all(m.meta_info["finish_reason"] == "abort" for m in finals)
    wait_until(lambda: scheduler_load(mesh, creds).running == 0, what="slots freed")
    wait_until(lambda: _gateway_requests(stub) == (0, 0), what="gateway table empty")


def test_cancel_of_an_n_request_aborts_every_child(mesh, stub):
    creds = mesh_credentials(mesh)
    before = scheduler_load(mesh, creds).aborted_total
    stream = stub.TextGenerate(text_request("Cancel us", n=2, max_new_tokens=1500,
                                            ignore_eos=True))
    next(stream)
    stream.cancel()
    wait_until(lambda: scheduler_load(mesh, creds).aborted_total == before + 2,
               what="both children aborted")
    wait_until(lambda: scheduler_load(mesh, creds).running == 0, what="slots freed")
    wait_until(lambda: _gateway_requests(stub) == (0, 0), what="gateway table empty")
