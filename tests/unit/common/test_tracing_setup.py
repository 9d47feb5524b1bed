"""Spans are recorded only when there is an OTLP endpoint to export them to."""

from __future__ import annotations

import json
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


CALL_PROBE = """
import asyncio, json, sys
import grpc
from meshlm.common.interceptors import TracingInterceptor
from meshlm.common.tracing import carrier_of, setup_tracing
setup_tracing("gateway")

async def handler(request, context):
    return json.dumps(carrier_of()).encode()

async def main():
    server = grpc.aio.server(interceptors=[TracingInterceptor()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.S", {"M": grpc.unary_unary_rpc_method_handler(handler)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/t.S/M")
        for metadata in ((), (("traceparent", sys.argv[1]),)):
            print(json.dumps(json.loads(await call(b"", metadata=metadata))))
    await server.stop(None)
asyncio.run(main())
"""
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("endpoint", [None, "http://127.0.0.1:1"])
def test_a_call_passes_on_the_context_it_came_with_and_nothing_else(endpoint: str | None) -> None:
    """Without spans to record, a call without trace context carries none on (the fast path:
    no span, no propagators' walk); with a caller's traceparent, it carries that trace on."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env = {**clean, **({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint} if endpoint else {})}
    done = subprocess.run([sys.executable, "-c", CALL_PROBE, PARENT], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    plain, traced = (json.loads(line) for line in done.stdout.splitlines())
    if endpoint is None:
        assert plain == {}
    else:  # recorded: the call's own span is the parent of what follows
        assert len(plain["traceparent"].split("-")[1]) == 32
    assert traced["traceparent"].split("-")[1] == PARENT.split("-")[1]
