"""Profiling across the real mesh: /start_profile and /stop_profile (and the StartProfile /
StopProfile RPCs) leave a torch trace of the scheduler and request-event files of every service,
and `python -m meshlm.profiler` reports each request's time in each stage and on each hop."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import collect_text, text_request

from meshlm.profiler.report import HOPS, STAGES, load, per_stage_ms
from sglang.runtime.v1 import sglang_pb2 as pb

STAGE_NAMES = ["detokenizer", "gateway", "scheduler", "tokenizer"]


@pytest.fixture
def http(mesh) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mesh.addresses.gateway_http, timeout=120) as client:
        yield client
        client.post("/stop_profile", json={})  # never leave a run open for the next test


def _generate(stub, http: httpx.Client, count: int) -> list[str]:
    """`count` gRPC streams and one HTTP /generate; the rids the mesh gave them."""
    rids = []
    for i in range(count):
        _, msgs = collect_text(stub, text_request(f"profile me {i}", max_new_tokens=6))
        rids.append(msgs[-1].meta_info["id"])
    r = http.post("/generate", json={"text": "profile over http",
                                     "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    rids.append(r.json()["meta_info"]["id"])
    return rids


def test_profile_run_leaves_torch_trace_and_events_reported_per_stage_and_hop(
        stub, http, tmp_path):
    events, template = tmp_path / "events", tmp_path / "trace"
    r = http.post("/start_profile", json={"run_id": "e2e-run", "event_dir": str(events),
                                          "trace_path_template": str(template),
                                          "enable_torch": True})
    assert r.status_code == 200, r.text
    started = r.json()
    assert started["run_id"] == "e2e-run" and started["event_dir"] == str(events)
    assert sorted(m.split(":")[0] for m in started["services"]) == STAGE_NAMES

    again = http.post("/start_profile", json={"event_dir": str(tmp_path / "other")})
    assert again.status_code == 400, again.text
    assert "already active" in again.json()["error"]["message"]

    rids = _generate(stub, http, 3)

    r = http.post("/stop_profile", json={"run_id": "e2e-run"})
    assert r.status_code == 200, r.text
    stopped = r.json()
    assert stopped["status"] == "ok" and stopped["run_id"] == "e2e-run"
    traces = [Path(f) for f in stopped["files"] if f.endswith(".trace.json")]
    assert len(traces) == 1 and traces[0].name.startswith("trace-scheduler-")
    trace = json.loads(traces[0].read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    assert sorted(p.name.split("_")[1] for p in events.glob("events_*.jsonl")) == STAGE_NAMES

    recorded = load(events, "e2e-run")
    assert set(rids) <= set(recorded)
    for rid in rids:  # every request passed every stage, in order
        timeline = recorded[rid].timeline()
        assert {stage for _, stage, _ in timeline} == set(STAGE_NAMES), timeline
        for span in STAGES + HOPS:
            assert recorded[rid].span_ms(span) is not None, (rid, span[0], timeline)
            assert recorded[rid].span_ms(span) >= 0, (rid, span[0], timeline)
    figures = per_stage_ms({rid: recorded[rid] for rid in rids})
    assert all(len(figures[label]) == len(rids) for label, _, _ in STAGES + HOPS)

    report = subprocess.run([sys.executable, "-m", "meshlm.profiler", str(events),
                             "--run-id", "e2e-run"], capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert f"stages seen: {', '.join(STAGE_NAMES)}" in report.stdout
    for label, _, _ in STAGES + HOPS:
        row = next(line for line in report.stdout.splitlines() if line.startswith(label))
        assert int(row[32:].split()[0]) >= len(rids), row

    # Stopped: nothing more is recorded, and stopping again is harmless.
    sizes = {p: p.stat().st_size for p in events.glob("*.jsonl")}
    _generate(stub, http, 1)
    assert {p: p.stat().st_size for p in events.glob("*.jsonl")} == sizes
    r = http.post("/stop_profile", json={})
    assert r.status_code == 200 and r.json()["status"] == "not_active", r.text


def test_request_profile_records_events_without_a_torch_trace(stub, http, tmp_path):
    events = tmp_path / "events"
    r = http.post("/start_request_profile", json={"event_dir": str(events)})
    assert r.status_code == 200, r.text
    run_id = r.json()["run_id"]
    assert r.json()["trace_path_template"] is None
    rids = _generate(stub, http, 1)
    r = http.post("/stop_request_profile", json={})
    assert r.status_code == 200, r.text
    assert r.json()["run_id"] == run_id
    files = r.json()["files"]
    assert files and all(f.endswith(".jsonl") for f in files), files
    assert set(rids) <= set(load(events, run_id))


def test_start_profile_rpc_writes_under_output_dir(stub, http, tmp_path):
    reply = stub.StartProfile(pb.StartProfileRequest(output_dir=str(tmp_path)), timeout=60)
    assert str(tmp_path) in reply.message
    _generate(stub, http, 1)
    reply = stub.StopProfile(pb.StopProfileRequest(), timeout=120)
    assert reply.message.startswith("Profiling stopped on 4 service(s)"), reply.message
    assert list(tmp_path.glob("trace-scheduler-*.trace.json"))
    assert len(list((tmp_path / "events").glob("events_*.jsonl"))) == 4
    assert stub.StopProfile(pb.StopProfileRequest(), timeout=60).message == \
        "No profiling run was active."


@pytest.mark.parametrize("body, field", [
    ({"event_dir": "relative/events"}, "event_dir"),
    ({"trace_path_template": "trace"}, "trace_path_template"),
    ({"output_dir": "out", "event_dir": "/tmp/x"}, "output_dir"),
    ({"enable_torch": "yes"}, "enable_torch"),
    ({"run": "x"}, "run"),
])
def test_bad_profile_bodies_name_the_field(http, body, field):
    r = http.post("/start_profile", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"{field}: "), r.text
    # Nothing was left open by the refusal.
    assert http.post("/stop_profile", json={}).json()["status"] == "not_active"
