"""Handing freed heap back to the OS is safe to call at any time, from any thread; freezing the
start-up's objects leaves later garbage collectable."""

from __future__ import annotations

import gc
import threading
import weakref

from meshlm.common.memory import freeze_startup_objects, release_memory


def test_release_memory_is_harmless_from_any_thread() -> None:
    big = bytearray(64 << 20)
    del big
    release_memory()
    worker = threading.Thread(target=release_memory)
    worker.start()
    worker.join()
    assert not worker.is_alive()


class Node:
    """An object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def test_startup_objects_leave_the_collector_but_new_cycles_are_still_collected() -> None:
    old = Node()
    gc.collect()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        assert not any(o is old for o in gc.get_objects())  # frozen: no collection walks it
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after start-up
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
    assert any(o is old for o in gc.get_objects())
