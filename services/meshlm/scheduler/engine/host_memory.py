"""Keep the memory a CPU engine step frees for the next step (glibc malloc), instead of handing
it back to the kernel and faulting it in again.

torch has no caching allocator on the CPU: every step's temporaries (the gathered keys and
values, activations, scores) are malloc'd and freed. glibc serves blocks above its mmap
threshold with fresh mmaps and trims the heap top above its trim threshold, so each step's
megabytes come back as new zero pages: on the bench checkpoint at 16 streams that was ~100k
page faults in 9 s of serving, and a 4-20x slower KV gather whenever the host was slow to
fault. Raising both thresholds (as a caching allocator would) keeps those pages mapped; the
process's resident memory then stays at its peak step's temporaries, which `trim_threshold`
bounds beyond.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 512 << 20
TOP_PAD = 16 << 20


@functools.cache
def retain_freed_memory() -> bool:
    """Set glibc's malloc to reuse freed blocks below 32 MiB instead of unmapping them, once
    per process; False where there is no glibc `mallopt` (musl, macOS) or it refuses."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                (M_TOP_PAD, TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)
