"""`make bench`: the engine in-process vs the mesh over gRPC vs the mesh over HTTP, one run.

Prints TTFT p50/p99 at concurrency 1 and output tokens/s at saturation for each path (by
default issue 16's workload: 256 requests kept 64 in flight, output lengths exponential with
mean 128, the same seeded lengths everywhere), the ratios between them, and the CPU time each
mesh service spends per output token in the saturation phases (from /proc, see proc_cpu.py)
against the bare engine's. Machines are shared and noisy: compare the ratios of one run. A
run is `--rounds` rounds (3) of in-process, gRPC and HTTP in turn, on one engine and one mesh,
so that each path meets the same quiet and busy periods; a path's figures are over all its
rounds, and the throughput ratios are also printed round by round.

With --pin (the default on >= 2 CPUs) the engine gets its own CPU(s) and everything else the
rest: in-process, the whole bench process runs on the engine's CPUs; in the mesh, the bench
process (the load generator), redis, the gateway, tokenizer and detokenizer run on the rest,
and the scheduler, told MESHLM_ENGINE_CPUS, puts itself (engine and event loop) on the
engine's CPUs (see pinning.py and scheduler/cpus.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import click
import grpc
import httpx
import orjson
import uvloop
from tqdm import tqdm

from meshlm.bench.gateway_path import own_cpu_us
from meshlm.bench.mesh_report import (
    ENGINE_THREAD_PART,
    LOAD_GENERATOR_PART,
    SERVICES,
    SPACED_GAP_S,
    Result,
    batching_line,
    cpu_line,
    fill_line,
    floor_line,
    forward_line,
    own_work_line,
    pinned_line,
    placement_lines,
    report,
    rounds_line,
    saturated_line,
)
from meshlm.bench.pinning import (
    CpuPlan,
    format_cpus,
    pin_process,
    set_tree_affinity,
    thread_cpus,
)
from meshlm.bench.proc_cpu import cpu_delta, snapshot
from meshlm.bench.raw_grpc import GrpcConnection
from meshlm.bench.raw_http import SsePool
from meshlm.bench.saturated import Arrivals
from meshlm.bench.transport_floor import grpc_message_floor_us, http_event_floor_us
from meshlm.bench.workload import output_lengths
from meshlm.common.default_model import ensure_default_model
from meshlm.common.memory import freeze_startup_objects
from meshlm.launch.mesh import Mesh, MeshOptions
from meshlm.scheduler.cpus import ENGINE_THREAD
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

WORDS = "the river runs past a quiet town where lanterns glow in winter light".split()
SEED = 20240917
T = TypeVar("T")


def prompt(i: int, length: int) -> str:
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(length))


@dataclass(frozen=True)
class Saturation:
    """The saturation phase: `requests` (prompt, output tokens) run `concurrency` at a time
    (the engine's max_running). In-process every request is queued at once, so the running
    batch refills within the step that frees a slot; in the mesh the client keeps `in_flight`
    requests going, starting the next when one ends: as many as the slots (the default), each
    freed slot waits for the client's next request to cross the mesh; more, and the
    scheduler's own queue refills it, as the in-process engine's does."""

    requests: tuple[tuple[str, int], ...]
    concurrency: int
    in_flight: int

    @classmethod
    def build(cls, n: int, concurrency: int, mean_tokens: int, fixed: bool,
              in_flight: int = 0) -> Saturation:
        """`n` requests of 16-word prompts; output lengths exponential with `mean_tokens`
        (seeded, clipped to [1, 4 x mean]) or, `fixed`, all `mean_tokens`; `in_flight` 0:
        `concurrency`."""
        lengths = ([mean_tokens] * n if fixed
                   else output_lengths(n, mean_tokens, 1, 4 * mean_tokens, seed=SEED))
        return cls(tuple((prompt(i, 16), k) for i, k in enumerate(lengths)), concurrency,
                   in_flight or concurrency)

    @property
    def tokens(self) -> int:
        return sum(k for _, k in self.requests)

    def describe(self) -> str:
        kept = ("" if self.in_flight == self.concurrency
                else f", the mesh's client keeping {self.in_flight} in flight")
        return (f"{len(self.requests)} requests ({self.tokens} output tokens) at concurrency "
                f"{self.concurrency}{kept}")


async def _limited(concurrency: int, calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run `calls` with at most `concurrency` in flight, in order; their results."""
    slots = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with slots:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))


# -- in-process -------------------------------------------------------------------------------

class InProcess:
    """The engine in this process, warmed up once; each `round` measures TTFT (back to back
    and spaced) and the saturation phase again, with fresh rids."""

    def __init__(self, model_path: str, n_warm: int, sat: Saturation, threads: int) -> None:
        from meshlm.scheduler.engine.engine import Engine, EngineConfig
        from meshlm.tokenizer.tokenization import TextTokenizer

        self.sat = sat
        self.tok = TextTokenizer.from_pretrained(model_path)
        # On a GPU this engine shares the card with the mesh's scheduler, which takes its
        # default share (0.85) less what this one holds: 0.4 leaves it as much.
        self.engine = Engine(EngineConfig(model_path=model_path, max_running=sat.concurrency,
                                          num_threads=threads or None, mem_fraction=0.4))
        self.rounds = 0
        for i in range(n_warm):
            self._add(f"w{i}", self.tok.encode(prompt(i, 16)), 2)
            while self.engine.has_work():
                self.engine.step()

    def _add(self, rid: str, ids: list[int], new_tokens: int) -> None:
        from meshlm.scheduler.engine.engine import SamplingParams

        self.engine.add_request(rid, ids, SamplingParams(
            temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))

    def _first_token(self, rid: str, i: int) -> float:
        start = time.perf_counter()
        self._add(rid, self.tok.encode(prompt(i, 16)), 1)
        seconds = 0.0
        while self.engine.has_work():
            if any(o.new_token_ids for o in self.engine.step()):
                seconds = time.perf_counter() - start
        return seconds

    def round(self, n_ttft: int) -> Result:
        r, engine = self.rounds, self.engine
        self.rounds += 1
        ttft = [self._first_token(f"t{r}-{i}", i)
                for i in tqdm(range(n_ttft), desc="engine ttft", leave=False)]
        spaced = []
        for i in range(n_ttft):
            time.sleep(SPACED_GAP_S)  # the workload: the engine idle before the request comes
            spaced.append(self._first_token(f"g{r}-{i}", i))
        ids = [self.tok.encode(text) for text, _ in self.sat.requests]
        totals = engine.stats()
        start, cpu_start = time.perf_counter(), time.process_time()
        for i, (p, (_, new_tokens)) in enumerate(zip(ids, self.sat.requests, strict=True)):
            self._add(f"s{r}-{i}", p, new_tokens)
        tokens, longest, before = 0, 0.0, time.perf_counter()
        arrivals = Arrivals()
        while engine.has_work():
            outputs = engine.step()
            after = time.perf_counter()
            came = 0
            for o in outputs:
                n = len(o.new_token_ids)
                came += n
                if n and o.completion_tokens == n:
                    arrivals.first(after)
            tokens += came
            arrivals.add(after, came)
            longest, before = max(longest, after - before), after
        seconds, cpu, now = (time.perf_counter() - start, time.process_time() - cpu_start,
                             engine.stats())
        return Result("in-process", ttft, tokens, seconds, cpu={"engine": cpu},
                      spaced_ttft=spaced, steps=now["steps_total"] - totals["steps_total"],
                      longest_gap=longest, forward=now["forward_cpu_seconds_total"]
                      - totals["forward_cpu_seconds_total"],
                      saturated=arrivals.window(self.sat.concurrency),
                      fills=(arrivals.fill_seconds(self.sat.concurrency, start),))


# -- mesh over gRPC ---------------------------------------------------------------------------

class Streamed(NamedTuple):
    """One streamed request as its client saw it: seconds to its first message, its output
    tokens, the longest wait between two of its messages, and how many messages came."""

    ttft: float
    tokens: int
    longest_gap: float
    messages: int


class Gaps:
    """The longest wait between two consecutive messages of a stream, and their count."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.longest = 0.0
        self.count = 0

    def seen(self) -> float:
        self.count += 1
        now = time.perf_counter()
        if self.last is not None:
            self.longest = max(self.longest, now - self.last)
        self.last = now
        return now


class _Watch:
    """One streamed TextGenerate call as its client sees it, message by message."""

    def __init__(self, arrivals: Arrivals | None) -> None:
        self.arrivals = arrivals
        self.start = time.perf_counter()
        self.first: float | None = None
        self.tokens = 0
        self.gaps = Gaps()

    def message(self, msg: pb.TextGenerateResponse) -> bool:
        """Count one message; whether it is the call's last."""
        now = self.gaps.seen()
        if self.first is None:
            self.first = now - self.start
            if self.arrivals is not None:
                self.arrivals.first(now)
        if self.arrivals is not None:
            self.arrivals.add(now, len(msg.output_ids))
        if msg.finished:
            self.tokens = int(msg.meta_info["completion_tokens"])
        return msg.finished

    def streamed(self) -> Streamed:
        return Streamed(self.first or 0.0, self.tokens, self.gaps.longest, self.gaps.count)


def _text_generate(text: str, new_tokens: int) -> pb.TextGenerateRequest:
    return pb.TextGenerateRequest(text=text, stream=True, sampling_params=pb.SamplingParams(
        temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))


async def _grpc_one(stub: sglang_pb2_grpc.SglangServiceStub, text: str, new_tokens: int,
                    arrivals: Arrivals | None = None) -> Streamed:
    watch = _Watch(arrivals)
    async for msg in stub.TextGenerate(_text_generate(text, new_tokens)):
        watch.message(msg)
    return watch.streamed()


def engine_totals(stub: sglang_pb2_grpc.SglangServiceStub) -> tuple[int, float]:
    """Engine steps and their forward passes' CPU seconds so far, every scheduler's (GetLoad's
    steps_total and forward_cpu_seconds_total)."""
    loads = orjson.loads(stub.GetLoad(pb.GetLoadRequest(), timeout=10).json_info)
    return (sum(int(load.get("steps_total", 0)) for load in loads),
            sum(float(load.get("forward_cpu_seconds_total", 0.0)) for load in loads))


async def _drive(name: str, one: Callable[..., Awaitable[Streamed]], n_warm: int, n_ttft: int,
                 sat: Saturation, measure: Callable[[], dict[str, float]],
                 totals: Callable[[], tuple[int, float]]) -> Result:
    """One transport's round: `n_warm` requests, TTFT at concurrency 1, then the saturation
    phase. `one(text, new_tokens, arrivals=None)` streams one request."""
    for i in range(n_warm):
        await one(prompt(i, 16), 2)
    ttft = [(await one(prompt(i, 16), 1)).ttft
            for i in tqdm(range(n_ttft), desc=f"{name.split()[-1].lower()} ttft", leave=False)]
    totals_before, cpu_before, start = totals(), measure(), time.perf_counter()
    arrivals = Arrivals()
    results = await _limited(sat.in_flight, [
        functools.partial(one, text, k, arrivals) for text, k in sat.requests])
    seconds, cpu = time.perf_counter() - start, cpu_delta(cpu_before, measure())
    steps, forward = (after - before for after, before in zip(totals(), totals_before,
                                                               strict=True))
    return Result(name, ttft, sum(r.tokens for r in results), seconds, cpu, steps=int(steps),
                  longest_gap=max(r.longest_gap for r in results),
                  saturated=arrivals.window(sat.concurrency),
                  messages=sum(r.messages for r in results), forward=forward,
                  fills=(arrivals.fill_seconds(sat.concurrency, start),))


_TEXT_GENERATE = "/sglang.runtime.v1.SglangService/TextGenerate"


async def _raw_grpc_one(conn: GrpcConnection, text: str, new_tokens: int,
                        arrivals: Arrivals | None = None) -> Streamed:
    """_grpc_one over the lean client: each message is read where it arrives (raw_grpc.py)."""
    watch = _Watch(arrivals)
    parse = pb.TextGenerateResponse.FromString
    await conn.call(_TEXT_GENERATE, _text_generate(text, new_tokens).SerializeToString(),
                    lambda data: watch.message(parse(data)))
    return watch.streamed()


async def bench_grpc(address: str, n_warm: int, n_ttft: int, sat: Saturation,
                     measure: Callable[[], dict[str, float]],
                     totals: Callable[[], tuple[int, float]], client: str = "raw") -> Result:
    if client == "raw":
        host, _, port = address.rpartition(":")
        conn = await GrpcConnection.open(host, int(port))
        try:
            one = functools.partial(_raw_grpc_one, conn)
            return await _drive("mesh gRPC", one, n_warm, n_ttft, sat, measure, totals)
        finally:
            conn.close()
    async with grpc.aio.insecure_channel(address) as channel:
        one = functools.partial(_grpc_one, sglang_pb2_grpc.SglangServiceStub(channel))
        return await _drive("mesh gRPC", one, n_warm, n_ttft, sat, measure, totals)


# -- mesh over HTTP ---------------------------------------------------------------------------

async def _http_one(pool: SsePool, text: str, new_tokens: int,
                    arrivals: Arrivals | None = None) -> Streamed:
    body = orjson.dumps({"text": text, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})
    start = time.perf_counter()
    first: list[float] = []
    last = [b""]
    gaps = Gaps()
    came = 0  # tokens so far (each event's meta_info counts them all)

    def on_event(event: bytes) -> None:
        nonlocal came
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return
        now = gaps.seen()
        if not first:
            first.append(now - start)
            if arrivals is not None:
                arrivals.first(now)
        if arrivals is not None:
            at = event.rfind(b'"completion_tokens":') + len(b'"completion_tokens":')
            so_far = int(event[at:event.find(b",", at)])
            arrivals.add(now, so_far - came)
            came = so_far
        last[0] = event

    await pool.stream("/generate", body, on_event)
    tokens = int(orjson.loads(last[0][6:])["meta_info"]["completion_tokens"]) if last[0] else 0
    return Streamed(first[0] if first else 0.0, tokens, gaps.longest, gaps.count)


async def bench_http(base: str, n_warm: int, n_ttft: int, sat: Saturation,
                     measure: Callable[[], dict[str, float]],
                     totals: Callable[[], tuple[int, float]]) -> Result:
    url = httpx.URL(base)
    pool = SsePool(url.host, url.port or 80)
    try:
        one = functools.partial(_http_one, pool)
        return await _drive("mesh HTTP", one, n_warm, n_ttft, sat, measure, totals)
    finally:
        pool.close()


def _env_overrides() -> dict[str, str]:
    """MESHLM_BENCH_<NAME>=value sets MESHLM_<NAME> for the mesh's services only."""
    prefix = "MESHLM_BENCH_"
    return {"MESHLM_" + k[len(prefix):]: v for k, v in os.environ.items() if k.startswith(prefix)}


def on_engine_cpus(plan: CpuPlan | None) -> contextlib.AbstractContextManager[object]:
    """This process on the engine's CPUs (the in-process rounds). Torch keeps the engine's
    threads throughout: the load generator between rounds runs no torch."""
    return pin_process(plan.engine) if plan else contextlib.nullcontext()


def run_rounds(model_path: str, n_warm: int, n_ttft: int, sat: Saturation, threads: int,
               plan: CpuPlan | None, rounds: int, grpc_client: str = "raw"
               ) -> tuple[dict[str, list[Result]], dict[str, Counter[str]]]:
    """`rounds` rounds of in-process, mesh gRPC, mesh HTTP, in turn, so that each path
    meets the same quiet and busy periods of a shared machine; each path's results by round,
    and how many threads of each service may run on which CPUs (seen after the first gRPC
    round).

    Pinned, the scheduler places itself (MESHLM_ENGINE_CPUS); once the mesh is up, every
    other service, redis and this process move to the rest CPUs (this process goes back to
    the engine's CPUs for each in-process round, while the mesh waits)."""
    with on_engine_cpus(plan):
        engine = InProcess(model_path, n_warm, sat, threads)
    env = {"MESHLM_MAX_RUNNING": str(sat.concurrency), "MESHLM_NUM_THREADS": str(threads),
           "MESHLM_LOG_LEVEL": "warning"}
    if plan:
        env["MESHLM_ENGINE_CPUS"] = format_cpus(plan.engine)
    results: dict[str, list[Result]] = {"in-process": [], "mesh gRPC": [], "mesh HTTP": []}
    cpus: dict[str, Counter[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        options = MeshOptions(workdir=Path(tmp), model_path=model_path, http_port=0,
                              grpc_port=0, env={**env, **_env_overrides()})
        with Mesh(options) as mesh, (
                pin_process(plan.rest) if plan else contextlib.nullcontext()):
            if plan:
                _pin_all_but_schedulers(mesh, plan.rest)
            parts = {role: [p.pid for p in mesh.replicas(role) if p.pid] for role in SERVICES}
            engine_thread = {ENGINE_THREAD_PART: (parts["scheduler"], ENGINE_THREAD)}

            def measure() -> dict[str, float]:  # this process alone: the mesh is its children
                return {**snapshot(parts, engine_thread), LOAD_GENERATOR_PART: time.process_time()}

            with grpc.insecure_channel(mesh.addresses.gateway_grpc) as channel:
                totals = functools.partial(engine_totals,
                                           sglang_pb2_grpc.SglangServiceStub(channel))
                # As every service does once started: the in-process engine is then not stopped
                # by full collections over this process's start-up objects (one took 198 ms).
                freeze_startup_objects()
                for r in range(rounds):
                    warm = n_warm if r == 0 else 0
                    with on_engine_cpus(plan):
                        results["in-process"].append(engine.round(n_ttft))
                    results["mesh gRPC"].append(_run_client(grpc_client == "raw", bench_grpc(
                        mesh.addresses.gateway_grpc, warm, n_ttft, sat, measure, totals,
                        grpc_client)))
                    if not cpus:
                        cpus = {name: thread_cpus(p.pid)
                                for name, p in mesh.services.items() if p.pid}
                    results["mesh HTTP"].append(_run_client(True, bench_http(
                        mesh.addresses.gateway_http, warm, n_ttft, sat, measure, totals)))
    return results, cpus


def _run_client(lean: bool, main: Coroutine[object, object, T]) -> T:
    """Run a round's load generator: on uvloop's event loop for the lean clients (its reads
    cost the shared CPU a third less: with raw_grpc and raw_http, 21-29 and 22 µs of CPU a
    message against 31-38 and 26-37 on asyncio's loop; grpc.aio's client took 79-84), on
    asyncio's for grpc.aio's."""
    return uvloop.run(main) if lean else asyncio.run(main)


def _pin_all_but_schedulers(mesh: Mesh, cpus: frozenset[int]) -> None:
    """Move every service but the schedulers, with their children, and redis onto `cpus`."""
    pids = [p.pid for p in mesh.services.values() if p.role != "scheduler"]
    pids.append(mesh.redis.pid if mesh.redis else None)
    for pid in pids:
        if pid:
            set_tree_affinity(cpus, pid)


@click.command()
@click.option("--model-path", default="", envvar="MESHLM_MODEL_PATH",
              help="checkpoint (default: the embedded model)")
@click.option("--warmup-requests", default=20, show_default=True,
              help="requests each path (in-process, gRPC, HTTP) serves before its TTFT phase")
@click.option("--ttft-requests", default=50, show_default=True)
@click.option("--saturation-requests", default=256, show_default=True)
@click.option("--concurrency", default=64, show_default=True,
              help="requests in flight in the saturation phase (and the engine's max_running)")
@click.option("--in-flight", default=0, show_default=True,
              help="requests the mesh's client keeps in flight in the saturation phase (0: "
                   "--concurrency; more keeps some waiting in the scheduler, as the in-process "
                   "engine's queue holds every request from the start)")
@click.option("--new-tokens", default=128, show_default=True,
              help="mean output tokens per request (exponential, seeded; see --fixed-tokens)")
@click.option("--fixed-tokens", is_flag=True,
              help="every request makes exactly --new-tokens tokens (all end at once)")
@click.option("--engine-threads", default=0, show_default=True,
              help="torch CPU threads for the engine, in-process and in the mesh (0 = torch's "
                   "default; pinned, the number of engine CPUs)")
@click.option("--pin/--no-pin", default=None,
              help="give the engine its own CPU(s) and everything else the rest (default: pin "
                   "when this process may use >= 2 CPUs)")
@click.option("--engine-cpus", default="",
              help="with --pin, the engine's CPU list, e.g. 0 or 0-1 (default: the first CPU "
                   "this process may use)")
@click.option("--rounds", default=3, show_default=True,
              help="rounds of in-process, gRPC and HTTP in turn; each path's figures are over "
                   "all its rounds")
@click.option("--grpc-client", type=click.Choice(["raw", "grpcio"]), default="raw",
              show_default=True,
              help="the load generator's gRPC client: raw (HTTP/2 read in a callback; "
                   "raw_grpc.py) or grpcio (grpc.aio, a wake-up of its threads and the call's "
                   "task per message, on the mesh's CPU)")
def main(model_path: str, warmup_requests: int, ttft_requests: int, saturation_requests: int,
         concurrency: int, in_flight: int, new_tokens: int, fixed_tokens: bool, engine_threads: int,
         pin: bool | None, engine_cpus: str, rounds: int, grpc_client: str) -> None:
    model_path = model_path or str(ensure_default_model())
    if pin is None:
        pin = len(os.sched_getaffinity(0)) >= 2
    plan = None
    if pin:
        try:
            plan = CpuPlan.split(engine_cpus)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    threads = engine_threads or (len(plan.engine) if plan else 0)
    sat = Saturation.build(saturation_requests, concurrency, new_tokens, fixed_tokens,
                           in_flight)
    if rounds < 1:
        raise click.UsageError("--rounds must be at least 1")
    if in_flight < 0:
        raise click.UsageError("--in-flight must be 0 (as many as --concurrency) or more")
    by_round, cpus = run_rounds(model_path, warmup_requests, ttft_requests, sat, threads, plan,
                                rounds, grpc_client)
    engine, grpc_r, http_r = (Result.merged(rs) for rs in by_round.values())
    with pin_process(plan.rest) if plan else contextlib.nullcontext():
        rest = plan.rest if plan else None
        floors = {"gRPC": grpc_message_floor_us(sat.concurrency, cpus=rest),
                  "HTTP": http_event_floor_us(sat.concurrency, cpus=rest)}
        own = own_cpu_us(sat.concurrency, tokens=128, runs=3)

    import torch

    print(f"\nmodel: {model_path}; {rounds} round(s) of in-process, gRPC and HTTP in turn, "
          f"each: TTFT at concurrency 1 ({ttft_requests} requests; {warmup_requests} warm-up "
          f"requests on each path first), throughput: {sat.describe()}; "
          f"engine threads {threads or torch.get_num_threads()}; " + (
              f"{os.cpu_count()} CPUs shared by every process" if plan is None else "pinned"))
    if plan is not None:
        print("\n".join(placement_lines(plan, cpus)))
    print()
    print(report([engine, grpc_r, http_r]))
    print(rounds_line(by_round))
    print(saturated_line([engine, grpc_r, http_r], sat.concurrency))
    print(fill_line([engine, grpc_r, http_r], sat.concurrency))
    print(batching_line([engine, grpc_r, http_r]))
    print(forward_line([engine, grpc_r, http_r]))
    print()
    for r, transport in ((grpc_r, "gRPC"), (http_r, "HTTP")):
        print(cpu_line(engine, r, transport))
    print(floor_line(floors, {"gRPC": grpc_r, "HTTP": http_r}, sat.concurrency, plan))
    print(own_work_line({"gRPC": own["grpc"], "HTTP": own["http"]}, floors,
                        {"gRPC": grpc_r, "HTTP": http_r}))
    if plan is not None:
        for r, transport in ((grpc_r, "gRPC"), (http_r, "HTTP")):
            print(pinned_line(engine, r, transport, plan))


if __name__ == "__main__":
    main()
