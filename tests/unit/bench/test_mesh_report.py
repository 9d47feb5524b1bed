"""mesh_report: CPU per output token and the pinned ratios, against issue 16's goals."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from meshlm.bench.gateway_path import measure
from meshlm.bench.mesh_report import (
    ENGINE_THREAD_PART,
    Result,
    batching_line,
    cpu_line,
    floor_line,
    forward_line,
    own_work_line,
    pinned_line,
    placement_lines,
    report,
    rounds_line,
)
from meshlm.bench.pinning import CpuPlan
from meshlm.bench.transport_floor import (
    grpc_message_floor_us,
    http_direct_event_floor_us,
    http_event_floor_us,
    native_direct_message_floor_us,
    native_grpc_message_floor_us,
)

ENGINE = Result("in-process", [0.010, 0.012, 0.011], tokens=1000, seconds=2.0,
                cpu={"engine": 0.210})
GRPC = Result("mesh gRPC", [0.0125, 0.013], tokens=1000, seconds=2.5,
              cpu={"scheduler": 0.46, "gateway": 0.119, "detokenizer": 0.030,
                   "tokenizer": 0.010}, messages=500)
HTTP = Result("mesh HTTP", [0.014, 0.014], tokens=500, seconds=1.25,
              cpu={"scheduler": 0.23, "gateway": 0.02, "detokenizer": 0.005,
                   "tokenizer": 0.002}, messages=500)
PLAN = CpuPlan(frozenset({0}), frozenset({1}))


def test_cpu_us_per_token() -> None:
    assert round(ENGINE.cpu_us_per_token("engine")) == 210
    assert round(HTTP.cpu_us_per_token("gateway")) == 40


def test_the_batching_line_gives_tokens_per_step_of_each_path_that_counted_them() -> None:
    counted = [Result("in-process", [0.01], tokens=1000, seconds=1.0, steps=25),
               Result("mesh gRPC", [0.01], tokens=1000, seconds=1.0, steps=40), HTTP]
    assert batching_line(counted) == ("output tokens per engine step at saturation: "
                                      "in-process 40.0, mesh gRPC 25.0")


def test_the_forward_line_splits_each_paths_cpu_into_forward_passes_and_the_rest() -> None:
    engine = Result("in-process", [0.01], tokens=1000, seconds=2.0, cpu={"engine": 0.066},
                    forward=0.060)
    grpc = Result("mesh gRPC", [0.01], tokens=1000, seconds=2.5,
                  cpu={"scheduler": 0.080, "gateway": 0.035}, forward=0.0663)
    uncounted = Result("mesh HTTP", [0.01], tokens=500, seconds=1.0, cpu={"scheduler": 0.04})
    line = forward_line([engine, grpc, uncounted])
    assert line.startswith("CPU per output token, the forward passes + the rest of the "
                           "engine's process (µs): in-process 60 + 6, mesh gRPC 66 (1.10x) + 14;")
    assert "mesh HTTP" not in line
    assert "not counted" in forward_line([HTTP])


def test_cpu_line_grpc() -> None:
    assert cpu_line(ENGINE, GRPC, "gRPC") == (
        "CPU per output token (µs): engine in-process 210; gRPC: scheduler 460 (2.19x engine; "
        "goal <= 1.15x), gateway 119 (goal <= 15), detokenizer 30 (goal <= 15), tokenizer 10")


def test_cpu_line_splits_the_schedulers_cpu_when_its_engine_thread_was_measured() -> None:
    split = Result("mesh gRPC", [0.0125], tokens=1000, seconds=2.5,
                   cpu={**GRPC.cpu, ENGINE_THREAD_PART: 0.4})
    assert ("scheduler 460 (2.19x engine; goal <= 1.15x; engine thread 400, event loop and "
            "gRPC threads 60)") in cpu_line(ENGINE, split, "gRPC")


def test_cpu_line_http_has_its_gateway_goal() -> None:
    line = cpu_line(ENGINE, HTTP, "HTTP")
    assert "; HTTP: scheduler 460 (2.19x engine" in line
    assert "gateway 40 (goal <= 30)" in line


def test_pinned_line() -> None:
    assert pinned_line(ENGINE, GRPC, "gRPC", PLAN) == (
        "mesh gRPC / in-process, pinned (engine on CPU 0, the rest on CPU 1): throughput 0.80 "
        "(goal >= 0.9), TTFT p50 at concurrency 1 +1.75 ms (goal <= +2 ms)")


def test_placement_lines_name_the_cpus_and_the_threads_seen() -> None:
    lines = placement_lines(PLAN, {"scheduler": Counter({"1": 9, "0": 1}),
                                   "gateway": Counter({"1": 4})})
    assert "the engine on CPU 0" in lines[0] and "MESHLM_ENGINE_CPUS=0" in lines[0]
    assert lines[1].endswith("scheduler 9 on 1, 1 on 0; gateway 4 on 1")


def test_report_keeps_the_table_and_ratios() -> None:
    text = report([ENGINE, GRPC, HTTP])
    assert text.splitlines()[0].split() == ["path", "TTFT", "p50", "ms", "TTFT", "p99", "ms",
                                            "out", "tok/s"]
    assert "mesh gRPC vs in-process: TTFT p50 +1.75 ms, throughput 80.0%" in text


def test_the_report_gives_each_paths_longest_wait_between_two_outputs() -> None:
    paused = Result("mesh HTTP", HTTP.ttft, tokens=500, seconds=1.25, longest_gap=0.1664)
    assert report([ENGINE, GRPC, paused]).splitlines()[-1] == (
        "longest wait between two outputs of one request at saturation (in-process: its "
        "longest step): in-process 0.0 ms, mesh gRPC 0.0 ms, mesh HTTP 166.4 ms")


def test_the_spaced_in_process_run_is_reported_beside_the_goal() -> None:
    spaced = Result("in-process", ENGINE.ttft, tokens=1000, seconds=2.0, cpu=ENGINE.cpu,
                    spaced_ttft=[0.0115, 0.0125])
    assert pinned_line(spaced, GRPC, "gRPC", PLAN).endswith(
        "TTFT p50 at concurrency 1 +1.75 ms (goal <= +2 ms; +0.75 ms over the engine with "
        "requests 5 ms apart)")
    assert ("in-process with requests 5 ms apart (the engine idle before each, as the mesh's "
            "is while a request crosses the other services): TTFT p50 12.00 ms; mesh gRPC "
            "+0.75 ms, mesh HTTP +2.00 ms over it") in report([spaced, GRPC, HTTP])


def test_the_floor_line_says_where_the_bare_servers_ran_and_what_the_gateway_adds() -> None:
    assert floor_line({"gRPC": 26.4, "HTTP": 11.6}, {"gRPC": GRPC, "HTTP": HTTP}, 64, PLAN,
                      {"gRPC": 30.2, "HTTP": 14.4}, 61.2) == (
        "the transports' own cost of a streamed message (a bare server writing the gateway's "
        "per-token message to 64 streams at once, on CPU 1 as the gateway): gRPC (the "
        "gateway's native server) 26 µs, HTTP (uvicorn, SSE) 12 µs, written directly as the "
        "gateway writes them (each through its call's handler: gRPC 30, HTTP 14; grpc.aio's "
        "server: 61). "
        "Messages per output token at saturation (a stream's mailbox folds what arrives "
        "while its client is busy): gRPC 0.50, HTTP 1.00; "
        "so the floor per token: gRPC 13 µs, HTTP 12 µs. What the gateway spends above it (µs "
        "per token): gRPC 106, HTTP 28")  # 119 - 26.4 x 0.5, 40 - 11.6 x 1


def test_the_own_work_line_leaves_the_floor_and_the_own_work_out_of_the_rest() -> None:
    line = own_work_line({"gRPC": 10.0, "HTTP": 11.0}, {"gRPC": 26.4, "HTTP": 11.6},
                         {"gRPC": GRPC, "HTTP": HTTP})
    assert "gRPC 10.0 µs, HTTP 11.0 µs" in line
    assert "(µs per token): gRPC 96, HTTP 17;" in line  # 119 - 26.4 x 0.5 - 10, 40 - 11.6 - 11


def test_rounds_merge_their_message_counts() -> None:
    merged = Result.merged([GRPC, GRPC])
    assert merged.messages == 1000 and merged.messages_per_token == 0.5
    assert Result("x", [], tokens=0, seconds=1.0).messages_per_token == 0.0


@pytest.mark.parametrize(("transport", "smallest"), [("grpc", 60), ("http", 150),
                                                     ("openai", 100)])
async def test_the_gateway_path_streams_every_token_through_the_real_fronts(
        transport: str, smallest: int) -> None:
    figures = await asyncio.wait_for(measure(transport, streams=3, tokens=5), timeout=30)
    assert figures["token_us"] > 0
    # a message a token (SSE: then [DONE]), each with its token's text (and id)
    assert figures["messages"] == 3 * (5 if transport == "grpc" else 6)
    assert figures["bytes_per_message"] > smallest


def test_the_bare_servers_stream_every_message_and_their_cpu_is_measured() -> None:
    for floor in (grpc_message_floor_us(streams=3, messages=20),
                  native_grpc_message_floor_us(streams=3, messages=20),
                  native_direct_message_floor_us(streams=3, messages=20),
                  http_event_floor_us(streams=3, messages=20),
                  http_direct_event_floor_us(streams=3, messages=20)):
        assert 0 <= floor < 100_000  # every message arrived (else it raises); CPU ticks are coarse


def test_rounds_merge_into_one_result_per_path_and_their_ratios_are_printed_by_round() -> None:
    first = Result("in-process", [0.001], tokens=100, seconds=1.0, cpu={"engine": 0.01},
                   spaced_ttft=[0.002], steps=4, longest_gap=0.030)
    second = Result("in-process", [0.003], tokens=300, seconds=1.0, cpu={"engine": 0.02},
                    spaced_ttft=[0.004], steps=6, longest_gap=0.020)
    merged = Result.merged([first, second])
    assert (merged.ttft, merged.spaced_ttft) == ([0.001, 0.003], [0.002, 0.004])
    assert (merged.tokens, merged.seconds, merged.steps) == (400, 2.0, 10)
    assert merged.longest_gap == 0.030
    assert merged.cpu == {"engine": pytest.approx(0.03)} and merged.throughput == 200
    by_round = {"in-process": [first, second],
                "mesh gRPC": [Result("mesh gRPC", [0.01], tokens=90, seconds=1.0),
                              Result("mesh gRPC", [0.01], tokens=240, seconds=1.0)]}
    assert rounds_line(by_round) == "throughput / in-process by round: mesh gRPC 0.90 0.80"
