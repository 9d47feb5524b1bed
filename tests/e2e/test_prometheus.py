"""Prometheus metrics end to end: after real requests, the gateway's /metrics and a scheduler's
metrics port moved by exactly what the requests returned (tokens, requests by finish reason,
one TTFT per request, one inter-token latency per later token), and the load gauges show a
request while it runs."""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import grpc
import pytest
from helpers import (
    Samples,
    scrape,
    text_request,
    total,
    wait_idle,
    wait_until,
)

from sglang.runtime.v1 import sglang_pb2 as pb


def model_name(samples: Samples) -> str:
    names = {dict(ls).get("model_name") for (n, ls) in samples if n.startswith("vllm:")}
    names.discard(None)
    assert len(names) == 1, names
    return str(names.pop())


@pytest.fixture(scope="module")
def urls(mesh) -> tuple[str, str]:
    return (f"{mesh.addresses.gateway_http}/metrics",
            f"http://{mesh.service('scheduler').metrics_address}/metrics")


def test_counters_move_by_what_the_requests_returned(mesh, stub, urls):
    gateway_url, scheduler_url = urls
    wait_idle(mesh)
    before, engine_before = scrape(gateway_url), scrape(scheduler_url)
    finals: list[pb.TextGenerateResponse] = []
    returned = itl = 0
    # Streaming: each message is one update the gateway saw; every token after the first
    # message's is one inter-token latency observation.
    for text, tokens in (("The capital of France", 12), ("Once upon a time", 5)):
        msgs = list(stub.TextGenerate(text_request(text, max_new_tokens=tokens), timeout=120))
        ids = [len(m.output_ids) for m in msgs]
        first = next(i for i, n in enumerate(ids) if n)
        itl += sum(ids[first + 1:])
        returned += sum(ids)
        finals.append(msgs[-1])
    # Not streaming, two samples: two child requests, each counted.
    req = text_request("A B C D", stream=False, max_new_tokens=6, n=2, seed=3, temperature=0.7)
    samples = list(stub.TextGenerate(req, timeout=120))
    assert len(samples) == 2
    finals += samples
    returned += sum(len(m.output_ids) for m in samples)
    after, engine_after = scrape(gateway_url), scrape(scheduler_url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    meta = [m.meta_info for m in finals]
    completion = sum(int(m["completion_tokens"]) for m in meta)
    prompt = sum(int(m["prompt_tokens"]) for m in meta)
    cached = sum(int(m["cached_tokens"]) for m in meta)
    assert completion == returned > 0 and itl > 0
    model = model_name(after)
    for prefix in ("vllm", "sglang"):
        assert delta(f"{prefix}:generation_tokens_total", model_name=model) == completion
        assert delta(f"{prefix}:prompt_tokens_total", model_name=model) == prompt
        assert delta(f"{prefix}:time_to_first_token_seconds_count") == len(finals)
        assert delta(f"{prefix}:e2e_request_latency_seconds_count") == len(finals)
        # The two samples arrive as the gateway saw them, unknown to this client: between
        # one gap for all their later tokens and one per token.
        sample_tokens = sum(int(m.meta_info["completion_tokens"]) for m in samples)
        assert itl <= delta(f"{prefix}:inter_token_latency_seconds_count") <= (
            itl + sample_tokens - len(samples))
    assert delta("sglang:cached_tokens_total") == cached
    assert delta("sglang:num_requests_total") == len(finals)
    for reason, count in Counter(m["finish_reason"] for m in meta).items():
        assert delta("vllm:request_success_total", finished_reason=reason) == count
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == completion

    def engine_delta(name: str) -> float:
        return (total(engine_after, name, model_name=model)
                - total(engine_before, name, model_name=model))

    # The engine saw the same prompts and made the same tokens.

    assert engine_delta("vllm:prefix_cache_queries_total") == prompt
    assert engine_delta("vllm:prefix_cache_hits_total") == cached
    assert engine_delta("meshlm:engine_generation_tokens_total") == completion
    assert engine_delta("meshlm:engine_finished_requests_total") == len(finals)
    # Its forward passes took CPU, and no more than the whole scheduler process did.
    forward = engine_delta("meshlm:engine_forward_cpu_seconds_total")
    process = (total(engine_after, "process_cpu_seconds_total")
               - total(engine_before, "process_cpu_seconds_total"))
    # The process figure counts user and system time apart, each in 10 ms ticks.
    assert 0 < forward <= process + 0.02


def test_load_gauges_show_a_running_request_and_a_dropped_one_is_an_abort(mesh, stub, urls):
    gateway_url, scheduler_url = urls
    wait_idle(mesh)
    before = scrape(gateway_url)
    call = stub.TextGenerate(text_request("Keep going", rid=f"metrics-{uuid.uuid4().hex[:8]}",
                                          max_new_tokens=1500, ignore_eos=True), timeout=120)
    first = threading.Event()

    def read() -> None:
        try:
            for _ in call:
                first.set()
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first.wait(60), "no first message"
        wait_until(lambda: total(scrape(gateway_url), "vllm:num_requests_running",
                                 engine="0") >= 1, timeout=30, what="running on the gateway")
        engine = scrape(scheduler_url)
        assert total(engine, "vllm:num_requests_running") >= 1
        assert total(engine, "sglang:num_running_reqs") >= 1
        assert 0 < total(engine, "vllm:kv_cache_usage_perc") <= 1
        assert total(engine, "sglang:token_usage") == total(engine, "vllm:kv_cache_usage_perc")
    finally:
        call.cancel()
        reader.join(30)

    def aborted() -> float:
        return (total(scrape(gateway_url), "vllm:request_success_total", finished_reason="abort")
                - total(before, "vllm:request_success_total", finished_reason="abort"))

    wait_until(lambda: aborted() == 1, timeout=30, what="the dropped request counted as abort")
    wait_idle(mesh)
    assert total(scrape(gateway_url), "vllm:num_requests_running") == 0


def test_every_service_has_a_metrics_port(mesh):
    for name in ("gateway", "tokenizer", "scheduler", "detokenizer"):
        samples = scrape(f"http://{mesh.service(name).metrics_address}/metrics")
        assert total(samples, "process_cpu_seconds_total") > 0, name
    tokenizer = scrape(f"http://{mesh.service('tokenizer').metrics_address}/metrics")
    assert total(tokenizer, "meshlm:tokenizer_requests_total") > 0
    detokenizer = scrape(f"http://{mesh.service('detokenizer').metrics_address}/metrics")
    assert total(detokenizer, "meshlm:detokenizer_outputs_total") > 0
