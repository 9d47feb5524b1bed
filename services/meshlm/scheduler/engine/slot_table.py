"""SlotTable: which of the KV cache's `max_running` slots are taken."""

from __future__ import annotations

import heapq


class SlotTable:
    """Hands out slot numbers 0..num_slots-1, lowest first (keeps the used part compact)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a min-heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        """Take the lowest free slot; raises RuntimeError when none is free."""
        if not self._free:
            raise RuntimeError("no free KV slot")
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back; raises RuntimeError if it is not in use (double free)."""
        if slot not in self._used:
            raise RuntimeError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)
