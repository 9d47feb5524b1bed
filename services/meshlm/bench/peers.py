"""`make bench-peers`: llama.cpp's `llama-server`, `transformers serve` and the meshlm mesh, one
after another on the same cores, the same checkpoint and the same seeded workload.

llama.cpp is built once from the llama-cpp-python sdist and gets the bench checkpoint as GGUF
f32 (`llama_cpp.py`); before it is measured, its token ids for a few texts are compared with the
checkpoint tokenizer's. Every server streams over HTTP at the same concurrency (closed loop) and
is measured for output tokens/s, TTFT p50 and ITL p50 (per request: time from the first event to
the end over the tokens after the first); the report ends with meshlm's ratios to each peer.
llama.cpp gets a new connection per request (see `LlamaCppServer`); the others keep theirs.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import click
from tqdm import tqdm

from meshlm.bench.checkpoint import MAX_POSITIONS, ensure_bench_model
from meshlm.bench.engine import Result, run_http, run_mesh, run_transformers_serve
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
# Texts whose token ids llama.cpp must share with the tokenizer, beside the workload's prompts.
TOKENIZER_PROBES = (
    "Hello world", "  two  spaces\tand a tab\n\nnew lines ", "3 33 333 3333 3.14 1,000,000",
    "I've been told he's there, 'RE you sure?", "naïve café, 東京, emoji 🚀",
)


def run_llama_cpp(model_path: Path, requests: Sequence[BenchRequest], warmup: BenchRequest,
                  concurrency: int, threads: int) -> Result:
    """`llama-server` with `concurrency` slots on loopback, driven over /v1/completions."""
    binary, gguf = ensure_llama_server(), ensure_gguf(model_path)
    with tempfile.TemporaryDirectory() as tmp, LlamaCppServer(
            binary, gguf, Path(tmp) / "llama-server.log", threads, concurrency,
            MAX_POSITIONS) as server:
        texts = [*TOKENIZER_PROBES, *(r.text for r in requests[:8])]
        mismatches = server.check_tokenizer(model_path / "tokenizer.json", texts)
        base = server.base_url
        result = asyncio.run(run_http(
            f"llama.cpp llama-server, -np {concurrency}, HTTP /v1/completions",
            lambda c, r: llama_cpp_stream(c, base, r), requests, warmup, concurrency,
            keepalive=False))
    result.notes.append(f"token ids equal to the tokenizer's for {len(texts) - len(mismatches)}"
                        f" of {len(texts)} texts" + "".join(f"; {m}" for m in mismatches[:3]))
    return result


def report_peers(results: dict[str, Result | None], concurrency: int) -> list[str]:
    rows = [r for r in results.values() if r is not None]
    lines = [f"{f'HTTP, {concurrency} concurrent streams':<64} {'out tok/s':>10} "
             f"{'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'tokens':>7}"]
    lines += [f"{r.name:<64} {r.throughput:>10.1f} {fmt(r.ttft_ms(50), '.0f'):>12} "
              f"{fmt(r.itl_ms(50), '.1f'):>11} {r.tokens:>7}" for r in rows]
    mesh = results.get("mesh")
    for key, label in (("llama.cpp", "llama.cpp"), ("serve", "transformers serve")):
        peer = results.get(key)
        tp, ttft, itl = (ratio(f(mesh), f(peer)) if mesh and peer else None for f in (
            lambda r: r.throughput, lambda r: r.ttft_ms(50), lambda r: r.itl_ms(50)))
        lines.append(f"meshlm / {label}: throughput {fmt(tp, '.2f', 'x')}, TTFT p50 "
                     f"{fmt(ttft, '.2f', 'x')}, ITL p50 {fmt(itl, '.2f', 'x')}")
    return lines


@click.command()
@workload_options
@click.option("--concurrency", default=16, show_default=True,
              help="concurrent streams; llama.cpp slots and meshlm max_running")
@click.option("--threads", default=0, show_default=True,
              help="compute threads for every server (0 = CPUs - 1, at least 1)")
@click.option("--skip", multiple=True, type=click.Choice(PEERS), help="leave a server out")
def main(n_requests: int, seed: int, prompt_min: int, prompt_max: int, output_mean: float,
         output_max: int, concurrency: int, threads: int, skip: tuple[str, ...]) -> None:
    for key, value in OFFLINE_ENV.items():  # before transformers is imported: local files only
        os.environ.setdefault(key, value)
    from meshlm.tokenizer.tokenization import TextTokenizer

    model_path = ensure_bench_model()
    threads = threads or max(1, (os.cpu_count() or 2) - 1)  # as bench-engine, see there
    tok = TextTokenizer.from_pretrained(str(model_path))
    requests = build_workload(n_requests, tok.encode, seed, (prompt_min, prompt_max),
                              output_mean, (1, output_max))
    warmup = warmup_request(tok.encode)
    started = time.perf_counter()
    runs: dict[str, Callable[[], Result]] = {
        "llama.cpp": lambda: run_llama_cpp(model_path, requests, warmup, concurrency, threads),
        "serve": lambda: run_transformers_serve(str(model_path), requests, warmup, concurrency,
                                                threads),
        "mesh": lambda: run_mesh(str(model_path), requests, warmup, concurrency, threads),
    }
    results: dict[str, Result | None] = dict.fromkeys(PEERS)
    failures = []
    for peer, run in runs.items():
        if peer in skip:
            continue
        try:
            result = results[peer] = run()
        except Exception as e:  # noqa: BLE001 - report it, still measure the other servers
            failures.append(f"{peer} failed: {type(e).__name__}: {e}")
            tqdm.write(failures[-1])
        else:
            tqdm.write(f"{result.name}: {result.throughput:.1f} out tok/s")
        gc.collect()

    out_lens = [r.max_new_tokens for r in requests]
    print(f"\nmodel: {model_path} (Llama, float32, CPU; llama.cpp: the same weights as GGUF "
          f"f32)\nworkload: {n_requests} requests, seed {seed}, prompts {prompt_min}-"
          f"{prompt_max} tokens, outputs mean {sum(out_lens) / len(out_lens):.1f} "
          f"({sum(out_lens)} tokens), EOS ignored\n{os.cpu_count()} CPUs; {threads} compute "
          f"threads in every server; whole run {time.perf_counter() - started:.0f} s\n")
    lines = report_peers(results, concurrency)
    notes = [f"{r.name}: {n}" for r in results.values() if r is not None for n in r.notes]
    lines += ["", "notes:"] + [f"- {n}" for n in failures + notes]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
