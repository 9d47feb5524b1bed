"""The engine's figures as Prometheus metrics, read from `Engine.stats()` at scrape time.

ENGINE_GAUGES (load, KV cache) are served by the scheduler and, labelled `engine`, by each
gateway; ENGINE_COUNTERS (totals) by the scheduler only. EngineCollector turns stats dicts into
those families at each scrape (no per-step cost). Used by common/metrics.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# (name, help, value from Engine.stats()): gauges of the engine's state...
ENGINE_GAUGES: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.",
     lambda s: s["running"]),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
     lambda s: s["waiting"]),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     lambda s: s["token_usage"]),
    ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. DEPRECATED: use "
     "vllm:kv_cache_usage_perc.", lambda s: s["token_usage"]),
    ("sglang:num_running_reqs", "The number of running requests.", lambda s: s["running"]),
    ("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
     lambda s: s["waiting"]),
    ("sglang:token_usage", "The token usage.", lambda s: s["token_usage"]),
    ("sglang:num_used_tokens", "The number of used tokens.", lambda s: s["kv_tokens_used"]),
    ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
     lambda s: s["kv_blocks_total"] * s["kv_block_size"]),
)
# ...and its totals (the scheduler's port only: the gateway counts tokens as clients get them).
ENGINE_COUNTERS: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
     lambda s: s["preempted_total"]),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     lambda s: s["prompt_tokens_total"]),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     lambda s: s["cached_tokens_total"]),
    ("meshlm:engine_generation_tokens", "Tokens the engine generated (also those of requests "
     "later stopped or aborted).", lambda s: s["generated_tokens_total"]),
    ("meshlm:engine_finished_requests", "Requests the engine ended, aborts and errors "
     "included.", lambda s: s["finished_total"]),
    ("meshlm:engine_aborted_requests", "Requests the engine ended by abort.",
     lambda s: s["aborted_total"]),
    ("meshlm:engine_forward_cpu_seconds", "CPU seconds of the engine's forward passes, "
     "sampling included (the rest of the scheduler's CPU is its service's own work).",
     lambda s: s["forward_cpu_seconds_total"]),
)


class EngineCollector(Collector):
    """Engine figures from `rows()`: (label values, Engine.stats()) per engine, read at scrape
    time. A figure missing from a stats dict is left out for that engine."""

    def __init__(self, labels: list[str],
                 rows: Callable[[], list[tuple[list[str], dict[str, Any]]]],
                 counters: bool) -> None:
        self._labels = labels
        self._rows = rows
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        rows = self._rows()
        families: list[tuple[GaugeMetricFamily | CounterMetricFamily,
                             Callable[[dict[str, Any]], float]]] = [
            (GaugeMetricFamily(name, doc, labels=self._labels), value)
            for name, doc, value in ENGINE_GAUGES]
        if self._counters:
            families += [(CounterMetricFamily(name, doc, labels=self._labels), value)
                         for name, doc, value in ENGINE_COUNTERS]
        for family, value in families:
            for labels, stats in rows:
                with contextlib.suppress(KeyError, TypeError):
                    family.add_metric(labels, float(value(stats)))
            yield family
