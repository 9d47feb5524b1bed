"""What watches a request without steering it: its tracing span's events, its metric clocks
(TTFT, ITL, tokens, e2e; one per sample) and a profiling run's request events. The generation
path tells them what happened; none of them can change what the client gets."""

from __future__ import annotations

from opentelemetry import trace

from meshlm.common.metrics import RequestMetrics
from meshlm.common.profiling import RequestEvents
from meshlm.gateway.mesh.inbox import Update


class RequestObservers:
    def __init__(self, span: trace.Span, clocks: list[RequestMetrics], events: RequestEvents,
                 rids: list[str]) -> None:
        self.span = span
        self.clocks = clocks  # one per sample
        self.events = events
        self.rids = rids  # the samples' rids
        events.record("recv", rids)

    def sent(self) -> None:
        self.events.record("send", self.rids)

    def output(self, index: int, update: Update, first_of_sample: bool,
               first_of_request: bool) -> None:
        """Sample `index` sent `update`."""
        final = update.final
        if first_of_request:
            self.span.add_event("first_output")
        if (first_of_sample or final is not None) and self.events.active:  # not per token
            if first_of_sample:
                self.events.record("first", self.rids[index])
            if final is not None:
                self.events.record("finish", self.rids[index])
        self.clocks[index].output(update.prompt_tokens, update.completion_tokens,
                                  update.cached_tokens,
                                  final.finish_reason if final is not None else None)

    def finished(self, reason: str) -> None:
        self.span.set_attribute("meshlm.finish_reason", reason)

    def deadline_exceeded(self) -> None:
        self.span.add_event("deadline_exceeded")

    def aborted(self, indexes: list[int]) -> None:
        """These samples were ended before their last output (client gone, a sibling failed)."""
        for i in indexes:
            self.clocks[i].finish("abort")

    def client_gone(self) -> None:
        self.span.add_event("client_gone")
