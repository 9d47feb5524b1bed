"""Reclaiming a big request's memory: a collection soon after a big request (one at a time),
none after small ones; malloc_trim at most once per interval."""

from __future__ import annotations

import asyncio

from meshlm.gateway.reclaim import Reclaimer, release_memory


async def _settle(reclaim: Reclaimer) -> None:
    await asyncio.sleep(reclaim.delay * 3)


async def test_a_big_request_is_followed_by_one_collection() -> None:
    reclaim = Reclaimer(big_bytes=1000, delay=0.01)
    reclaim.after(999)
    await _settle(reclaim)
    assert reclaim.collections == 0
    for _ in range(5):  # several at once: one collection
        reclaim.after(1000)
    await _settle(reclaim)
    assert reclaim.collections == 1
    reclaim.after(10**7)
    await _settle(reclaim)
    assert reclaim.collections == 2


async def test_a_cycle_holding_a_big_payload_is_freed() -> None:
    import gc
    import weakref

    class Holder:
        pass

    a, b = Holder(), Holder()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    a.payload = bytearray(10**6)  # type: ignore[attr-defined]
    alive = weakref.ref(a)
    del a, b
    gc.disable()
    try:
        reclaim = Reclaimer(big_bytes=1, delay=0.01)
        reclaim.after(10**6)
        await _settle(reclaim)
        assert alive() is None
    finally:
        gc.enable()


async def test_trims_are_spaced_out() -> None:
    reclaim = Reclaimer(big_bytes=1, delay=0.01, trim_interval=0.2)
    reclaim.after(1)
    await _settle(reclaim)
    assert (reclaim.collections, reclaim.trims) == (1, 1)  # the first at once
    reclaim.after(1)
    await _settle(reclaim)
    assert (reclaim.collections, reclaim.trims) == (2, 1)  # the next one waits its turn
    await asyncio.sleep(0.2)
    assert reclaim.trims == 2


def test_release_memory_is_harmless() -> None:
    release_memory()
