"""Spans are recorded only when there is an OTLP endpoint to export them to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
from opentelemetry import trace
from meshlm.common.tracing import carrier_of, context_of, setup_tracing, tracer
setup_tracing("gateway")
parent = context_of({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
span = tracer("probe").start_span("request", context=parent)
print(type(trace.get_tracer_provider()).__name__, span.is_recording(),
      carrier_of(span)["traceparent"].split("-")[1])
"""


def _probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.split()


def test_without_an_endpoint_spans_are_not_recorded_but_the_trace_passes_through() -> None:
    provider, recording, trace_id = _probe()
    assert recording == "False"
    assert provider != "TracerProvider"  # the API's proxy, not the SDK's
    assert trace_id == "0af7651916cd43dd8448eb211c80319c"


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_ENDPOINT",
                                      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
def test_with_an_endpoint_spans_are_recorded_in_the_callers_trace(variable: str) -> None:
    # The exporter only connects when it exports (on shutdown here: nothing listens, which
    # it logs and the probe survives).
    provider, recording, trace_id = _probe(**{variable: "http://127.0.0.1:1"})
    assert (provider, recording) == ("TracerProvider", "True")
    assert trace_id == "0af7651916cd43dd8448eb211c80319c"
