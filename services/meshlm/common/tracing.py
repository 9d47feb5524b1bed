"""OpenTelemetry set-up and in-band context propagation.

Spans are exported over OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT)
is set: each service then has its own TracerProvider (service.name = meshlm-<role>). Without an
endpoint nothing would read them, so no provider is set up and OpenTelemetry's no-op tracer
stands in (recorded spans cost ~48 µs per service hop of a request, no-op ones ~14). A
request's trace context travels in-band as a W3C `traceparent` map inside the internal
messages, so batched messages still join each request's trace (a client's own traceparent
passes through the mesh either way).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode

_provider: TracerProvider | None = None
_recording: bool | None = None  # a tracer provider is set (`recording`), once known
_FIELDS: frozenset[str] = frozenset()  # the propagators' metadata keys, once read (`carried`)
_EMPTY = otel_context.Context()


def exporting() -> bool:
    """Whether an OTLP endpoint for traces is configured."""
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(role: str) -> None:
    """Record and export this service's spans, if there is an endpoint to export them to."""
    global _provider, _recording
    if _provider is not None or not exporting():
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    _provider = TracerProvider(resource=Resource.create({"service.name": f"meshlm-{role}"}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    _recording = True


def shutdown_tracing() -> None:
    """Flush spans still queued (called on graceful shutdown)."""
    if _provider is not None:
        _provider.force_flush(timeout_millis=3000)
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


@contextmanager
def detached_span(tracer: trace.Tracer, name: str,
                  attributes: Mapping[str, Any]) -> Iterator[trace.Span]:
    """A span for the body of an async generator, parented by the current span but not made
    current itself: a generator's steps may run in different tasks (an HTTP stream's pump), and
    OpenTelemetry cannot reset a context it attached in another task (it logs an error for
    every such request). An exception is recorded on the span and sets its status, as
    `start_as_current_span` does; pass the span on explicitly (`carrier_of(span)`)."""
    span = tracer.start_span(name, attributes=attributes)
    try:
        yield span
    except Exception as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()


def recording() -> bool:
    """Whether this process records spans: a tracer provider is set (`setup_tracing`, before
    the first call; read once, where OpenTelemetry reads the environment each time)."""
    global _recording
    if _recording is None:
        _recording = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return _recording


def carried(metadata: Iterable[tuple[str, Any]]) -> bool:
    """Whether a call's metadata carries trace context (a traceparent, tracestate, baggage)."""
    fields = _FIELDS or _fields()
    return any(key in fields for key, _ in metadata)


def _fields() -> frozenset[str]:
    global _FIELDS
    _FIELDS = frozenset(propagate.get_global_textmap().fields)
    return _FIELDS


def carrier_of(span: trace.Span | None = None) -> dict[str, str]:
    """W3C context of `span` (or the current span) as a string map for an internal message.
    Nothing to carry (no spans recorded, no context that came in) is an empty map at once: the
    propagators' walk cost every hop of a request a few µs for it."""
    if not recording() and not otel_context.get_current() and not (
            span is not None and span.get_span_context().is_valid):
        return {}
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    return carrier


def context_of(carrier: Mapping[str, str]) -> otel_context.Context:
    """The parent context carried in-band (empty context when there is none)."""
    if not carrier:
        return _EMPTY
    return propagate.extract(dict(carrier))
