"""TokenHistogram exposes what prometheus_client's Histogram exposes for the same observations
(text and OpenMetrics, `_created` included), n observations of one value in one call."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from meshlm.common.metrics_histogram import TokenHistogram

BOUNDS = (0.01, 0.025, 0.05, 0.1)
# (value, times): on a bound, within one, between bounds, past the last, zero (binary fractions
# where times > 1, so that n * value and n additions of it give the same sum)
OBSERVED = [(0.01, 1), (0.0078125, 2), (0.015625, 1), (0.25, 3), (0.0, 1), (0.046875, 4)]


def expositions(registry: CollectorRegistry) -> tuple[bytes, bytes]:
    return generate_latest(registry), openmetrics_latest(registry, escaping="allow-utf-8")


def test_the_same_series_as_prometheus_clients_histogram() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("vllm:gap_seconds", "Gaps.", ["model_name"], buckets=BOUNDS,
                          registry=theirs)
    lean = TokenHistogram("vllm:gap_seconds", "Gaps.", ["model_name"], BOUNDS, ours)
    for model in ("a", "b"):
        expected, got = reference.labels(model), lean.labels(model)
        for value, times in OBSERVED:
            for _ in range(times):
                expected.observe(value)
            got.observe(value, times)
        got.created = expected._created  # the one figure that differs: when each began
    assert expositions(ours) == expositions(theirs)
    assert ours.get_sample_value("vllm:gap_seconds_count", {"model_name": "a"}) == 12
    assert ours.get_sample_value("vllm:gap_seconds_bucket",
                                 {"model_name": "b", "le": "0.05"}) == 9  # 1 + 2 + 1 + 1 + 4


def test_one_observation_by_default_and_labels_are_checked() -> None:
    registry = CollectorRegistry()
    lean = TokenHistogram("x_seconds", "X.", ["model_name"], [1.0, float("inf")], registry)
    lean.labels("m").observe(2.0)
    assert registry.get_sample_value("x_seconds_bucket", {"model_name": "m", "le": "1.0"}) == 0
    assert registry.get_sample_value("x_seconds_bucket",
                                     {"model_name": "m", "le": "+Inf"}) == 1
    assert registry.get_sample_value("x_seconds_sum", {"model_name": "m"}) == 2.0
    with pytest.raises(ValueError, match="expected labels"):
        lean.labels("m", "extra")
