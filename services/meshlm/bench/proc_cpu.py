"""CPU time of running processes, read from /proc (Linux): how much CPU each mesh service spends.

    before = snapshot({"gateway": [pid]})
    ...  # the load
    spent = cpu_delta(before, snapshot({"gateway": [pid]}))  # {"gateway": seconds}

A process's CPU time here is utime + stime + cutime + cstime (fields 14-17 of /proc/<pid>/stat,
in clock ticks) of the process and of every live descendant: utime + stime cover all of a
process's threads, cutime + cstime the children it has already reaped (so a helper process that
ends mid-measurement is not lost once its parent waits for it). Live descendants are found via
/proc/<pid>/task/<tid>/children; a process that exits while being read counts as 0.

`named_threads_cpu_seconds` reads one thread group instead: the threads of a process with a
given OS name (`/proc/<pid>/task/<tid>/comm`), e.g. the scheduler's engine thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


def own_cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of one process (all its threads, its reaped children);
    0.0 if it is gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ")".
    fields = stat[stat.rindex(")") + 2:].split()
    # fields[0] is field 3 (state), so field n is fields[n - 3].
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return (utime + stime + cutime + cstime) / CLOCK_TICKS


def named_threads_cpu_seconds(pid: int, name: str) -> float:
    """utime + stime of the live threads of `pid` named `name`; 0.0 if there are none."""
    total = 0
    try:
        tasks = list((_PROC / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    for task in tasks:
        try:
            if (task / "comm").read_text().strip() != name:
                continue
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (of any of its threads); [] if it is gone."""
    found: list[int] = []
    try:
        tasks = list((_PROC / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return found
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, depth-first."""
    found: list[int] = []
    stack = children(pid)
    while stack:
        child = stack.pop()
        found.append(child)
        stack += children(child)
    return found


def cpu_seconds(pid: int) -> float:
    """CPU seconds used by `pid` and its descendants, live and reaped (see the module doc)."""
    return sum(own_cpu_seconds(p) for p in [pid, *descendants(pid)])


def snapshot(parts: Mapping[str, Sequence[int]],
             threads: Mapping[str, tuple[Sequence[int], str]] | None = None) -> dict[str, float]:
    """CPU seconds of each named part (the sum over its processes, e.g. a role's replicas),
    and of each named thread group: name -> (processes, the threads' OS name)."""
    spent = {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in parts.items()}
    for name, (pids, thread_name) in (threads or {}).items():
        spent[name] = sum(named_threads_cpu_seconds(pid, thread_name) for pid in pids)
    return spent


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds each part spent between two snapshots."""
    return {name: after[name] - before.get(name, 0.0) for name in after}
