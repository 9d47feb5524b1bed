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

The load is load.py's, the in-process path in_process.py, the mesh's clients mesh_clients.py;
the report's lines come from mesh_report.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import TypeVar

import click
import grpc
import uvloop

from meshlm.bench.gateway_path import own_cpu_us
from meshlm.bench.in_process import InProcess
from meshlm.bench.load import Saturation
from meshlm.bench.mesh_clients import bench_grpc, bench_http, engine_totals
from meshlm.bench.mesh_report import (
    ENGINE_THREAD_PART,
    LOAD_GENERATOR_PART,
    SERVICES,
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
from meshlm.bench.proc_cpu import snapshot
from meshlm.bench.transport_floor import (
    grpc_message_floor_us,
    http_direct_event_floor_us,
    http_event_floor_us,
    native_direct_message_floor_us,
    native_grpc_message_floor_us,
)
from meshlm.common.default_model import ensure_default_model
from meshlm.common.memory import freeze_startup_objects
from meshlm.launch.mesh import Mesh, MeshOptions
from meshlm.scheduler.cpus import ENGINE_THREAD
from sglang.runtime.v1 import sglang_pb2_grpc

T = TypeVar("T")


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
        floors = {"gRPC": native_direct_message_floor_us(sat.concurrency, cpus=rest),
                  "HTTP": http_direct_event_floor_us(sat.concurrency, cpus=rest)}
        handler_floors = {"gRPC": native_grpc_message_floor_us(sat.concurrency, cpus=rest),
                          "HTTP": http_event_floor_us(sat.concurrency, cpus=rest)}
        grpcio_floor = grpc_message_floor_us(sat.concurrency, cpus=rest)
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
    print(floor_line(floors, {"gRPC": grpc_r, "HTTP": http_r}, sat.concurrency, plan,
                     handler_floors, grpcio_floor))
    print(own_work_line({"gRPC": own["grpc"], "HTTP": own["http"]}, floors,
                        {"gRPC": grpc_r, "HTTP": http_r}))
    if plan is not None:
        for r, transport in ((grpc_r, "gRPC"), (http_r, "HTTP")):
            print(pinned_line(engine, r, transport, plan))


if __name__ == "__main__":
    main()
