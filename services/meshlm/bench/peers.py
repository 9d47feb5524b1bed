"""`make bench-peers`: llama.cpp's `llama-server`, `transformers serve` and the meshlm mesh, one
after another on the same cores, the same checkpoint and the same seeded workload.

llama.cpp is built once from the llama-cpp-python sdist and gets the bench checkpoint as GGUF
f32 (`llama_cpp.py`); before it is measured, its token ids for a few texts are compared with the
checkpoint tokenizer's. Every server streams over HTTP at the same concurrency (closed loop) and
is measured for output tokens/s, TTFT p50 and ITL p50 (per request: time from the first event to
the end over the tokens after the first); the report ends with meshlm's ratios to each peer.
llama.cpp gets a new connection per request (see `LlamaCppServer`); the others keep theirs.

`--concurrency` takes several values (repeated or comma-separated; `--sweep` adds 1, 4, 16
and 64). Each server is then started once per concurrency, with llama.cpp's slots and meshlm's
max_running equal to it, the three servers one after another at each concurrency, lowest
first. A concurrency `c` runs the first max(--requests, 4 x c) requests of one seeded list
(`requests_at`), so every run has at least four waves of streams and the smaller runs are a
prefix of the larger. The report has the table and meshlm's ratios at every concurrency; with
two or more, `plots.py` draws throughput and TTFT p50 by concurrency into `--plot-dir`.

`--rounds n` measures the three servers n times over at each concurrency, in turn (llama.cpp,
transformers serve, meshlm, then again), each started afresh: a shared machine's quiet and busy
spells then fall on every server, not on whichever ran during them. Each server's figures are
over all its rounds (tokens over seconds summed, TTFT and ITL p50 over every request), and the
report adds each round's throughputs and meshlm's ratios round by round, the spread the noise
leaves.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import click

from meshlm.bench.checkpoint import MAX_POSITIONS, ensure_bench_model
from meshlm.bench.engine import (
    Result,
    run_each,
    run_http,
    run_mesh,
    run_transformers_serve,
)
from meshlm.bench.llama_cpp import (
    LlamaCppServer,
    ensure_gguf,
    ensure_llama_server,
    llama_cpp_stream,
)
from meshlm.bench.serving import OFFLINE_ENV
from meshlm.bench.workload import (
    BenchRequest,
    build_workload,
    fmt,
    ratio,
    warmup_request,
    workload_options,
)

PEERS = ("llama.cpp", "serve", "mesh")
LABELS = {"llama.cpp": "llama.cpp", "serve": "transformers serve", "mesh": "meshlm"}
SWEEP = (1, 4, 16, 64)
WAVES = 4  # a concurrency c runs at least WAVES * c requests
# Texts whose token ids llama.cpp must share with the tokenizer, beside the workload's prompts.
TOKENIZER_PROBES = (
    "Hello world", "  two  spaces\tand a tab\n\nnew lines ", "3 33 333 3333 3.14 1,000,000",
    "I've been told he's there, 'RE you sure?", "naïve café, 東京, emoji 🚀",
)


def run_llama_cpp(model_path: Path, requests: Sequence[BenchRequest], warmup: BenchRequest,
                  concurrency: int, threads: int, weights: str = "f32",
                  cache_type: str | None = None) -> Result:
    """`llama-server` with `concurrency` slots on loopback, driven over /v1/completions; its
    KV cache of `cache_type` (None: its default)."""
    binary, gguf = ensure_llama_server(), ensure_gguf(model_path, outtype=weights)
    with tempfile.TemporaryDirectory() as tmp, LlamaCppServer(
            binary, gguf, Path(tmp) / "llama-server.log", threads, concurrency,
            MAX_POSITIONS, cache_type=cache_type) as server:
        texts = [*TOKENIZER_PROBES, *(r.text for r in requests[:8])]
        mismatches = server.check_tokenizer(model_path / "tokenizer.json", texts)
        result = run_http(f"llama.cpp llama-server, -np {concurrency}, HTTP /v1/completions",
                          server.base_url, llama_cpp_stream, requests, warmup, concurrency,
                          keepalive=False)
    result.notes.append(f"token ids equal to the tokenizer's for {len(texts) - len(mismatches)}"
                        f" of {len(texts)} texts" + "".join(f"; {m}" for m in mismatches[:3]))
    result.notes.append(f"KV cache {cache_type} (--cache-type-k/v {cache_type})" if cache_type
                        else "KV cache float16 (llama-server's default: no --cache-type-k/v "
                        "given)")
    return result


def merge_rounds(rounds: Sequence[dict[str, Result | None]]) -> dict[str, Result | None]:
    """Each server's results over `rounds` (run_each's, in order) as one (`Result.merged`);
    None for a server that has no round."""
    merged: dict[str, Result | None] = {}
    for key in rounds[0]:
        done = [r for by_peer in rounds if (r := by_peer[key]) is not None]
        merged[key] = Result.merged(done) if done else None
    return merged


def report_rounds(rounds: Sequence[dict[str, Result | None]]) -> list[str]:
    """Each round's throughputs and meshlm's throughput ratios to each peer by round (nothing
    for a single round)."""
    if len(rounds) < 2:
        return []
    labels = " / ".join(LABELS[key] for key in rounds[0])
    lines = [f"out tok/s by round ({labels}): " + "; ".join(
        " / ".join(fmt(r.throughput if r else None, ".1f") for r in by_peer.values())
        for by_peer in rounds)]
    for key in ("llama.cpp", "serve"):
        ratios: list[float | None] = []
        for by_peer in rounds:
            mesh, peer = by_peer.get("mesh"), by_peer.get(key)
            ratios.append(ratio(mesh.throughput, peer.throughput) if mesh and peer else None)
        lines.append(f"meshlm / {LABELS[key]} throughput by round: "
                     + " ".join(fmt(x, ".2f", "x") for x in ratios))
    return lines


def report_peers(results: dict[str, Result | None], concurrency: int,
                 rounds: Sequence[dict[str, Result | None]] = ()) -> list[str]:
    """The table at one concurrency (figures over every round), meshlm's ratios to each peer,
    and with several `rounds`, their figures round by round."""
    rows = [r for r in results.values() if r is not None]
    lines = [f"{f'HTTP, {concurrency} concurrent streams':<64} {'out tok/s':>10} "
             f"{'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'tokens':>7}"]
    lines += [f"{r.name:<64} {r.throughput:>10.1f} {fmt(r.ttft_ms(50), '.0f'):>12} "
              f"{fmt(r.itl_ms(50), '.1f'):>11} {r.tokens:>7}" for r in rows]
    mesh = results.get("mesh")
    for key in ("llama.cpp", "serve"):
        peer, label = results.get(key), LABELS[key]
        tp, ttft, itl = (ratio(f(mesh), f(peer)) if mesh and peer else None for f in (
            lambda r: r.throughput, lambda r: r.ttft_ms(50), lambda r: r.itl_ms(50)))
        lines.append(f"meshlm / {label}: throughput {fmt(tp, '.2f', 'x')}, TTFT p50 "
                     f"{fmt(ttft, '.2f', 'x')}, ITL p50 {fmt(itl, '.2f', 'x')}")
    return lines + report_rounds(rounds)


def parse_concurrencies(values: Sequence[str], sweep: bool) -> list[int]:
    """The concurrencies to measure, ascending, each once: every `--concurrency` value (an
    integer or a comma-separated list of them), plus `SWEEP` when `sweep` is set."""
    found = set(SWEEP) if sweep else set()
    for value in values:
        for item in value.split(","):
            try:
                c = int(item)
            except ValueError:
                raise click.BadParameter(f"{item.strip()!r} is not an integer",
                                         param_hint="--concurrency") from None
            if c < 1:
                raise click.BadParameter(f"{c} is below 1", param_hint="--concurrency")
            found.add(c)
    if not found:
        raise click.BadParameter("no concurrency given", param_hint="--concurrency")
    return sorted(found)


def requests_at(n_requests: int, concurrency: int) -> int:
    """Requests run at `concurrency`: --requests, but at least `WAVES` waves of streams."""
    return max(n_requests, WAVES * concurrency)


# --weights: each server's setting for the weights' type. bf16: llama.cpp a GGUF bf16 (its KV
# cache float16, its default either way), transformers serve the whole model in bfloat16,
# meshlm its packed linears' weights and its KV cache in bfloat16 (the activations are
# rounded to bfloat16 where they meet the weights on a CPU with AVX512_BF16, as llama.cpp's
# are). f32 keeps meshlm all float32, its KV cache included.
WEIGHTS = {"f32": {"serve": "float32", "mesh": "auto", "mesh_kv": "auto"},
           "bf16": {"serve": "bfloat16", "mesh": "bfloat16", "mesh_kv": "bfloat16"}}
# --kv-cache: the KV cache's type in llama.cpp and meshlm alike, (llama.cpp's
# --cache-type-k/v, meshlm's --kv-cache-dtype); "default" leaves each its own (llama.cpp
# float16, meshlm as --weights says). transformers serve keeps its model's type.
KV_CACHES: dict[str, tuple[str, str] | None] = {
    "default": None, "f16": ("f16", "float16"), "f32": ("f32", "float32")}


def servers(model_path: Path, requests: Sequence[BenchRequest], warmup: BenchRequest,
            concurrency: int, peer_threads: int, mesh_threads: int, weights: str = "f32",
            kv_cache: str = "default") -> dict[str, Callable[[], Result]]:
    """Each server's run at one concurrency, in the order they are measured (`mesh_threads`
    0: the mesh sizes its engine threads itself), with `weights` (a `WEIGHTS` key) and
    `kv_cache` (a `KV_CACHES` key)."""
    setting = WEIGHTS[weights]
    kv = KV_CACHES[kv_cache]
    return {
        "llama.cpp": lambda: run_llama_cpp(model_path, requests, warmup, concurrency,
                                           peer_threads, weights, kv[0] if kv else None),
        "serve": lambda: run_transformers_serve(str(model_path), requests, warmup, concurrency,
                                                peer_threads, setting["serve"]),
        "mesh": lambda: run_mesh(str(model_path), requests, warmup, concurrency, mesh_threads,
                                 setting["mesh"], kv[1] if kv else setting["mesh_kv"]),
    }


def threads_said(threads: int, cpus: int) -> str:
    """The thread counts of a run, in words."""
    if threads:
        return f"{threads} compute thread{'s' if threads > 1 else ''} in every server"
    return (f"llama.cpp and transformers serve on {cpus} threads, meshlm as shipped (its "
            "engine's threads chosen at start-up, see its engine_threads log line)")


def rounds_said(rounds: int) -> str:
    """How the servers took turns, in words ("" for one round)."""
    if rounds < 2:
        return ""
    return (f"{rounds} rounds of the servers in turn at each concurrency, each figure over "
            "all of a server's rounds; ")


def plot(results: dict[int, dict[str, Result | None]], plot_dir: Path, title: str,
         notes: list[str]) -> list[Path]:
    """Draw the charts of a sweep (`plots.py`) and return their paths; none with fewer than
    two concurrencies. A missing matplotlib skips the plots, not the run: it goes to `notes`."""
    if len(results) < 2:
        return []
    try:
        from meshlm.bench.plots import write_plots
    except ImportError as e:
        notes.append(f"plots skipped: {e} (it comes with the bench extra: make bench-peers)")
        return []
    series = {LABELS[p]: {c: r for c, by_peer in results.items() if (r := by_peer[p]) is not None}
              for p in PEERS}
    return write_plots({k: v for k, v in series.items() if v}, plot_dir, title)


@click.command()
@workload_options
@click.option("--concurrency", "concurrency_values", multiple=True, default=("16",),
              show_default=True, help="concurrent streams, repeated or comma-separated "
              "(1,4,16); llama.cpp slots and meshlm max_running follow it")
@click.option("--sweep", is_flag=True, help=f"also measure at {', '.join(map(str, SWEEP))}")
@click.option("--threads", default=0, show_default=True,
              help="compute threads for every server (0: llama.cpp and transformers serve "
                   "get every CPU, meshlm runs as shipped and sizes its engine itself)")
@click.option("--skip", multiple=True, type=click.Choice(PEERS), help="leave a server out")
@click.option("--weights", default="f32", show_default=True, type=click.Choice(list(WEIGHTS)),
              help="the weights' type in every server: f32, or bf16 (llama.cpp a bf16 GGUF, "
                   "transformers serve bfloat16, meshlm --packed-weight-dtype bfloat16)")
@click.option("--kv-cache", default="default", show_default=True,
              type=click.Choice(list(KV_CACHES)),
              help="the KV cache's type in llama.cpp and meshlm alike: f16 or f32 (like for "
                   "like), or each its default (llama.cpp float16, meshlm as --weights says); "
                   "transformers serve keeps its model's type")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(min=1),
              help="measure the servers this many times over at each concurrency, in turn, "
                   "each started afresh; figures over all rounds, ratios also by round")
@click.option("--plot-dir", default="bench-results", show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="where the PNG plots go (with two or more concurrencies)")
def main(n_requests: int, seed: int, prompt_min: int, prompt_max: int, output_mean: float,
         output_max: int, concurrency_values: tuple[str, ...], sweep: bool, threads: int,
         skip: tuple[str, ...], weights: str, kv_cache: str, rounds: int, plot_dir: Path
         ) -> None:
    concurrencies = parse_concurrencies(concurrency_values, sweep)
    for key, value in OFFLINE_ENV.items():  # before transformers is imported: local files only
        os.environ.setdefault(key, value)
    from meshlm.tokenizer.tokenization import TextTokenizer

    model_path = ensure_bench_model()
    cpus = len(os.sched_getaffinity(0))
    tok = TextTokenizer.from_pretrained(str(model_path))
    counts = {c: requests_at(n_requests, c) for c in concurrencies}
    workload = build_workload(max(counts.values()), tok.encode, seed, (prompt_min, prompt_max),
                              output_mean, (1, output_max))
    warmup = warmup_request(tok.encode)
    started = time.perf_counter()
    results: dict[int, dict[str, Result | None]] = {}
    by_round: dict[int, list[dict[str, Result | None]]] = {}
    failures: list[str] = []
    for c in concurrencies:  # each concurrency: the three servers one after another, per round
        failed: list[str] = []
        runs = servers(model_path, workload[:counts[c]], warmup, c, threads or cpus, threads,
                       weights, kv_cache)
        by_round[c] = [run_each(runs, skip, failed, f"round {r + 1}: " if rounds > 1 else "")
                       for r in range(rounds)]
        results[c] = merge_rounds(by_round[c])
        failures += [f"concurrency {c}: {f}" for f in failed]

    tokens = {c: sum(r.max_new_tokens for r in workload[:n]) for c, n in counts.items()}
    sizes = "; ".join(f"concurrency {c}: {n} requests, {tokens[c]} output tokens"
                      for c, n in counts.items())
    print(f"\nmodel: {model_path} (Llama, {weights} weights, CPU; llama.cpp: the same weights "
          f"as GGUF {weights})\nworkload: seed {seed}, prompts {prompt_min}-{prompt_max} "
          f"tokens, outputs exponential mean {output_mean:g} clipped to [1, {output_max}], EOS "
          f"ignored; the first max({n_requests}, {WAVES} x concurrency) requests of one "
          f"list\n{sizes}\n"
          f"{cpus} CPUs; {threads_said(threads, cpus)}; {rounds_said(rounds)}whole run "
          f"{time.perf_counter() - started:.0f} s\n")
    lines: list[str] = []
    for c in concurrencies:
        lines += report_peers(results[c], c, by_round[c]) + [""]
    notes = [f"concurrency {c}, {r.name}: {n}" for c, by_peer in results.items()
             for r in by_peer.values() if r is not None for n in r.notes]
    title = (f"{model_path.name} (Llama {weights}, CPU), {cpus} CPUs, "
             f"{threads_said(threads, cpus)}")
    paths = plot(results, plot_dir, title, notes)
    lines += [f"plot written: {path}" for path in paths] + ([""] if paths else [])
    lines += ["notes:"] + [f"- {n}" for n in failures + notes]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
