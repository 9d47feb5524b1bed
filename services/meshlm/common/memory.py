"""Handing freed heap back to the operating system (glibc's malloc_trim; elsewhere a no-op).

glibc keeps memory a process freed for reuse: after a big request (a 10 MB prompt, an
encoding's scratch space) the process would keep its peak for life.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None
    return trim  # type: ignore[no-any-return]


_TRIM = _malloc_trim()


def release_memory() -> None:
    """Give the heap's free pages back to the OS."""
    if _TRIM is not None:
        _TRIM(0)
