"""Handing freed heap back to the OS is safe to call at any time, from any thread."""

from __future__ import annotations

import threading

from meshlm.common.memory import release_memory


def test_release_memory_is_harmless_from_any_thread() -> None:
    big = bytearray(64 << 20)
    del big
    release_memory()
    worker = threading.Thread(target=release_memory)
    worker.start()
    worker.join()
    assert not worker.is_alive()
