"""The process's heap (glibc's malloc; elsewhere both calls do nothing): handing freed memory
back to the operating system, or keeping it mapped for the next use.

glibc keeps memory a process freed for reuse: after a big request (a 10 MB prompt, an
encoding's scratch space) the process would keep its peak for life, so the gateway and the
tokenizer trim after one (`release_memory`).

The CPU engine wants the opposite (`retain_freed_memory`). torch has no caching allocator on
the CPU: every step's temporaries (gathered keys and values, activations, scores) are malloc'd
and freed. glibc serves blocks above its mmap threshold with fresh mmaps and trims the heap top
above its trim threshold, so each step's megabytes came back as new zero pages: ~100k page
faults in 9 s of serving the bench checkpoint at 16 streams, and a KV gather 4-20x slower
whenever the host was slow to fault. Raising both thresholds, as a caching allocator would,
keeps those pages mapped; resident memory then stays at the peak step's temporaries.

Python's own collector (`freeze_startup_objects`): every service makes hundreds of thousands of
objects while it starts (torch modules, protobuf descriptors, grpc, the tokenizer) that live as
long as the process. A full collection walks them all: in the scheduler on the tiny model, about
160 ms with the engine stopped, twice in 12 s at saturation. Frozen once started, they are left
out of every collection, which then walks only what requests made (1.4 ms for three).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from typing import Any

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
RETAIN = ((M_MMAP_THRESHOLD, 32 << 20),  # glibc's largest allowed value (HEAP_MAX_SIZE / 2)
          (M_TRIM_THRESHOLD, 512 << 20), (M_TOP_PAD, 16 << 20))


def _libc(function: str) -> Any:
    """glibc's `function`, or None where there is none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None


_TRIM = _libc("malloc_trim")


def release_memory() -> None:
    """Give the heap's free pages back to the OS."""
    if _TRIM is not None:
        _TRIM(0)


@functools.cache
def retain_freed_memory() -> bool:
    """Reuse freed blocks under 32 MiB instead of unmapping them, for this whole process (set
    once); False where there is no glibc `mallopt` or it refuses."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in RETAIN)


def freeze_startup_objects() -> None:
    """Collect once, then move every object made so far out of the collector's reach (a
    service calls this when it has started: those objects live as long as the process; later
    collections walk only newer ones). Reference counting still frees a frozen object."""
    gc.collect()
    gc.freeze()
