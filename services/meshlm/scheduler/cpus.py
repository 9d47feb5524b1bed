"""Which cores the engine computes on, and with how many threads.

On the CPU the engine shares the machine with the rest of the mesh: the scheduler's own event
loop, the gateway, the tokenizer and the detokenizer. An OpenMP worker on a core another
service needs stalls every step (the others wait for it at each barrier); a core left idle is
lost. So, unless told (`--num-threads`, or `--engine-cpus`), the engine takes the share of the
cores its own work needs: it measures its CPU time per output token on this model and machine
(`measure_engine_us`: a few decode steps of a small batch, one thread), and the rest of the mesh
is taken to need `mesh_us` per output token (`make bench` measures it per service). With E and M
those costs and n usable cores, the engine's share is s = n * E / (E + M) cores, and it runs
ceil(s - SHARE_SLACK) threads, at least one: on 2 cores the tiny default model (E ~ 200 us,
s = 0.9) leaves a core to the mesh, the 25M-parameter bench model (E ~ 730 us, s = 1.5) takes
both.

`--engine-cpus` pins instead: the whole service (the engine thread, its OpenMP workers, the
event loop) runs on those CPUs, and the engine gets one thread per CPU.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshlm.common.affinity import format_cpus, set_affinity
from meshlm.common.logs import get_logger

if TYPE_CHECKING:
    from meshlm.scheduler.engine.engine import Engine

log = get_logger(__name__)

# CPU us per output token the rest of a mesh on the same machine spends (gateway over gRPC
# ~150, the scheduler's loop ~50, detokenizer ~25, tokenizer ~10), measured by `make bench`
# on 2 cores; `--mesh-cpu-us` overrides it.
DEFAULT_MESH_US = 250.0
# The OS name of the engine thread (and of the OpenMP workers it starts), apart from the event
# loop's and gRPC's threads in `top -H` and in `make bench`'s CPU figures.
ENGINE_THREAD = "meshlm-engine"
CALIBRATION_ROWS = 16
# How far a share of the cores may pass a whole number of threads before the engine takes one
# more: a margin for the calibration, which reads high on a busy machine. Measured on 2 cores
# at 16 streams, two threads against one: the bench model (s = 1.49) 561-576 against 407-418
# tok/s, on bfloat16 weights (s = 1.16) 1026-1106 against 834-916; the tiny default model
# (s = 0.9) does better on one.
SHARE_SLACK = 0.1
CALIBRATION_STEPS = 4


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> float:
    """Cores this process may use: its affinity mask, lowered by a cgroup v2 CPU quota (a
    container's `cpus:` limit) when there is one."""
    cores = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = cgroup.read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return min(cores, int(quota) / int(period))


def choose_threads(cores: float, engine_us: float, mesh_us: float) -> int:
    """The engine's threads: its share of `cores` at these costs per output token, >= 1."""
    if engine_us <= 0:
        return max(1, math.floor(cores))
    share = cores * engine_us / (engine_us + max(0.0, mesh_us))
    return max(1, min(math.floor(cores), math.ceil(share - SHARE_SLACK)))


def measure_engine_us(engine: Engine, rows: int = CALIBRATION_ROWS,
                      steps: int = CALIBRATION_STEPS) -> float:
    """CPU time per output token of decode steps over `rows` short sequences, on the calling
    thread (the engine's, run with one torch thread). The requests are gone after."""
    from meshlm.scheduler.engine.engine import SamplingParams

    rows = max(1, min(rows, engine.config.max_running))
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 2, ignore_eos=True)
    for i in range(rows):  # distinct prompts: nothing shared through the prefix cache
        engine.add_request(f"meshlm-calibrate-{i}", [(i * 7 + j) % engine.vocab_size
                                                     for j in range(16)], params)
    engine.step()  # the prompts, and the first token
    # The calling thread's CPU time, not the wall clock: one torch thread works on the calling
    # thread, and a machine busy with other work must not make the engine look costlier (and
    # so take more threads).
    cpu = time.thread_time()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.thread_time() - cpu
    while engine.has_work():
        engine.step()
    return elapsed / max(1, tokens) * 1e6


@dataclass(frozen=True)
class EngineCpus:
    """The engine's threads (0: measure and choose) and the CPUs the service runs on (None:
    not pinned)."""

    threads: int
    cpus: frozenset[int] | None = None

    @staticmethod
    def pinned(cpus: frozenset[int], num_threads: int = 0) -> EngineCpus:
        """The whole service on `cpus` (which may lie outside the mask it was started with,
        within its cgroup's), one engine thread per CPU unless `num_threads`."""
        return EngineCpus(num_threads or len(cpus), cpus)

    def pin_process(self) -> None:
        """Move every thread of the process to `cpus`; threads started later (the engine's,
        its OpenMP workers, gRPC's) inherit it. Call before the engine thread starts.

        The event loop stays with the engine rather than on the CPUs the rest of the mesh
        uses: each step waits for it (fold the results back, plan the next), and on a CPU
        the other services keep busy it comes late (measured on 2 cores, the tiny model:
        ~0.45 of in-process throughput with the loop beside the other services, ~0.6 with
        it beside the engine)."""
        if self.cpus is None:
            return
        try:
            set_affinity(self.cpus)
        except OSError as e:
            raise ValueError(f"cannot run on CPUs {format_cpus(self.cpus)} (--engine-cpus): "
                             f"{e.strerror}; this machine allows "
                             f"{format_cpus(os.sched_getaffinity(0))}") from None
        log.info("engine_cpus", cpus=format_cpus(self.cpus), threads=self.threads)


def auto_threads(engine: Engine, mesh_us: float, cores: float | None = None) -> int:
    """On the engine thread: measure the engine at one thread, choose and set its threads,
    and log the choice and what it rests on."""
    import torch

    cores = usable_cpus() if cores is None else cores
    torch.set_num_threads(1)
    engine_us = measure_engine_us(engine)
    threads = choose_threads(cores, engine_us, mesh_us)
    torch.set_num_threads(threads)
    log.info("engine_threads", threads=threads, cores=round(cores, 2),
             engine_us_per_token=round(engine_us), mesh_us_per_token=round(mesh_us),
             rule=f"ceil(cores * engine_us / (engine_us + mesh_us) - {SHARE_SLACK}), at least 1")
    return threads
