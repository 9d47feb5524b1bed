"""Which CPUs the bench's parts run on: CPU list strings, and pinning a whole process.

`make bench --pin` gives the engine its own CPU(s) and everything else the rest, so that the
mesh and the in-process engine are compared with the engine's cores equal and not shared.
CPU lists and moving a process's threads: `meshlm.common.affinity`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from meshlm.bench.proc_cpu import descendants
from meshlm.common.affinity import format_cpus, parse_cpu_list, set_affinity, thread_ids


def describe(cpus: Iterable[int]) -> str:
    """"CPU 0" or "CPUs 1-3"."""
    cpus = set(cpus)
    return f"CPU{'s' if len(cpus) > 1 else ''} {format_cpus(cpus)}"


@dataclass(frozen=True)
class CpuPlan:
    """The engine's CPUs and everybody else's (disjoint)."""

    engine: frozenset[int]
    rest: frozenset[int]

    @classmethod
    def split(cls, engine_cpus: str = "") -> CpuPlan:
        """The engine gets `engine_cpus` ("" = the first CPU this process may use), the rest
        gets what is left of this process's affinity; ValueError if either would be empty or
        the engine's CPUs are not allowed here."""
        allowed = os.sched_getaffinity(0)
        engine = set(parse_cpu_list(engine_cpus)) if engine_cpus else {min(allowed)}
        if not engine <= allowed:
            raise ValueError(f"engine CPUs {format_cpus(engine)} are not all in this "
                             f"process's affinity {format_cpus(allowed)}")
        rest = allowed - engine
        if not rest:
            raise ValueError(f"no CPUs left besides the engine's {format_cpus(engine)}")
        return cls(frozenset(engine), frozenset(rest))


def set_tree_affinity(cpus: Iterable[int], pid: int) -> None:
    """Move every thread of process `pid` and of its live descendants onto `cpus`."""
    for p in [pid, *descendants(pid)]:
        set_affinity(cpus, p)


@contextmanager
def pin_process(cpus: Iterable[int]) -> Iterator[None]:
    """Run the block with every thread of this process on `cpus`; afterwards every thread
    (also those started inside) goes back to this thread's mask from before."""
    before = os.sched_getaffinity(0)
    set_affinity(cpus)
    try:
        yield
    finally:
        set_affinity(before)


def thread_cpus(pid: int) -> Counter[str]:
    """How many of a process's threads may run on each CPU list, e.g. {"1": 12, "0": 1}."""
    seen: Counter[str] = Counter()
    try:
        tids = thread_ids(pid)
    except FileNotFoundError:
        return seen  # it is gone
    for tid in tids:
        try:
            seen[format_cpus(os.sched_getaffinity(tid))] += 1
        except ProcessLookupError:
            continue
    return seen
