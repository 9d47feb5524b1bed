"""proc_cpu: CPU seconds of a process and its live descendants, read from /proc."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from meshlm.bench import proc_cpu

BURN = 0.3  # CPU seconds the busy child spends before it says "done"

# Burns BURN CPU seconds, prints "done", then blocks until its stdin closes (so it is still alive,
# and its CPU time readable, when the test reads "done").
BUSY = f"""
import sys, time
start = time.process_time()
while time.process_time() - start < {BURN}:
    pass
print("done", flush=True)
sys.stdin.read()
"""

# Runs BUSY as its own child, with the same stdin and stdout, and waits for it.
PARENT = f"""
import subprocess, sys
subprocess.run([sys.executable, "-c", {BUSY!r}], check=True)
"""


@contextmanager
def running(code: str) -> Iterator[subprocess.Popen[str]]:
    """A python child running `code`, stopped by closing its stdin."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def wait_done(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "done"


def test_cpu_seconds_grows_while_a_process_burns_cpu() -> None:
    with running(BUSY) as proc:
        before = proc_cpu.cpu_seconds(proc.pid)
        wait_done(proc)
        after = proc_cpu.cpu_seconds(proc.pid)
    assert after - before >= BURN - 0.1  # clock-tick granularity, and startup before `before`


def test_cpu_seconds_counts_live_descendants() -> None:
    with running(PARENT) as proc:
        wait_done(proc)  # the grandchild has burnt its CPU and still runs
        kids = proc_cpu.descendants(proc.pid)
        assert len(kids) == 1
        assert proc_cpu.own_cpu_seconds(kids[0]) >= BURN - 0.1
        assert proc_cpu.cpu_seconds(proc.pid) >= proc_cpu.own_cpu_seconds(proc.pid) + BURN - 0.1


def test_snapshot_and_delta_per_part() -> None:
    with running(BUSY) as proc:
        parts = {"busy": [proc.pid]}
        before = proc_cpu.snapshot(parts)
        wait_done(proc)
        spent = proc_cpu.cpu_delta(before, proc_cpu.snapshot(parts))
    assert set(spent) == {"busy"}
    assert spent["busy"] >= BURN - 0.1


# Burns BURN CPU seconds on a thread it names "burner" (its main thread idles), prints "done",
# then blocks until its stdin closes, the burner still alive (an ended thread's /proc entry is
# gone).
NAMED = f"""
import sys, threading, time
from meshlm.common.affinity import name_thread
closed = threading.Event()
def burn():
    name_thread("burner")
    start = time.thread_time()
    while time.thread_time() - start < {BURN}:
        pass
    print("done", flush=True)
    closed.wait()
threading.Thread(target=burn).start()
sys.stdin.read()
closed.set()
"""


def test_a_named_thread_group_is_counted_apart() -> None:
    with running(NAMED) as proc:
        before = proc_cpu.snapshot({"all": [proc.pid]}, {"burner": ([proc.pid], "burner")})
        wait_done(proc)
        spent = proc_cpu.cpu_delta(before, proc_cpu.snapshot(
            {"all": [proc.pid]}, {"burner": ([proc.pid], "burner"), "none": ([proc.pid], "x")}))
    assert spent["burner"] >= BURN - 0.1
    assert spent["all"] >= spent["burner"]
    assert spent["none"] == 0.0  # no thread of that name


def test_a_process_that_is_gone_counts_zero() -> None:
    with open("/proc/sys/kernel/pid_max") as f:
        no_such_pid = int(f.read())  # pids are below pid_max
    assert proc_cpu.cpu_seconds(no_such_pid) == 0.0
    assert proc_cpu.children(no_such_pid) == []
    assert proc_cpu.snapshot({"gone": [no_such_pid]}) == {"gone": 0.0}
    assert proc_cpu.named_threads_cpu_seconds(no_such_pid, "meshlm-engine") == 0.0
