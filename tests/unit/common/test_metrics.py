"""Metrics of every role: request clocks (TTFT, inter-token latency, e2e, token counts, finish
reasons), engine figures read at scrape time, per-instance registries, exposition formats and
the metrics port."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from meshlm.common.metrics import (
    DetokenizerMetrics,
    GatewayMetrics,
    SchedulerMetrics,
    TokenizerMetrics,
)
from meshlm.common.metrics_buckets import buckets_1_2_5
from meshlm.common.metrics_engine import ENGINE_COUNTERS, ENGINE_GAUGES
from meshlm.common.metrics_server import MetricsServer
from meshlm.scheduler.engine.policy import BatchPlanner

M = {"model_name": "tiny"}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, {**M, **labels})
    assert got is not None, f"no sample {name} {labels}"
    return got


def test_a_request_records_ttft_then_one_itl_per_later_token_then_its_end():
    metrics = GatewayMetrics(lambda: "tiny")
    r = metrics.registry
    clock = metrics.track()
    clock.output(prompt_tokens=5, completion_tokens=1, cached_tokens=2)
    clock.output(prompt_tokens=5, completion_tokens=3, cached_tokens=2)  # two tokens at once
    clock.output(prompt_tokens=5, completion_tokens=4, cached_tokens=2, finish_reason="length")
    for prefix in ("vllm", "sglang"):
        assert value(r, f"{prefix}:prompt_tokens_total") == 5
        assert value(r, f"{prefix}:generation_tokens_total") == 4
        assert value(r, f"{prefix}:time_to_first_token_seconds_count") == 1
        assert value(r, f"{prefix}:inter_token_latency_seconds_count") == 3
        assert value(r, f"{prefix}:e2e_request_latency_seconds_count") == 1
    assert value(r, "vllm:time_per_output_token_seconds_count") == 3
    assert value(r, "sglang:cached_tokens_total") == 2
    assert value(r, "vllm:request_success_total", finished_reason="length") == 1
    assert value(r, "sglang:num_requests_total") == 1
    assert value(r, "sglang:num_aborted_requests_total") == 0
    assert value(r, "vllm:request_prompt_tokens_sum") == 5
    assert value(r, "vllm:request_generation_tokens_sum") == 4
    # The inter-token gaps add up to the time from the first token to the last.
    ttft = value(r, "vllm:time_to_first_token_seconds_sum")
    e2e = value(r, "vllm:e2e_request_latency_seconds_sum")
    assert 0 <= value(r, "vllm:inter_token_latency_seconds_sum") <= e2e - ttft + 1e-6


@pytest.mark.parametrize("accept", ["text/plain", "application/openmetrics-text"])
def test_a_second_name_of_a_figure_shows_the_same_series_in_both_formats(accept: str):
    """vLLM's deprecated time_per_output_token and SGLang's token counter are read from the
    series they repeat at scrape time, so a token is counted once, and both names agree."""
    metrics = GatewayMetrics(lambda: "tiny")
    clock = metrics.track()
    for completion in (1, 2, 4):
        clock.output(prompt_tokens=5, completion_tokens=completion, cached_tokens=0)
    body, content_type = asyncio.run(metrics.scrape(accept))
    parse = (openmetrics_families if content_type.startswith("application/openmetrics-text")
             else text_string_to_metric_families)
    families = {f.name: f for f in parse(body.decode())}

    def series(name: str, kind: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        family = families[name]
        assert family.type == kind
        return {(s.name[len(name):], tuple(sorted(s.labels.items()))): s.value
                for s in family.samples}

    itl = series("vllm:inter_token_latency_seconds", "histogram")
    assert itl[("_count", tuple(M.items()))] == 3
    assert series("vllm:time_per_output_token_seconds", "histogram") == itl
    tokens = series("vllm:generation_tokens", "counter")
    assert tokens[("_total", tuple(M.items()))] == 4
    assert series("sglang:generation_tokens", "counter") == tokens


def test_an_abandoned_request_is_an_abort_and_later_outputs_are_ignored():
    metrics = GatewayMetrics(lambda: "tiny")
    r = metrics.registry
    clock = metrics.track()
    clock.output(prompt_tokens=3, completion_tokens=2, cached_tokens=0)
    clock.finish("abort")
    clock.finish("abort")
    clock.output(prompt_tokens=3, completion_tokens=9, cached_tokens=0, finish_reason="stop")
    assert value(r, "vllm:request_success_total", finished_reason="abort") == 1
    assert r.get_sample_value("vllm:request_success_total",
                              {**M, "finished_reason": "stop"}) is None
    assert value(r, "sglang:num_aborted_requests_total") == 1
    assert value(r, "vllm:generation_tokens_total") == 2
    assert value(r, "vllm:e2e_request_latency_seconds_count") == 1


def test_an_embedding_counts_its_prompt_and_latency_but_no_token_timings():
    metrics = GatewayMetrics(lambda: "tiny")
    r = metrics.registry
    metrics.track().output(prompt_tokens=7, completion_tokens=0, cached_tokens=0,
                           finish_reason="stop")
    assert value(r, "vllm:prompt_tokens_total") == 7
    assert value(r, "vllm:time_to_first_token_seconds_count") == 0
    assert value(r, "vllm:e2e_request_latency_seconds_count") == 1


def test_the_model_name_label_follows_the_served_name():
    name = ["first"]
    metrics = GatewayMetrics(lambda: name[0])
    metrics.track().output(prompt_tokens=1, completion_tokens=1, cached_tokens=0)
    name[0] = "second"
    metrics.track().output(prompt_tokens=2, completion_tokens=1, cached_tokens=0)
    r = metrics.registry
    assert r.get_sample_value("vllm:prompt_tokens_total", {"model_name": "first"}) == 1
    assert r.get_sample_value("vllm:prompt_tokens_total", {"model_name": "second"}) == 2


def test_every_instance_has_its_own_registry():
    a, b = GatewayMetrics(lambda: "tiny"), GatewayMetrics(lambda: "tiny")
    a.track().output(prompt_tokens=4, completion_tokens=1, cached_tokens=0)
    assert value(a.registry, "vllm:prompt_tokens_total") == 4
    assert b.registry.get_sample_value("vllm:prompt_tokens_total", M) is None


def _stats(**overrides: Any) -> dict[str, Any]:
    # The real keys: the planner's, and the one the engine adds (its forward passes' CPU).
    stats = BatchPlanner(max_running=4, max_model_len=64, num_blocks=8).stats()
    return {**stats, "forward_cpu_seconds_total": 0.0, **overrides}


def test_every_engine_figure_reads_the_real_engine_stats():
    stats = _stats()
    for _, _, read in ENGINE_GAUGES + ENGINE_COUNTERS:
        assert isinstance(read(stats), int | float)


async def test_the_scheduler_exports_its_engine_at_scrape_time():
    live = {"now": _stats(running=2, waiting=1, token_usage=0.25, preempted_total=3,
                          prompt_tokens_total=40, cached_tokens_total=16, kv_tokens_used=20)}
    metrics = SchedulerMetrics("tiny", lambda: live["now"])
    r = metrics.registry
    assert value(r, "vllm:num_requests_running") == 2
    assert value(r, "sglang:num_running_reqs") == 2
    assert value(r, "vllm:num_requests_waiting") == value(r, "sglang:num_queue_reqs") == 1
    assert value(r, "vllm:kv_cache_usage_perc") == value(r, "vllm:gpu_cache_usage_perc") == 0.25
    assert value(r, "sglang:token_usage") == 0.25
    assert value(r, "sglang:num_used_tokens") == 20
    assert value(r, "sglang:max_total_num_tokens") == 8 * 16
    assert value(r, "vllm:num_preemptions_total") == 3
    assert value(r, "vllm:prefix_cache_queries_total") == 40
    assert value(r, "vllm:prefix_cache_hits_total") == 16
    live["now"] = _stats(running=0)
    assert value(r, "vllm:num_requests_running") == 0
    body, content_type = await metrics.scrape()
    assert content_type.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["vllm:num_preemptions"].type == "counter"
    assert families["vllm:num_requests_waiting"].type == "gauge"
    assert "process_cpu_seconds" in families  # the process collector is there too


async def test_the_gateway_exports_each_schedulers_load_by_engine():
    async def loads() -> list[tuple[int, dict[str, Any]]]:
        return [(0, _stats(running=3)), (1, {"running": 1})]  # rank 1: figures missing

    metrics = GatewayMetrics(lambda: "tiny", loads)
    await metrics.scrape()
    r = metrics.registry
    assert value(r, "vllm:num_requests_running", engine="0") == 3
    assert value(r, "vllm:num_requests_running", engine="1") == 1
    assert r.get_sample_value("vllm:kv_cache_usage_perc", {**M, "engine": "1"}) is None
    # Engine totals are the scheduler port's alone: scraping both must not count them twice.
    assert r.get_sample_value("vllm:num_preemptions_total", {**M, "engine": "0"}) is None


async def test_a_failed_load_fetch_leaves_the_gauges_out_but_the_scrape_works():
    async def loads() -> list[tuple[int, dict[str, Any]]]:
        raise ConnectionError("scheduler down")

    metrics = GatewayMetrics(lambda: "tiny", loads)
    body, _ = await metrics.scrape()
    assert b"vllm:num_requests_running{" not in body
    assert b"# TYPE vllm:e2e_request_latency_seconds histogram" in body


async def test_openmetrics_when_the_scraper_asks_for_it():
    metrics = TokenizerMetrics("tiny")
    body, content_type = await metrics.scrape("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    # vllm:/sglang:/meshlm: names keep their colons in the samples, as in the text format
    # (Prometheus 2 asks for OpenMetrics first and stores what the samples say).
    assert b"\nmeshlm:tokenizer_requests_total{" in body
    assert b"meshlm_tokenizer_requests" not in body


def test_tokenizer_and_detokenizer_counters():
    tok = TokenizerMetrics("tiny")
    tok.forwarded(requests=3, prompt_tokens=30, rejected=1)
    assert value(tok.registry, "meshlm:tokenizer_requests_total") == 3
    assert value(tok.registry, "meshlm:tokenizer_prompt_tokens_total") == 30
    assert value(tok.registry, "meshlm:tokenizer_rejected_requests_total") == 1
    active = [5]
    detok = DetokenizerMetrics("tiny", lambda: active[0])
    detok.decoded(outputs=4, stopped=1)
    assert value(detok.registry, "meshlm:detokenizer_outputs_total") == 4
    assert value(detok.registry, "meshlm:detokenizer_stop_strings_total") == 1
    assert value(detok.registry, "meshlm:detokenizer_requests") == 5


def test_token_buckets_are_vllms_1_2_5_series():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(1) == (1,)


async def test_the_metrics_port_serves_get_metrics_only():
    metrics = TokenizerMetrics("tiny")
    metrics.forwarded(requests=2, prompt_tokens=8, rejected=0)
    server = MetricsServer(metrics)
    address = await server.start("127.0.0.1", 0)
    try:
        assert address == server.address and not address.endswith(":0")
        async with httpx.AsyncClient(base_url=f"http://{address}") as client:
            r = await client.get("/metrics")
            assert r.status_code == 200
            assert 'meshlm:tokenizer_requests_total{model_name="tiny"} 2.0' in r.text
            assert (await client.get("/")).status_code == 404
            assert (await client.post("/metrics")).status_code == 405
    finally:
        await server.stop()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as client:
            await client.get(f"http://{address}/metrics")
