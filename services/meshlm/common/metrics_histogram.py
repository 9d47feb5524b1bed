"""A histogram and a counter for the gateway's per-token path: `observe(value, n)` records n
observations of one value (the tokens of one update share their gap) with a binary search and
two additions; `inc(n)` is one addition.

prometheus_client's Histogram takes one observation per call, scans its buckets in order and
takes a lock for each of its two increments: about 1 µs per token per histogram, paid on the
event loop for every streamed token. Only the event loop observes and scrapes (the gateway's
/metrics and --metrics-port run on it), so plain integers need no lock. A scrape reads the same
series prometheus_client would expose: cumulative `_bucket` samples with `le` as Go formats it,
`_count`, `_sum` and `_created`.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

C = TypeVar("C")


class Buckets:
    """One label set's counts."""

    __slots__ = ("_bounds", "counts", "sum", "created")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value` (the first bucket whose bound is >= it counts them)."""
        self.counts[bisect.bisect_left(self._bounds, value)] += n
        self.sum += value * n


class _Family(Collector, Generic[C]):
    """A lean metric with labels, registered in `registry`: `labels(...)` gives a label set's
    child (made by `child()`), to count into; the subclass says how it is exposed."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry, child: Callable[[], C]) -> None:
        self._name, self._documentation = name, documentation
        self._labelnames = list(labelnames)
        self._children: dict[tuple[str, ...], C] = {}
        self._child = child
        registry.register(self)

    def labels(self, *values: str) -> C:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._child()
        return child


class TokenHistogram(_Family[Buckets]):
    """A histogram with labels; its children are Buckets, to observe into."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Iterable[float], registry: CollectorRegistry) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = bounds
        self._le = [floatToGoString(b) for b in bounds]
        super().__init__(name, documentation, labelnames, registry, lambda: Buckets(bounds))

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> list[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in list(self._children.items()):
            cumulative = list(accumulate(child.counts))
            family.add_metric(list(values), list(zip(self._le, cumulative, strict=True)),
                              child.sum)
            family.add_sample(self._name + "_created", dict(zip(self._labelnames, values,
                                                                strict=True)), child.created)
        return [family]


class Count:
    """One label set's count."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0
        self.created = time.time()

    def inc(self, n: int = 1) -> None:
        self.value += n


class TokenCounter(_Family[Count]):
    """A counter with labels, exposed as prometheus_client's Counter is (`_total`,
    `_created`); its children are Counts, to increment."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        super().__init__(name, documentation, labelnames, registry, Count)

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value, created=child.created)
        return [family]
