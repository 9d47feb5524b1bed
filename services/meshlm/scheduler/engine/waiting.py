"""The engine's waiting queue: the order in which waiting sequences are admitted.

A larger `Sequence.priority` goes first (SGLang's default order; its
--schedule-low-priority-values-first has no counterpart here), then first come, first served.
A sequence put back (preempted, retracted, or a follower whose leader's prompt is computed)
goes first in line among its priority: it was admitted before the others of its rank arrived,
or belongs with a request that was. With one priority for all, this is a plain FIFO deque.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from meshlm.scheduler.engine.sequence import Sequence


class WaitingQueue:
    """Sequences waiting for a running slot, in admission order (see the module docstring).
    Inserting scans from the end it joins, so with equal priorities it costs O(1)."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        """A new arrival: last among the sequences of its priority."""
        behind = 0  # sequences of lower priority, at the back
        for other in reversed(self._queue):
            if other.priority >= seq.priority:
                break
            behind += 1
        self._queue.insert(len(self._queue) - behind, seq)

    def push_front(self, *seqs: Sequence) -> None:
        """Put back: `seqs` first among their priority, in their order."""
        for seq in reversed(seqs):
            ahead = 0  # sequences of higher priority, at the front
            for other in self._queue:
                if other.priority <= seq.priority:
                    break
                ahead += 1
            self._queue.insert(ahead, seq)

    def popleft(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def __getitem__(self, index: int) -> Sequence:
        return self._queue[index]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)
