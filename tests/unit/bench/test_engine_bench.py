"""The engine benchmark's pure parts: workload, KV waste, statistics, report lines."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest

from meshlm.bench import serving
from meshlm.bench import workload as wl
from meshlm.bench.engine import Result, engine_choices_said, report_http, report_inprocess


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: a BOS, then one token per word and per comma or period."""
    return [0] + [len(w) for w in text.replace(",", " ,").replace(".", " .").split()]


def workload(seed: int) -> list[wl.BenchRequest]:
    return wl.build_workload(32, encode, seed, (16, 256), 64, (1, 256))


def test_workload_is_deterministic_and_seed_dependent() -> None:
    a = workload(7)
    assert a == workload(7)
    assert a != workload(8)
    assert len({r.rid for r in a}) == 32
    for r in a:
        assert r.prompt_ids == tuple(encode(r.text))
        assert 16 <= len(r.prompt_ids) <= 256 + 2  # the last word may add a token or two
        assert 1 <= r.max_new_tokens <= 256


def test_prompt_text_is_the_shortest_run_reaching_the_target() -> None:
    for target in (1, 2, 16, 100, 256):
        text = wl.prompt_text(5, target, encode)
        assert len(encode(text)) >= target
        shorter = " ".join(text.split()[:-1])
        assert not shorter or len(encode(shorter)) < target


def test_prompt_lengths_are_uniform_within_bounds() -> None:
    lengths = wl.prompt_lengths(2000, 16, 256, seed=1)
    assert min(lengths) >= 16 and max(lengths) <= 256
    assert abs(statistics.mean(lengths) - 136) < 6


def test_output_lengths_are_exponential_and_clipped() -> None:
    lengths = wl.output_lengths(20000, 64, 1, 256, seed=3)
    assert lengths == wl.output_lengths(20000, 64, 1, 256, seed=3)
    assert min(lengths) >= 1 and max(lengths) == 256  # the tail is clipped, not dropped
    # Exponential: the median is mean * ln 2, and clipping at 4 means cuts the mean by e^-4.
    assert abs(statistics.median(lengths) - 64 * 0.693) < 2.5
    assert abs(statistics.mean(lengths) - 64 * (1 - 2.718281828**-4)) < 2.5


def test_static_batches_decode_to_their_longest_row() -> None:
    reqs = [wl.BenchRequest(f"r{i}", "", (0,), n) for i, n in enumerate([3, 9, 1, 4, 7])]
    batches = wl.static_batches(reqs, 2)
    assert [[r.rid for r in b] for b in batches] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert [wl.static_steps(b) for b in batches] == [9, 4, 7]


def test_kv_waste_from_block_stats() -> None:
    stats = {"kv_block_size": 16, "kv_blocks_used": 5, "kv_tokens_used": 70}
    assert wl.kv_waste(stats) == (10, 80)
    assert wl.kv_waste({"running": 3, "token_usage": 0.5}) is None


def test_waste_meter_averages_steps_and_sets_the_target() -> None:
    meter = wl.WasteMeter()
    meter.add({"kv_block_size": 16, "kv_blocks_used": 4, "kv_tokens_used": 48, "running": 2})
    meter.add({"kv_block_size": 16, "kv_blocks_used": 2, "kv_tokens_used": 32, "running": 1})
    meter.add({"kv_block_size": 16, "kv_blocks_used": 0, "kv_tokens_used": 0, "running": 0})
    assert meter.fractions == [0.25, 0.0]  # an empty cache is not a step with waste
    assert meter.mean_fraction == pytest.approx(0.125)
    assert meter.mean_seq_len == pytest.approx(80 / 3)
    assert meter.target == pytest.approx(16 / (80 / 3))


def test_waste_meter_without_block_stats_reports_nothing() -> None:
    meter = wl.WasteMeter()
    meter.add({"running": 4, "token_usage": 0.1})
    assert meter.mean_fraction is None and meter.target is None and meter.block_size is None


def test_percentile_interpolates_like_numpy() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert wl.percentile(values, 50) == 3.0
    assert wl.percentile(values, 0) == 1.0 and wl.percentile(values, 100) == 5.0
    assert wl.percentile(values, 99) == pytest.approx(4.96)
    assert wl.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        wl.percentile([], 50)


def test_ratio_and_fmt_handle_missing_values() -> None:
    assert wl.ratio(6.0, 2.0) == 3.0
    assert wl.ratio(None, 2.0) is None and wl.ratio(1.0, 0.0) is None
    assert wl.fmt(None) == "n/a"
    assert wl.fmt(2.345, ".2f", "x") == "2.35x"


def test_reports_show_ratios_and_na() -> None:
    engine = Result("engine", 300, 1.0)
    hf = Result("hf", 300, 3.0)
    lines = report_inprocess(engine, None, hf, wl.WasteMeter())
    assert any("engine / HF generate: 3.00x" in line for line in lines)
    assert any("engine at batch 1: n/a" in line for line in lines)
    assert any(line.startswith("KV waste: n/a") for line in lines)
    mesh = Result("mesh", 200, 1.0, ttft=[0.1, 0.2, 0.3])
    serve = Result("serve", 100, 1.0, ttft=[0.4, 0.6, 0.8])
    (summary,) = [line for line in report_http(mesh, serve, 16) if line.startswith("meshlm /")]
    assert "throughput 2.00x" in summary and "TTFT p50 0.33x" in summary


async def test_drive_keeps_at_most_concurrency_streams_and_runs_each_once() -> None:
    reqs = [wl.BenchRequest(f"r{i}", "", (0,), 1) for i in range(10)]
    live = peak = 0

    async def stream(client: object, request: wl.BenchRequest) -> serving.StreamStats:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.001)
        live -= 1
        return serving.StreamStats(request.rid, 0.0, request.max_new_tokens, 1)

    stats, seconds = await serving.drive(None, stream, reqs, 3)  # type: ignore[arg-type]
    assert sorted(s.rid for s in stats) == sorted(r.rid for r in reqs)
    assert peak == 3 and seconds > 0


def test_sse_data_lines() -> None:
    assert serving._data(b'data: {"a": 1}') == {"a": 1}
    assert serving._data(b'event: x\r\ndata:{"a": 2}\r') == {"a": 2}
    assert serving._data(b"data: [DONE]") is None
    assert serving._data(b": keep-alive") is None and serving._data(b"") is None
    with pytest.raises(serving.StreamError, match="boom"):
        serving._data(b'data: {"error": {"message": "boom"}}')


def test_the_schedulers_start_up_choices_become_notes(tmp_path: Path) -> None:
    log = tmp_path / "scheduler.log"
    log.write_text("\n".join([
        '{"event": "engine_ready", "attention_backend": "native", "fused_layers": true, '
        '"layers_in_one_call": true, "kv_cache_dtype": "float32", "linear_kernel": "native", '
        '"linear_weight_dtype": "bfloat16", "threads": 1}',
        '{"event": "engine_ready", "attention_backend": "native", "dtype": "float32", '
        '"kv_cache_dtype": "bfloat16", "linear_kernel": "native", '
        '"linear_weight_dtype": "bfloat16", "linear_activation_dtype": "bfloat16"}',
        'not json: an interleaved line',
        '{"event": "engine_threads", "threads": 2, "cores": 2.0, '
        '"engine_us_per_token": 998, "mesh_us_per_token": 250}',
    ]))
    assert engine_choices_said(log) == [
        "kernels: native, the layers fused (a step's layers in one call); matmuls: native, "
        "bfloat16 weights; KV cache float32",
        "kernels: native; matmuls: native, bfloat16 weights (activations rounded to bfloat16); "
        "KV cache bfloat16",
        "the engine chose 2 threads on 2 cores: 998 us of engine CPU per output token "
        "against 250 for the rest of the mesh",
    ]
    log.write_text("")
    assert engine_choices_said(log) == []
