"""Reclaiming a big request's memory: a collection soon after a big request (one at a time),
none after small ones; malloc_trim at most once per interval."""

from __future__ import annotations

from meshlm.gateway.front.reclaim import Reclaimer


async def test_a_big_request_is_followed_by_one_collection() -> None:
    reclaim = Reclaimer(big_bytes=1000, delay=0.01, trim_interval=60)
    reclaim.after(999)
    assert not reclaim.scheduled  # small: nothing to do
    for _ in range(5):  # several at once: one collection
        reclaim.after(1000)
    await reclaim.reached(collections=1, trims=1)
    assert reclaim.collections == 1 and not reclaim.scheduled
    reclaim.after(10**7)
    await reclaim.reached(collections=2)
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
        await reclaim.reached(collections=1)
        assert alive() is None
    finally:
        gc.enable()


async def test_trims_are_spaced_out() -> None:
    reclaim = Reclaimer(big_bytes=1, delay=0.01, trim_interval=60)
    reclaim.after(1)
    await reclaim.reached(collections=1, trims=1)  # the first trim at once
    reclaim.after(1)
    await reclaim.reached(collections=2)
    assert reclaim.trims == 1  # the next one waits its turn, a whole interval after the first
    due = reclaim.trim_due()
    assert due is not None and due >= reclaim.trimmed_at[0] + 60


async def test_a_waiting_trim_runs_once_its_interval_has_passed() -> None:
    reclaim = Reclaimer(big_bytes=1, delay=0.01, trim_interval=0.05)
    reclaim.after(1)
    await reclaim.reached(collections=1, trims=1)
    reclaim.after(1)
    await reclaim.reached(collections=2, trims=2)
    first, second = reclaim.trimmed_at
    assert second - first >= 0.05
