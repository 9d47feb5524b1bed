"""Request-event recording, profiling sessions and the report built from their files."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import orjson
import pytest
from click.testing import CliRunner

from meshlm.common.errors import MeshError
from meshlm.common.profiling import Profiling, RequestEvents
from meshlm.profiler.__main__ import main as profiler_main
from meshlm.profiler.report import load, per_stage_ms, report
from meshlm.v1 import profiler_pb2 as pb


def test_events_are_recorded_only_while_a_session_is_open(tmp_path: Path) -> None:
    events = RequestEvents("tokenizer")
    events.record("recv", "lost")  # no session: nothing, no error
    path = events.open("run1", str(tmp_path / "ev"))
    assert path == tmp_path / "ev" / f"events_tokenizer_{os.getpid()}.jsonl"
    events.record("recv", "a")
    events.record("send", ["a", "b"], batch=2)
    assert events.close() == path and not events.active
    events.record("recv", "late")
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert [(x["rid"], x["event"]) for x in lines] == [("a", "recv"), ("a", "send"),
                                                       ("b", "send")]
    assert all(x["stage"] == "tokenizer" and x["run_id"] == "run1" and x["pid"] == os.getpid()
               for x in lines)
    assert lines[1]["batch"] == 2 and lines[0]["ts"] <= lines[1]["ts"]


class FakeTorchTrace:
    def __init__(self) -> None:
        self.prefix: str | None = None

    async def start(self, path_prefix: str) -> None:
        self.prefix = path_prefix

    async def stop(self) -> list[str]:
        return [f"{self.prefix}.json"]


async def test_sessions_start_once_and_stop_by_run_id(tmp_path: Path) -> None:
    trace = FakeTorchTrace()
    prof = Profiling("scheduler", trace)
    reply = await prof.start(pb.ProfileStart(run_id="r1", event_dir=str(tmp_path),
                                             trace_path_template=str(tmp_path / "t"),
                                             enable_torch=True))
    assert reply.ok and "r1" in reply.message and "torch trace" in reply.message
    assert trace.prefix == f"{tmp_path / 't'}-scheduler-{os.getpid()}"
    with pytest.raises(MeshError) as info:
        await prof.start(pb.ProfileStart(run_id="r2"))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "r1" in info.value.message
    wrong = await prof.stop(pb.ProfileStop(run_id="other"))
    assert not wrong.ok and "'r1'" in wrong.message
    done = await prof.stop(pb.ProfileStop())  # "" = whatever is active
    assert done.ok and list(done.files) == [f"{trace.prefix}.json",
                                            str(tmp_path / f"events_scheduler_{os.getpid()}.jsonl")]
    again = await prof.stop(pb.ProfileStop())
    assert not again.ok and "no profiling run" in again.message
    no_torch = await prof.start(pb.ProfileStart(event_dir=str(tmp_path), enable_torch=False))
    assert no_torch.ok and "torch" not in no_torch.message and prof.run_id  # generated id
    await prof.stop(pb.ProfileStop())


def _write(directory: Path, stage: str, rows: list[tuple[str, str, float]]) -> None:
    lines = [orjson.dumps({"ts": ts, "run_id": "r", "stage": stage, "pid": 1, "rid": rid,
                           "event": event}) for rid, event, ts in rows]
    (directory / f"events_{stage}_1.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def test_report_times_every_stage_and_hop(tmp_path: Path) -> None:
    _write(tmp_path, "gateway", [("a", "recv", 100.000), ("a", "send", 100.001),
                                 ("a", "first", 100.030), ("a", "finish", 100.050)])
    _write(tmp_path, "tokenizer", [("a", "recv", 100.002), ("a", "send", 100.004)])
    _write(tmp_path, "scheduler", [("a", "recv", 100.005), ("a", "first", 100.025),
                                   ("a", "finish", 100.045)])
    _write(tmp_path, "detokenizer", [("a", "recv", 100.026), ("a", "send", 100.027)])
    traces = load(tmp_path)
    ms = {k: round(v[0], 3) for k, v in per_stage_ms(traces).items()}
    assert ms["tokenizer"] == 2.0 and ms["scheduler (queue + prefill)"] == 20.0
    assert ms["scheduler (decode)"] == 20.0 and ms["gateway -> tokenizer"] == 1.0
    assert ms["tokenizer -> scheduler"] == 1.0 and ms["scheduler -> detokenizer"] == 1.0
    assert ms["detokenizer -> gateway"] == 3.0
    assert ms["total (gateway recv -> finish)"] == 50.0
    text = report(traces)
    assert "1 requests; stages seen: detokenizer, gateway, scheduler, tokenizer" in text
    assert "timeline of a" in text and text.index("tokenizer    recv") < text.index(
        "scheduler    recv")
    out = CliRunner().invoke(profiler_main, [str(tmp_path), "--json"])
    assert out.exit_code == 0 and orjson.loads(out.output)["a"]["tokenizer"] == pytest.approx(2.0)
    empty = CliRunner().invoke(profiler_main, [str(tmp_path), "--run-id", "nope"])
    assert empty.exit_code != 0 and "no request events" in empty.output
