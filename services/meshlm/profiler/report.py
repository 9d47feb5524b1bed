"""Request-event files -> per-request timelines, per-stage and per-hop times.

Each service writes `events_<stage>_<pid>.jsonl` (see `meshlm.common.profiling`). A request's
path through the mesh, and the events that bound each part of it:

    gateway recv -> send | tokenizer recv -> send | scheduler recv -> first -> finish
    | detokenizer recv -> send | gateway first -> finish

A stage's time runs from its `recv` to the event where it hands the request on; a hop's time
from that event to the next stage's `recv` (network, queues and batching between them).
n > 1 samples run as their own requests (`<rid>-<i>`) and are reported as such.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

# (label, (stage, event) where it starts, (stage, event) where it ends)
Span = tuple[str, tuple[str, str], tuple[str, str]]

STAGES: list[Span] = [
    ("gateway (validate, route)", ("gateway", "recv"), ("gateway", "send")),
    ("tokenizer", ("tokenizer", "recv"), ("tokenizer", "send")),
    ("scheduler (queue + prefill)", ("scheduler", "recv"), ("scheduler", "first")),
    ("scheduler (decode)", ("scheduler", "first"), ("scheduler", "finish")),
    ("detokenizer (first output)", ("detokenizer", "recv"), ("detokenizer", "send")),
    ("gateway (stream to client)", ("gateway", "first"), ("gateway", "finish")),
]
HOPS: list[Span] = [
    ("gateway -> tokenizer", ("gateway", "send"), ("tokenizer", "recv")),
    ("tokenizer -> scheduler", ("tokenizer", "send"), ("scheduler", "recv")),
    ("scheduler -> detokenizer", ("scheduler", "first"), ("detokenizer", "recv")),
    ("detokenizer -> gateway", ("detokenizer", "send"), ("gateway", "first")),
]
TOTAL: Span = ("total (gateway recv -> finish)", ("gateway", "recv"), ("gateway", "finish"))


@dataclass
class RequestTrace:
    rid: str
    events: list[dict[str, Any]] = field(default_factory=list)

    def at(self, stage: str, event: str) -> float | None:
        """The first time `stage` recorded `event` for this request."""
        times = [e["ts"] for e in self.events if e["stage"] == stage and e["event"] == event]
        return min(times) if times else None

    def span_ms(self, span: Span) -> float | None:
        _, (s0, e0), (s1, e1) = span
        a, b = self.at(s0, e0), self.at(s1, e1)
        return None if a is None or b is None else (b - a) * 1000

    def timeline(self) -> list[tuple[float, str, str]]:
        """(ms since the request's first event, stage, event), in time order."""
        ordered = sorted(self.events, key=lambda e: e["ts"])
        t0 = ordered[0]["ts"]
        return [((e["ts"] - t0) * 1000, e["stage"], e["event"]) for e in ordered]


def load(event_dir: str | Path, run_id: str | None = None) -> dict[str, RequestTrace]:
    """Every request's events from the directory's files (of one run, when given)."""
    traces: dict[str, RequestTrace] = {}
    for path in sorted(Path(event_dir).glob("events_*.jsonl")):
        for line in path.read_bytes().splitlines():
            if not line.strip():
                continue
            event = orjson.loads(line)
            if run_id and event.get("run_id") != run_id:
                continue
            rid = str(event["rid"])
            traces.setdefault(rid, RequestTrace(rid)).events.append(event)
    return traces


@dataclass
class Summary:
    label: str
    values: list[float]

    def row(self) -> str:
        if not self.values:
            return f"{self.label:<32} {'-':>6}"
        v = sorted(self.values)
        p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
        return (f"{self.label:<32} {len(v):>6} {statistics.fmean(v):>9.2f} "
                f"{statistics.median(v):>9.2f} {p90:>9.2f} {v[-1]:>9.2f}")


def summaries(traces: Iterable[RequestTrace], spans: list[Span]) -> list[Summary]:
    traces = list(traces)
    return [Summary(span[0], [ms for t in traces if (ms := t.span_ms(span)) is not None])
            for span in spans]


def report(traces: dict[str, RequestTrace], timelines: int = 3) -> str:
    """The text report: per-stage and per-hop tables, then a few requests' timelines."""
    header = f"{'':<32} {'count':>6} {'mean ms':>9} {'p50 ms':>9} {'p90 ms':>9} {'max ms':>9}"
    stages = sorted({e["stage"] for t in traces.values() for e in t.events})
    lines = [f"{len(traces)} requests; stages seen: {', '.join(stages) or 'none'}", "",
             "per stage", header]
    lines += [s.row() for s in summaries(traces.values(), STAGES)]
    lines += ["", "per hop", header]
    lines += [s.row() for s in summaries(traces.values(), HOPS)]
    lines += ["", summaries(traces.values(), [TOTAL])[0].row()]
    complete = [t for t in traces.values() if t.span_ms(TOTAL) is not None]
    for trace in sorted(complete, key=lambda t: t.at("gateway", "recv") or 0)[:timelines]:
        lines += ["", f"timeline of {trace.rid}"]
        lines += [f"  {ms:>9.2f} ms  {stage:<12} {event}" for ms, stage, event in
                  trace.timeline()]
    return "\n".join(lines)


def as_json(traces: dict[str, RequestTrace]) -> dict[str, Any]:
    """The report's figures as JSON: per request, every stage's and hop's milliseconds."""
    spans = STAGES + HOPS + [TOTAL]
    return {rid: {label: t.span_ms((label, a, b)) for label, a, b in spans}
            for rid, t in traces.items()}


def per_stage_ms(traces: dict[str, RequestTrace]) -> dict[str, list[float]]:
    """Every stage's and hop's milliseconds across requests (for tests and tools)."""
    out: dict[str, list[float]] = defaultdict(list)
    for t in traces.values():
        for span in STAGES + HOPS + [TOTAL]:
            ms = t.span_ms(span)
            if ms is not None:
                out[span[0]].append(ms)
    return dict(out)
