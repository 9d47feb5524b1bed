"""`make bench-engine`: the meshlm engine against HF transformers on one workload, one run.

On a random-weight Llama big enough that compute matters (`checkpoint.py`) and one seeded
workload (`workload.py`: prompts of 16-256 tokens, exponential output lengths, EOS ignored so
every system produces the same tokens), it measures output tokens/s of

1. the meshlm engine in-process, all requests at once (continuous batching), and at batch 1,
   with the paged KV cache's waste after every step;
2. HF `generate` in static batches of the same size (left padding, greedy): a batch decodes
   until its longest row is done, and only the requested tokens count as output;
3. the meshlm mesh (gateway /generate) and `transformers serve --continuous-batching`
   (/v1/completions), both streamed over HTTP with the same concurrency, with TTFT p50/p99;

and prints the ratios. Every system gets the same torch thread count (default CPUs - 1, as the
mesh's scheduler has). Machines are shared and noisy: compare the ratios of one run.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import click
import uvloop
from tqdm import tqdm

from meshlm.bench.checkpoint import ensure_bench_model
from meshlm.bench.serving import (
    OFFLINE_ENV,
    StreamFn,
    StreamStats,
    TransformersServe,
    completions_stream,
    drive,
    meshlm_stream,
    sse_pool,
)
from meshlm.bench.workload import (
    BenchRequest,
    WasteMeter,
    build_workload,
    fmt,
    percentile,
    ratio,
    static_batches,
    static_steps,
    warmup_request,
    workload_options,
)


@dataclass
class Result:
    name: str
    tokens: int  # useful output tokens (what the requests asked for)
    seconds: float
    ttft: list[float] = field(default_factory=list)  # seconds, per request (HTTP runs)
    itl: list[float] = field(default_factory=list)  # mean seconds between tokens, per request
    notes: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def ttft_ms(self, q: float) -> float | None:
        return percentile(self.ttft, q) * 1000 if self.ttft else None

    def itl_ms(self, q: float) -> float | None:
        return percentile(self.itl, q) * 1000 if self.itl else None

    @classmethod
    def merged(cls, results: Sequence[Result]) -> Result:
        """One server's rounds as one result: tokens and seconds summed (throughput over all
        of them), every request's TTFT and ITL, each note once; named as the first."""
        notes = list(dict.fromkeys(n for r in results for n in r.notes))
        return cls(results[0].name, sum(r.tokens for r in results),
                   sum(r.seconds for r in results), [t for r in results for t in r.ttft],
                   [t for r in results for t in r.itl], notes)


def _expect(result: Result, requests: Sequence[BenchRequest], got: Sequence[int]) -> None:
    """Note requests that did not produce exactly the tokens they asked for."""
    wrong = [(r.rid, r.max_new_tokens, n) for r, n in zip(requests, got, strict=True)
             if n != r.max_new_tokens]
    if wrong:
        rid, want, n = wrong[0]
        result.notes.append(f"{len(wrong)} requests got a different token count "
                            f"(e.g. {rid}: {n}, asked {want})")


# -- in-process -------------------------------------------------------------------------------

def run_engine(model_path: str, requests: Sequence[BenchRequest], warmup: BenchRequest,
               max_running: int, name: str, waste: WasteMeter | None = None,
               device: str = "cpu") -> Result:
    """All `requests` submitted at once to an Engine with `max_running` slots; steps until done,
    reading stats() after every step into `waste`."""
    from meshlm.scheduler.engine.engine import Engine, EngineConfig, SamplingParams

    def params(r: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_new_tokens=r.max_new_tokens, ignore_eos=True)

    engine = Engine(EngineConfig(model_path=model_path, device=device, dtype="float32",
                                 max_running=max_running))
    engine.add_request(warmup.rid, list(warmup.prompt_ids), params(warmup))
    while engine.has_work():
        engine.step()
    counts = dict.fromkeys((r.rid for r in requests), 0)
    bar = tqdm(total=sum(r.max_new_tokens for r in requests), desc=name, leave=False)
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r.rid, list(r.prompt_ids), params(r))
    steps = 0
    while engine.has_work():
        outputs = engine.step()
        steps += 1
        for o in outputs:
            counts[o.rid] += len(o.new_token_ids)
            if o.finished and o.finish_reason == "error":
                raise RuntimeError(f"engine request {o.rid} failed: {o.error}")
        bar.update(sum(len(o.new_token_ids) for o in outputs))
        if waste is not None:
            waste.add(engine.stats())
    seconds = time.perf_counter() - start
    bar.close()
    result = Result(name, sum(counts.values()), seconds)
    result.notes.append(f"{steps} steps, {seconds / steps * 1000:.0f} ms each; "
                        f"{engine.packed_linears} linears packed for {engine.linear_kernel}'s "
                        "kernel (HF runs plain torch linears)")
    _expect(result, requests, [counts[r.rid] for r in requests])
    return result


def run_hf_generate(model_path: str, requests: Sequence[BenchRequest], warmup: BenchRequest,
                    batch_size: int, device: str = "cpu") -> Result:
    """HF `generate`, static batches of `batch_size`, left-padded, greedy, EOS disabled; each
    batch decodes max(max_new_tokens) steps for every row."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.to(torch.device(device))
    pad_id = model.generation_config.pad_token_id or model.config.pad_token_id or 0
    model.generation_config.eos_token_id = None  # with eos_token_id=None below: never stop early

    def generate(batch: Sequence[BenchRequest]) -> int:
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        steps = static_steps(batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=steps,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        return int(out.shape[1]) - width

    generate([warmup])
    batches = static_batches(requests, batch_size)
    start = time.perf_counter()
    produced = [generate(b) for b in tqdm(batches, desc="HF generate", leave=False)]
    seconds = time.perf_counter() - start
    result = Result(f"HF generate, static batch {batch_size}",
                    sum(r.max_new_tokens for r in requests), seconds)
    generated = sum(len(b) * static_steps(b) for b in batches)
    passes = sum(produced)  # one forward pass per new token: the prefill, then decode steps
    result.notes.append(f"{passes} forward passes, {seconds / passes * 1000:.0f} ms each; "
                        f"decoded {generated} row-tokens for {result.tokens} requested "
                        f"({1 - result.tokens / generated:.0%} padding/overrun)")
    if produced != [static_steps(b) for b in batches]:
        result.notes.append(f"batches stopped early: decoded {produced}")
    return result


# -- over HTTP --------------------------------------------------------------------------------

def run_http(name: str, base_url: str, stream: StreamFn, requests: Sequence[BenchRequest],
             warmup: BenchRequest, concurrency: int, keepalive: bool = True) -> Result:
    """`requests` over `concurrency` streams to the server at `base_url`, after `warmup`, on
    uvloop's event loop (the lean client's reads cost the shared CPU least there)."""
    async def main() -> tuple[list[StreamStats], float]:
        client = sse_pool(base_url, keepalive)
        try:
            await stream(client, warmup)
            return await drive(client, stream, requests, concurrency)
        finally:
            client.close()

    stats, seconds = uvloop.run(main())
    result = Result(name, sum(s.tokens for s in stats), seconds, [s.ttft for s in stats],
                    [s.itl for s in stats if s.itl is not None])
    by_rid = {s.rid: s for s in stats}
    _expect(result, requests, [by_rid[r.rid].tokens for r in requests])
    bad_prompt = [r.rid for r in requests if by_rid[r.rid].prompt_tokens != len(r.prompt_ids)]
    if bad_prompt:
        result.notes.append(f"{len(bad_prompt)} prompts tokenized to a different length than "
                            f"the workload's (e.g. {bad_prompt[0]})")
    return result


def run_mesh(model_path: str, requests: Sequence[BenchRequest], warmup: BenchRequest,
             concurrency: int, threads: int, packed_weight_dtype: str = "auto",
             kv_cache_dtype: str = "auto", device: str = "cpu") -> Result:
    """The whole mesh (Redis + four services) on loopback, driven over HTTP /generate;
    `threads` 0: the scheduler chooses its engine's threads (as `make run`)."""
    from meshlm.launch.mesh import Mesh, MeshOptions

    env = {"MESHLM_MAX_RUNNING": str(concurrency), "MESHLM_LOG_LEVEL": "info",
           "MESHLM_PACKED_WEIGHT_DTYPE": packed_weight_dtype,
           "MESHLM_KV_CACHE_DTYPE": kv_cache_dtype, "MESHLM_DEVICE": device}
    if threads:
        env["MESHLM_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as tmp:
        options = MeshOptions(workdir=Path(tmp), model_path=model_path, http_port=0,
                              grpc_port=0, env=env)
        with Mesh(options) as mesh:
            base = mesh.addresses.gateway_http
            result = run_http("meshlm mesh, HTTP /generate", base, meshlm_stream, requests,
                              warmup, concurrency)
            result.notes += engine_choices_said(mesh.log_path("scheduler"))
            return result


def engine_choices_said(scheduler_log: Path) -> list[str]:
    """What the scheduler's start-up lines say it chose: its kernels and KV cache type
    (`engine_ready`) and its engine's threads (`engine_threads`)."""
    import json

    said = []
    for line in scheduler_log.read_text(errors="replace").splitlines():
        if '"engine_ready"' in line:
            e = json.loads(line)
            fused = (", the layers fused" if e.get("fused_layers") else "") + (
                " (a step's layers in one call)" if e.get("layers_in_one_call") else "")
            weights, activations = e["linear_weight_dtype"], e.get("linear_activation_dtype")
            rounded = (f" (activations rounded to {activations})"
                       if activations and activations != e.get("dtype", activations) else "")
            said.append(f"kernels: {e['attention_backend']}{fused}; matmuls: "
                        f"{e['linear_kernel']}, {weights} weights{rounded}; KV cache "
                        f"{e.get('kv_cache_dtype', 'of the model dtype')}")
        elif '"engine_threads"' in line:
            e = json.loads(line)
            said.append(f"the engine chose {e['threads']} threads on {e['cores']:g} cores: "
                        f"{e['engine_us_per_token']} us of engine CPU per output token "
                        f"against {e['mesh_us_per_token']} for the rest of the mesh")
    return said


def run_transformers_serve(model_path: str, requests: Sequence[BenchRequest],
                           warmup: BenchRequest, concurrency: int, threads: int,
                           dtype: str = "float32") -> Result:
    """`transformers serve --continuous-batching` on loopback, driven over /v1/completions."""
    with tempfile.TemporaryDirectory() as tmp, TransformersServe(
            model_path, Path(tmp) / "transformers-serve.log", threads, dtype=dtype) as server:
        return run_http("transformers serve --continuous-batching, HTTP /v1/completions",
                        server.base_url, completions_stream, requests, warmup, concurrency)


# -- report -----------------------------------------------------------------------------------

def report_inprocess(engine: Result | None, batch1: Result | None, hf: Result | None,
                     waste: WasteMeter) -> list[str]:
    rows = [r for r in (engine, batch1, hf) if r is not None]
    lines = [f"{'in-process':<44} {'out tok/s':>10} {'tokens':>7} {'seconds':>8}"]
    lines += [f"{r.name:<44} {r.throughput:>10.1f} {r.tokens:>7} {r.seconds:>8.1f}" for r in rows]
    eng, b1, h = (r.throughput if r else None for r in (engine, batch1, hf))
    lines.append(f"engine / HF generate: {fmt(ratio(eng, h), '.2f', 'x')} (target >= 3x); "
                 f"engine / engine at batch 1: {fmt(ratio(eng, b1), '.2f', 'x')}")
    frac, target = waste.mean_fraction, waste.target
    lines.append(
        f"KV waste: {fmt(_pct(frac), '.1f', '%')} of allocated slots, mean over "
        f"{len(waste.fractions)} steps (target <= block {fmt(waste.block_size, 'd')} / mean "
        f"sequence {fmt(waste.mean_seq_len, '.0f')} tokens = {fmt(_pct(target), '.1f', '%')})"
        + ("" if frac is not None else "; the engine's stats() has no kv_block_* keys yet"))
    return lines


def _pct(x: float | None) -> float | None:
    return None if x is None else x * 100


def report_http(mesh: Result | None, serve: Result | None, concurrency: int) -> list[str]:
    rows = [r for r in (mesh, serve) if r is not None]
    lines = [f"{f'HTTP, {concurrency} concurrent streams':<64} {'out tok/s':>10} "
             f"{'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tokens':>7}"]
    lines += [f"{r.name:<64} {r.throughput:>10.1f} {fmt(r.ttft_ms(50), '.0f'):>12} "
              f"{fmt(r.ttft_ms(99), '.0f'):>12} {r.tokens:>7}" for r in rows]
    m_tp, s_tp = (r.throughput if r else None for r in (mesh, serve))
    m_ttft, s_ttft = (r.ttft_ms(50) if r else None for r in (mesh, serve))
    lines.append(f"meshlm / transformers serve: throughput {fmt(ratio(m_tp, s_tp), '.2f', 'x')} "
                 f"(target >= 2x), TTFT p50 {fmt(ratio(m_ttft, s_ttft), '.2f', 'x')} "
                 f"(target < 1x)")
    return lines


def run_each(runs: dict[str, Callable[[], Result]], skip: Sequence[str], failures: list[str],
             label: str = "") -> dict[str, Result | None]:
    """Run each of `runs` not in `skip`, one after another; a failure is appended to
    `failures` ("<label><name> failed: ...") and leaves that result None."""
    results: dict[str, Result | None] = dict.fromkeys(runs)
    for name, run in runs.items():
        if name in skip:
            continue
        try:
            result = results[name] = run()
        except Exception as e:  # noqa: BLE001 - report it, still measure the others
            failures.append(f"{label}{name} failed: {type(e).__name__}: {e}")
            tqdm.write(failures[-1])
        else:
            tqdm.write(f"{result.name}: {result.throughput:.1f} out tok/s")
        gc.collect()
        _release_gpu_cache()
    return results


def _release_gpu_cache() -> None:
    """Give the GPU memory a finished stage's allocator still caches back to the driver, so the
    next stage (the mesh's scheduler is another process) may have it."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


STAGES = ("engine", "batch1", "hf", "mesh", "serve")


@click.command()
@click.option("--model-path", default="", help="checkpoint (default: the bench checkpoint, "
              "built once under ~/.cache/meshlm/models)")
@workload_options
@click.option("--batch-size", default=16, show_default=True,
              help="engine max_running, HF static batch, concurrent HTTP streams")
@click.option("--batch1-requests", default=16, show_default=True,
              help="the first N requests run at batch 1")
@click.option("--threads", default=0, show_default=True,
              help="torch threads for every system (0 = CPUs - 1, at least 1)")
@click.option("--skip", multiple=True, type=click.Choice(STAGES), help="leave a stage out")
@click.option("--device", default="cpu", show_default=True,
              help="where the engine, HF generate and the mesh's scheduler compute (cpu, cuda, "
                   "cuda:N); transformers serve stays on the CPU")
def main(model_path: str, n_requests: int, seed: int, prompt_min: int, prompt_max: int,
         output_mean: float, output_max: int, batch_size: int, batch1_requests: int,
         threads: int, skip: tuple[str, ...], device: str) -> None:
    for key, value in OFFLINE_ENV.items():  # before transformers is imported: local files only
        os.environ.setdefault(key, value)
    import torch

    from meshlm.tokenizer.tokenization import TextTokenizer

    model_path = model_path or str(ensure_bench_model())
    # One thread count for every system, a core left to the rest of the machine as the mesh
    # does: OpenMP workers that share a core with another busy process spin on each other
    # (measured here: 2 threads ~20x slower than 1 while another process used a core).
    threads = threads or max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    tok = TextTokenizer.from_pretrained(model_path)
    requests = build_workload(n_requests, tok.encode, seed, (prompt_min, prompt_max),
                              output_mean, (1, output_max))
    warmup = warmup_request(tok.encode)
    prompt_lens = [len(r.prompt_ids) for r in requests]
    out_lens = [r.max_new_tokens for r in requests]
    started = time.perf_counter()

    waste = WasteMeter()
    subset = requests[:batch1_requests]
    stages: dict[str, Callable[[], Result]] = {
        "engine": lambda: run_engine(model_path, requests, warmup, batch_size,
                                     f"meshlm engine, max_running {batch_size}", waste, device),
        "batch1": lambda: run_engine(model_path, subset, warmup, 1,
                                     f"meshlm engine, batch 1 ({len(subset)} requests)",
                                     device=device),
        "hf": lambda: run_hf_generate(model_path, requests, warmup, batch_size, device),
        "mesh": lambda: run_mesh(model_path, requests, warmup, batch_size, threads,
                                 device=device),
        "serve": lambda: run_transformers_serve(model_path, requests, warmup, batch_size,
                                                threads),
    }
    failures: list[str] = []
    results = run_each(stages, skip, failures, "stage ")

    where = "CPU" if device == "cpu" else f"{device}: {torch.cuda.get_device_name(device)}"
    print(f"\nmodel: {model_path} (Llama, float32, {where})\n"
          f"workload: {n_requests} requests, seed {seed}; prompts {min(prompt_lens)}-"
          f"{max(prompt_lens)} tokens (mean {sum(prompt_lens) / len(prompt_lens):.0f}); "
          f"outputs exponential mean {output_mean:g} clipped to [1, {output_max}] (mean "
          f"{sum(out_lens) / len(out_lens):.1f}, {sum(out_lens)} tokens), EOS ignored\n"
          f"{os.cpu_count()} CPUs; torch threads {threads} in every system (in-process, mesh "
          f"scheduler, transformers serve); whole run {time.perf_counter() - started:.0f} s\n")
    r = results
    lines = report_inprocess(r["engine"], r["batch1"], r["hf"], waste)
    lines += [""] + report_http(r["mesh"], r["serve"], batch_size)
    notes = [f"{res.name}: {n}" for res in r.values() if res is not None for n in res.notes]
    notes.append("both servers get the same text and tokenize it themselves (prompt and "
                 "completion token counts are checked against the workload; mismatches are "
                 "noted above); transformers serve has no ignore_eos: it gets max_tokens and "
                 "generation_config {eos_token_id: -1}, which its continuous batching honours")
    lines += ["", "notes:"] + [f"- {n}" for n in failures + notes]
    print("\n".join(lines))
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
