"""CPU lists ("0-1,3", the kernel's format), moving every thread of a process to a set of
CPUs, and naming a thread for the OS. Affinity is per thread on Linux: os.sched_setaffinity(0,
...) moves only the calling thread, so `set_affinity` moves each of a process's threads;
threads and children started later inherit the mask (and the OS name) of the thread that
starts them."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable
from pathlib import Path


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


def format_cpus(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def thread_ids(pid: int = 0) -> list[int]:
    """The thread ids of a process (0 = this one)."""
    return [int(t.name) for t in Path(f"/proc/{pid or 'self'}/task").iterdir()]


def set_affinity(cpus: Iterable[int], pid: int = 0) -> None:
    """Move every thread of process `pid` (0 = this one) onto `cpus`; no-op if it is gone."""
    cpus = set(cpus)
    try:
        tids = thread_ids(pid)
    except FileNotFoundError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # the thread ended


def name_thread(name: str) -> None:
    """Give the calling thread an OS name (its /proc comm, at most 15 bytes: what `top -H`, `ps
    -L` and the bench's per-thread CPU figures show); threads it starts later inherit it. Does
    nothing off Linux."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_name = 15
    ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
