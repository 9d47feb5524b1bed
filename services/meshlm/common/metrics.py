"""Prometheus metrics of every service role.

The names are the ones users' dashboards already know, vLLM's `vllm:*` and SGLang's `sglang:*`,
labelled `model_name`; figures only meshlm has are `meshlm:*`. One class per role:

- GatewayMetrics: request-level figures, measured where the gateway sees each request's outputs
  (time to first token, inter-token latency, e2e latency, prompt and generation tokens, finished
  requests by reason), plus each scheduler's load gauges, fetched at every scrape and labelled
  `engine` (the scheduler's dp_rank, as vLLM labels its engine cores).
- SchedulerMetrics: the engine's load, KV cache and totals, read from `Engine.stats()` at scrape
  time (no per-step cost; the figures are listed in metrics_engine.py).
- TokenizerMetrics, DetokenizerMetrics: meshlm's own work counters.
- LauncherMetrics: restarts and up/down of each service the launcher (`make run`) supervises.

Token counters and latencies exist only at the gateway and engine counters only at the
scheduler, so scraping every port counts nothing twice; the load gauges are the exception (the
scheduler's port and, labelled `engine`, each gateway's /metrics).

Every instance owns its CollectorRegistry (no process-global state, so tests can build many).
The gateway serves its registry at /metrics on its HTTP port; every service can also serve its
own on `--metrics-port` (metrics_server.py's MetricsServer). Histogram buckets are in
metrics_buckets.py; the inter-token latency and the generation tokens, counted per update,
are metrics_histogram.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

from meshlm.common.logs import get_logger
from meshlm.common.metrics_buckets import (
    SGLANG_E2E_BUCKETS,
    SGLANG_ITL_BUCKETS,
    SGLANG_TTFT_BUCKETS,
    TOKEN_BUCKETS,
    VLLM_E2E_BUCKETS,
    VLLM_ITL_BUCKETS,
    VLLM_TTFT_BUCKETS,
)
from meshlm.common.metrics_engine import EngineCollector
from meshlm.common.metrics_histogram import Buckets, Count, TokenCounter, TokenHistogram

log = get_logger(__name__)

MODEL = ["model_name"]

class ServiceMetrics:
    """A service's registry (with the process and Python collectors) and how it is scraped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    async def refresh(self) -> None:
        """Fetch figures that live elsewhere; runs before every scrape."""

    async def scrape(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition body in the format `accept` asks for (text 0.0.4 or OpenMetrics),
        and its content type."""
        await self.refresh()
        encoder, content_type = choose_encoder(accept or "")
        if content_type.startswith(OPENMETRICS) and "escaping=" not in (accept or ""):
            # prometheus_client's default for OpenMetrics rewrites `vllm:x` to `vllm_x` in the
            # samples (not in HELP/TYPE), so a Prometheus 2 scrape loses every vllm:/sglang:
            # name. Colons are legal OpenMetrics names: keep them, as the text format does.
            return openmetrics_latest(self.registry, escaping="allow-utf-8"), \
                f"{OPENMETRICS}; version=1.0.0; charset=utf-8"
        return encoder(self.registry), content_type


OPENMETRICS = "application/openmetrics-text"


class Alias(Collector):
    """`source`'s series under a second name, read at scrape time: where two dashboards'
    names mean the same figure (vLLM's deprecated time_per_output_token, SGLang's and vLLM's
    token counters), it is counted once per token, not once per name."""

    def __init__(self, source: Collector, name: str, documentation: str,
                 registry: CollectorRegistry) -> None:
        self._source = source
        self._name = name
        self._documentation = documentation
        registry.register(self)

    def describe(self) -> list[Metric]:
        return self.collect()

    def collect(self) -> list[Metric]:
        aliases = []
        for metric in self._source.collect():
            alias = Metric(self._name, self._documentation, metric.type, metric.unit)
            alias.samples = [sample._replace(name=self._name + sample.name[len(metric.name):])
                             for sample in metric.samples]
            aliases.append(alias)
        return aliases


# ---- the gateway -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _RequestSeries:
    """One model's labelled request-level series (resolved once per request, not per token)."""

    model_name: str
    success: TokenCounter  # unlabelled parent: finished_reason varies per request
    ttft: tuple[Buckets, ...]
    itl: tuple[Buckets, ...]  # observed per token
    e2e: tuple[Buckets, ...]
    prompt_tokens: tuple[Count, ...]
    generation_tokens: tuple[Count, ...]
    cached_tokens: Count
    prompt_lengths: Buckets
    generation_lengths: Buckets
    finished: Count
    aborted: Count


class RequestMetrics:
    """The clock of one request (one child of an n > 1 request) as the gateway sees its outputs.

    `output()` on every update: the first one that carries generated tokens gives the time to
    first token; each later one gives inter-token latency as SGLang measures it (the gap since
    the previous update, shared by the tokens that arrived in it: one observation per token);
    the one with a finish reason ends the request. `finish()` alone ends one that stopped
    without its final output (the client went away)."""

    def __init__(self, series: _RequestSeries) -> None:
        self._s = series
        self._started = self._last = time.monotonic()
        self._prompt_tokens = 0
        self._tokens = 0
        self._seen = False
        self._done = False

    def output(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               finish_reason: str | None = None) -> None:
        if self._done:
            return
        s, now = self._s, time.monotonic()
        if not self._seen:
            self._seen = True
            self._prompt_tokens = prompt_tokens
            for counter in s.prompt_tokens:
                counter.inc(prompt_tokens)
            s.cached_tokens.inc(cached_tokens)
        new = completion_tokens - self._tokens
        if new > 0:
            if self._tokens == 0:
                for h in s.ttft:
                    h.observe(now - self._started)
            else:
                gap = (now - self._last) / new
                for itl in s.itl:
                    itl.observe(gap, new)
            for count in s.generation_tokens:
                count.inc(new)
            self._tokens, self._last = completion_tokens, now
        if finish_reason is not None:
            self.finish(finish_reason)

    def finish(self, reason: str) -> None:
        """End the request (`reason`: stop, length, abort, ...); later calls do nothing."""
        if self._done:
            return
        self._done = True
        s = self._s
        for h in s.e2e:
            h.observe(time.monotonic() - self._started)
        s.success.labels(s.model_name, reason).inc()
        s.finished.inc()
        if reason == "abort":
            s.aborted.inc()
        s.prompt_lengths.observe(self._prompt_tokens)
        s.generation_lengths.observe(self._tokens)


EngineLoads = Callable[[], Awaitable[list[tuple[int, dict[str, Any]]]]]


class GatewayMetrics(ServiceMetrics):
    """Request-level metrics (`track()` one RequestMetrics per request) and, at each scrape,
    the schedulers' load gauges from `engine_loads()`: (dp_rank, Engine.stats()) pairs."""

    def __init__(self, model_name: Callable[[], str], engine_loads: EngineLoads | None = None,
                 load_timeout: float = 3.0,
                 registry_degraded: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._model_name = model_name
        self._engine_loads = engine_loads
        self._load_timeout = load_timeout
        self._series: dict[str, _RequestSeries] = {}
        self._engines: list[tuple[list[str], dict[str, Any]]] = []
        r = self.registry

        # Every request-level series is a lean one (metrics_histogram.py): observed on the
        # event loop only, without prometheus_client's locks (a request's dozen observations
        # through them cost the gateway about 13 µs).
        def hist(name: str, doc: str, buckets: Iterable[float]) -> TokenHistogram:
            return TokenHistogram(name, doc, MODEL, buckets, r)

        def counter(name: str, doc: str, labels: list[str] = MODEL) -> TokenCounter:
            return TokenCounter(name, doc, labels, r)

        self._ttft = (
            hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                 "seconds.", VLLM_TTFT_BUCKETS),
            hist("sglang:time_to_first_token_seconds", "Histogram of time to first token in "
                 "seconds.", SGLANG_TTFT_BUCKETS))
        self._itl = (
            TokenHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token "
                           "latency in seconds.", MODEL, VLLM_ITL_BUCKETS, r),
            TokenHistogram("sglang:inter_token_latency_seconds", "Histogram of inter-token "
                           "latency in seconds.", MODEL, SGLANG_ITL_BUCKETS, r))
        Alias(self._itl[0], "vllm:time_per_output_token_seconds", "Histogram of time per "
              "output token in seconds. DEPRECATED: use vllm:inter_token_latency_seconds.", r)
        self._e2e = (
            hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                 "seconds.", VLLM_E2E_BUCKETS),
            hist("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency "
                 "in seconds", SGLANG_E2E_BUCKETS))
        self._prompt_tokens = (
            counter("vllm:prompt_tokens", "Number of prefill tokens processed."),
            counter("sglang:prompt_tokens", "Number of prefill tokens processed."))
        self._generation_tokens = (  # counted per update: the lean counter
            TokenCounter("vllm:generation_tokens", "Number of generation tokens processed.",
                         MODEL, r),)
        Alias(self._generation_tokens[0], "sglang:generation_tokens",
              "Number of generation tokens processed.", r)
        self._cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self._prompt_lengths = hist("vllm:request_prompt_tokens", "Number of prefill tokens "
                                    "processed.", TOKEN_BUCKETS)
        self._generation_lengths = hist("vllm:request_generation_tokens", "Number of generation "
                                        "tokens processed.", TOKEN_BUCKETS)
        self._success = counter("vllm:request_success", "Count of successfully processed "
                                "requests.", [*MODEL, "finished_reason"])
        self._finished = counter("sglang:num_requests", "Number of requests processed.")
        self._aborted = counter("sglang:num_aborted_requests", "Number of requests aborted.")
        r.register(EngineCollector(["model_name", "engine"], lambda: self._engines,
                                   counters=False))
        if registry_degraded is not None:
            Gauge("meshlm:registry_degraded", "1 while the RID registry (Redis) is unreachable "
                  "and the gateway runs on local knowledge.", registry=r).set_function(
                      lambda: float(registry_degraded()))

    def track(self) -> RequestMetrics:
        """Start the clock of one request (call when it is dispatched)."""
        return RequestMetrics(self._series_for(self._model_name()))

    def _series_for(self, model: str) -> _RequestSeries:
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = _RequestSeries(
                model_name=model, success=self._success,
                ttft=tuple(h.labels(model) for h in self._ttft),
                itl=tuple(h.labels(model) for h in self._itl),
                e2e=tuple(h.labels(model) for h in self._e2e),
                prompt_tokens=tuple(c.labels(model) for c in self._prompt_tokens),
                generation_tokens=tuple(c.labels(model) for c in self._generation_tokens),
                cached_tokens=self._cached_tokens.labels(model),
                prompt_lengths=self._prompt_lengths.labels(model),
                generation_lengths=self._generation_lengths.labels(model),
                finished=self._finished.labels(model), aborted=self._aborted.labels(model))
        return series

    async def refresh(self) -> None:
        """Fetch every scheduler's load; one that does not answer in time is left out."""
        if self._engine_loads is None:
            return
        try:
            loads = await asyncio.wait_for(self._engine_loads(), self._load_timeout)
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail for want of gauges
            log.warning("engine_loads_failed", error=repr(exc))
            loads = []
        model = self._model_name()
        self._engines = [([model, str(rank)], stats) for rank, stats in loads]


# ---- the scheduler ---------------------------------------------------------------------------


class SchedulerMetrics(ServiceMetrics):
    """The engine's gauges and totals, read from `stats()` (Engine.stats) at each scrape."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]]) -> None:
        super().__init__()
        self.registry.register(EngineCollector(MODEL, lambda: [([model_name], stats())],
                                               counters=True))


# ---- the tokenizer and the detokenizer -------------------------------------------------------


class TokenizerMetrics(ServiceMetrics):
    def __init__(self, model_name: str) -> None:
        super().__init__()
        r = self.registry
        self._requests = Counter("meshlm:tokenizer_requests", "Requests tokenized and sent to "
                                 "a scheduler.", MODEL, registry=r).labels(model_name)
        self._tokens = Counter("meshlm:tokenizer_prompt_tokens", "Prompt tokens of the requests "
                               "sent to a scheduler.", MODEL, registry=r).labels(model_name)
        self._rejected = Counter("meshlm:tokenizer_rejected_requests", "Requests refused (the "
                                 "prompt does not fit the context).", MODEL,
                                 registry=r).labels(model_name)

    def forwarded(self, requests: int, prompt_tokens: int, rejected: int) -> None:
        """One batch: requests sent on, their prompt tokens, requests refused."""
        self._requests.inc(requests)
        self._tokens.inc(prompt_tokens)
        self._rejected.inc(rejected)


class DetokenizerMetrics(ServiceMetrics):
    def __init__(self, model_name: str, active: Callable[[], int]) -> None:
        super().__init__()
        r = self.registry
        self._outputs = Counter("meshlm:detokenizer_outputs", "Token outputs decoded (one per "
                                "request per engine step).", MODEL, registry=r).labels(model_name)
        self._stops = Counter("meshlm:detokenizer_stop_strings", "Requests finished by a stop "
                              "string.", MODEL, registry=r).labels(model_name)
        Gauge("meshlm:detokenizer_requests", "Requests being decoded.", MODEL,
              registry=r).labels(model_name).set_function(active)

    def decoded(self, outputs: int, stopped: int) -> None:
        """One batch: outputs decoded, requests that matched a stop string."""
        self._outputs.inc(outputs)
        self._stops.inc(stopped)


# ---- the launcher (make run) -----------------------------------------------------------------


class LauncherMetrics(ServiceMetrics):
    """The launcher's supervision of its children, labelled `service` (its name, e.g.
    "scheduler-1") and `role`. Served by the launcher on --launcher-metrics-port."""

    def __init__(self) -> None:
        super().__init__()
        labels = ["service", "role"]
        self.restarts = Counter("meshlm:service_restarts", "Times the launcher restarted a "
                                "service that exited on its own.", labels, registry=self.registry)
        self.up = Gauge("meshlm:service_up", "1 while the service's process runs, 0 from its "
                        "exit until it is started again.", labels, registry=self.registry)
