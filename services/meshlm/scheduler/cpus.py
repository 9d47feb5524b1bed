"""Which cores the engine computes on, and with how many threads.

On the CPU the engine shares the machine with the rest of the mesh: the scheduler's own event
loop, the gateway, the tokenizer and the detokenizer. An OpenMP worker on a core another
service needs stalls every step (the others wait for it at each barrier); a core left idle is
lost. So, unless told (`--num-threads`, or `--engine-cpus`), the engine takes the share of the
cores its own work needs: it measures its CPU time per output token on this model and machine
(`measure_engine_us`: a few decode steps of a small batch, one thread), and the rest of the mesh
is taken to need `mesh_us` per output token (`make bench` measures it per service). With E and M
those costs and n usable cores, the engine runs round(n * E / (E + M)) threads, at least one:
on 2 cores the tiny default model (E ~ 200 us) leaves a core to the mesh, a 25M-parameter model
(E ~ 1.8 ms) takes both.

`--engine-cpus` pins instead: the engine thread (and its OpenMP workers, which inherit its
mask) runs on those CPUs, the scheduler's other threads on the remaining ones, and the engine
gets one thread per engine CPU.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshlm.common.logs import get_logger

if TYPE_CHECKING:
    from meshlm.scheduler.engine.engine import Engine

log = get_logger(__name__)

# CPU us per output token the rest of a mesh on the same machine spends (gateway over gRPC
# ~150, the scheduler's loop ~50, detokenizer ~25, tokenizer ~10), measured by `make bench`
# on 2 cores; `--mesh-cpu-us` overrides it.
DEFAULT_MESH_US = 250.0
CALIBRATION_ROWS = 16
CALIBRATION_STEPS = 4


def parse_cpu_list(text: str) -> frozenset[int]:
    """"0-1,3" -> {0, 1, 3}; ValueError on anything else."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (write it like 0-1,3)") from None
        if first < 0 or last < first:
            raise ValueError(f"not a CPU range: {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"empty CPU list: {text!r}")
    return frozenset(cpus)


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
    return max(1, min(math.floor(cores), round(share)))


def measure_engine_us(engine: Engine, rows: int = CALIBRATION_ROWS,
                      steps: int = CALIBRATION_STEPS) -> float:
    """CPU time per output token of decode steps over `rows` short sequences, on the calling
    thread (the engine's, with its current thread count). The requests are gone after."""
    from meshlm.scheduler.engine.engine import SamplingParams

    rows = max(1, min(rows, engine.config.max_running))
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 2, ignore_eos=True)
    for i in range(rows):  # distinct prompts: nothing shared through the prefix cache
        engine.add_request(f"meshlm-calibrate-{i}", [(i * 7 + j) % engine.vocab_size
                                                     for j in range(16)], params)
    engine.step()  # the prompts, and the first token
    start, cpu = time.perf_counter(), time.thread_time()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = max(time.perf_counter() - start, time.thread_time() - cpu)
    while engine.has_work():
        engine.step()
    return elapsed / max(1, tokens) * 1e6


@dataclass(frozen=True)
class CpuPlan:
    """The engine's threads and where they run (`engine_cpus` None: unpinned)."""

    threads: int
    engine_cpus: frozenset[int] | None = None
    other_cpus: frozenset[int] | None = None

    @staticmethod
    def pinned(engine_cpus: frozenset[int], num_threads: int = 0) -> CpuPlan:
        """The engine on `engine_cpus`, the process's other threads on the CPUs it may use
        beside them (none left: they share the engine's)."""
        allowed = frozenset(os.sched_getaffinity(0))
        missing = engine_cpus - allowed
        if missing:
            raise ValueError(f"engine CPUs {sorted(missing)} are not among the CPUs this "
                             f"process may use ({sorted(allowed)})")
        others = allowed - engine_cpus
        return CpuPlan(num_threads or len(engine_cpus), engine_cpus, others or None)

    def pin_process(self) -> None:
        """Move the process's existing threads to `other_cpus` (threads started later, from
        them, inherit it). Call before the engine thread starts."""
        if self.engine_cpus is None:
            return
        log.info("engine_cpus", engine=",".join(map(str, sorted(self.engine_cpus))),
                 others=",".join(map(str, sorted(self.other_cpus or self.engine_cpus))),
                 threads=self.threads)
        if self.other_cpus is None:
            return
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), self.other_cpus)
            except (ProcessLookupError, PermissionError):
                continue  # a thread gone since the listing

    def pin_engine_thread(self) -> None:
        """On the engine thread, first thing: move it to `engine_cpus`."""
        if self.engine_cpus is not None:
            os.sched_setaffinity(0, self.engine_cpus)  # 0: the calling thread


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
             rule="round(cores * engine_us / (engine_us + mesh_us))")
    return threads
