"""CPU lists and moving every thread of a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshlm.common.affinity import format_cpus, parse_cpu_list


@pytest.mark.parametrize(("text", "cpus"), [
    ("0", {0}), ("0-1", {0, 1}), ("0,2-3", {0, 2, 3}), ("3, 1", {1, 3}), ("2-2", {2}),
])
def test_cpu_lists_parse(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", ",", "3-1", "a", "-1", "0-x"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(text)


def test_cpu_lists_format() -> None:
    assert format_cpus({5, 0, 1, 2}) == "0-2,5"
    assert format_cpus([3]) == "3"


CHILD = """
import os, threading
from meshlm.common.affinity import set_affinity
target = {min(os.sched_getaffinity(0))}
started = threading.Event(); stop = threading.Event(); seen = {}
def before():
    started.set(); stop.wait(); seen["before"] = os.sched_getaffinity(0)
t = threading.Thread(target=before); t.start(); started.wait()
set_affinity(target)
def after():
    seen["after"] = os.sched_getaffinity(0)
u = threading.Thread(target=after); u.start(); u.join()
stop.set(); t.join()
print(seen["before"] == seen["after"] == os.sched_getaffinity(0) == target)
"""


def test_set_affinity_moves_every_thread_and_later_ones_inherit() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "True"
    assert len(os.sched_getaffinity(0)) >= 1
