"""bench-peers over several concurrencies: option parsing, requests per concurrency, the runs'
order and failures, and the plots' hand-off (no server is started)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from meshlm.bench import peers
from meshlm.bench.engine import Result, run_each
from meshlm.bench.workload import warmup_request


def test_concurrency_default_is_a_single_16() -> None:
    assert peers.parse_concurrencies(("16",), sweep=False) == [16]


def test_concurrency_repeated_and_comma_lists_merge_sorted_and_unique() -> None:
    assert peers.parse_concurrencies(("16", "1,4", " 64 ,4"), sweep=False) == [1, 4, 16, 64]


def test_sweep_adds_the_standard_concurrencies() -> None:
    assert peers.parse_concurrencies(("16",), sweep=True) == [1, 4, 16, 64]
    assert peers.parse_concurrencies(("8",), sweep=True) == [1, 4, 8, 16, 64]


@pytest.mark.parametrize("bad", ["0", "-4", "four", "1,,4", ""])
def test_bad_concurrency_is_a_usage_error(bad: str) -> None:
    with pytest.raises(click.BadParameter):
        peers.parse_concurrencies((bad,), sweep=False)


def test_bad_concurrency_stops_the_command_before_any_work() -> None:
    out = CliRunner().invoke(peers.main, ["--concurrency", "0"])
    assert out.exit_code == 2 and "--concurrency" in out.output


def test_requests_per_concurrency_are_at_least_four_waves() -> None:
    assert [peers.requests_at(64, c) for c in peers.SWEEP] == [64, 64, 64, 256]
    assert peers.requests_at(16, 4) == 16 and peers.requests_at(10, 4) == 16


def test_runs_in_order_skip_and_record_failures() -> None:
    order: list[str] = []

    def ok(name: str) -> Result:
        order.append(name)
        return Result(name, 10, 1.0)

    def broken() -> Result:
        order.append("serve")
        raise RuntimeError("no port")

    failures: list[str] = []
    runs = {"llama.cpp": lambda: ok("llama.cpp"), "serve": broken, "mesh": lambda: ok("mesh")}
    results = run_each(runs, ("llama.cpp",), failures)
    assert order == ["serve", "mesh"]
    assert results["llama.cpp"] is None and results["serve"] is None
    assert results["mesh"] is not None and results["mesh"].name == "mesh"
    assert failures == ["serve failed: RuntimeError: no port"]
    assert list(results) == ["llama.cpp", "serve", "mesh"]
    failures.clear()
    run_each({"hf": broken}, (), failures, "stage ")
    assert failures == ["stage hf failed: RuntimeError: no port"]


def test_plot_needs_two_concurrencies_and_leaves_out_missing_servers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    mesh, llama = Result("mesh", 100, 1.0, [0.1]), Result("llama", 50, 1.0, [0.2])
    notes: list[str] = []
    one = {16: {"llama.cpp": llama, "serve": None, "mesh": mesh}}
    assert peers.plot(one, tmp_path, "t", notes) == [] and not any(tmp_path.iterdir())
    two = {1: {"llama.cpp": llama, "serve": None, "mesh": mesh}, **one}
    paths = peers.plot(two, tmp_path / "out", "t", notes)
    assert [p.name for p in paths] == ["peers-throughput.png", "peers-ttft.png"]
    assert all(p.is_file() for p in paths) and notes == []


def test_bf16_runs_meshlm_on_bfloat16_weights_and_kv_cache(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """--weights bf16 is like for like: llama.cpp's KV cache is 16-bit, so meshlm's is too;
    f32 leaves meshlm all float32."""
    seen: dict[str, tuple[object, ...]] = {}
    monkeypatch.setattr(peers, "run_mesh", lambda *a: seen.setdefault("mesh", a[5:]))
    monkeypatch.setattr(peers, "run_transformers_serve",
                        lambda *a: seen.setdefault("serve", a[5:]))
    for weights, mesh, serve in (("bf16", ("bfloat16", "bfloat16"), ("bfloat16",)),
                                 ("f32", ("auto", "auto"), ("float32",))):
        seen.clear()
        runs = peers.servers(Path("model"), [], warmup_request(lambda t: [1]), 16, 2, 0, weights)
        runs["mesh"]()
        runs["serve"]()
        assert seen == {"mesh": mesh, "serve": serve}


def test_kv_cache_sets_llama_cpp_and_meshlm_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-cache f16 or f32 gives llama.cpp's --cache-type-k/v and meshlm's KV cache the same
    type; default leaves llama.cpp its own (float16) and meshlm --weights' choice."""
    seen: dict[str, tuple[object, ...]] = {}
    monkeypatch.setattr(peers, "run_mesh", lambda *a: seen.setdefault("mesh", a[6:]))
    monkeypatch.setattr(peers, "run_llama_cpp", lambda *a: seen.setdefault("llama.cpp", a[5:]))
    for kv, weights, llama, mesh in (("f32", "f32", ("f32", "f32"), ("float32",)),
                                     ("f16", "f32", ("f32", "f16"), ("float16",)),
                                     ("default", "f32", ("f32", None), ("auto",)),
                                     ("default", "bf16", ("bf16", None), ("bfloat16",))):
        seen.clear()
        runs = peers.servers(Path("model"), [], warmup_request(lambda t: [1]), 16, 2, 0,
                             weights, kv)
        runs["mesh"]()
        runs["llama.cpp"]()
        assert seen == {"mesh": mesh, "llama.cpp": llama}, (kv, weights)


def test_a_servers_rounds_merge_into_one_result() -> None:
    a = Result("mesh", 100, 2.0, [0.1, 0.3], [0.02], ["kernels: native", "chose 2 threads"])
    b = Result("mesh (again)", 300, 2.0, [0.2], [0.04, 0.06], ["kernels: native"])
    merged = Result.merged([a, b])
    assert merged.name == "mesh" and merged.tokens == 400 and merged.seconds == 4.0
    assert merged.throughput == 100.0
    assert merged.ttft == [0.1, 0.3, 0.2] and merged.ttft_ms(50) == pytest.approx(200.0)
    assert merged.itl == [0.02, 0.04, 0.06]
    assert merged.notes == ["kernels: native", "chose 2 threads"]


def test_rounds_merge_per_server_and_a_failed_round_is_left_out() -> None:
    first = {"llama.cpp": Result("l", 50, 1.0), "serve": None, "mesh": Result("m", 150, 1.0)}
    second = {"llama.cpp": Result("l", 70, 1.0), "serve": None, "mesh": None}
    merged = peers.merge_rounds([first, second])
    assert list(merged) == ["llama.cpp", "serve", "mesh"]
    assert merged["llama.cpp"] is not None and merged["llama.cpp"].throughput == 60.0
    assert merged["serve"] is None
    assert merged["mesh"] is not None and merged["mesh"].tokens == 150


def test_the_report_gives_each_rounds_throughputs_and_ratios() -> None:
    rounds = [{"llama.cpp": Result("l", 100, 1.0), "serve": Result("s", 50, 1.0),
               "mesh": Result("m", 150, 1.0)},
              {"llama.cpp": Result("l", 120, 1.0), "serve": None,
               "mesh": Result("m", 180, 1.0)}]
    lines = peers.report_peers(peers.merge_rounds(rounds), 16, rounds)
    assert ("out tok/s by round (llama.cpp / transformers serve / meshlm): "
            "100.0 / 50.0 / 150.0; 120.0 / n/a / 180.0") in lines
    assert "meshlm / llama.cpp throughput by round: 1.50x 1.50x" in lines
    assert "meshlm / transformers serve throughput by round: 3.00x n/a" in lines
    assert "meshlm / transformers serve: throughput 3.30x, TTFT p50 n/a, ITL p50 n/a" in lines
    single = peers.report_peers(rounds[0], 16, rounds[:1])
    assert not any("by round" in line for line in single)


def test_rounds_below_one_stop_the_command_before_any_work() -> None:
    out = CliRunner().invoke(peers.main, ["--rounds", "0"])
    assert out.exit_code == 2 and "--rounds" in out.output
