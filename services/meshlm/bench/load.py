"""`make bench`'s load: its prompts and the saturation phase's requests, the same on every
path (in-process, the mesh over gRPC and over HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from meshlm.bench.workload import output_lengths

WORDS = "the river runs past a quiet town where lanterns glow in winter light".split()
SEED = 20240917
T = TypeVar("T")


def prompt(i: int, length: int) -> str:
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(length))


@dataclass(frozen=True)
class Saturation:
    """The saturation phase: `requests` (prompt, output tokens) run `concurrency` at a time
    (the engine's max_running). In-process every request is queued at once, so the running
    batch refills within the step that frees a slot; in the mesh the client keeps `in_flight`
    requests going, starting the next when one ends: as many as the slots (the default), each
    freed slot waits for the client's next request to cross the mesh; more, and the
    scheduler's own queue refills it, as the in-process engine's does."""

    requests: tuple[tuple[str, int], ...]
    concurrency: int
    in_flight: int

    @classmethod
    def build(cls, n: int, concurrency: int, mean_tokens: int, fixed: bool,
              in_flight: int = 0) -> Saturation:
        """`n` requests of 16-word prompts; output lengths exponential with `mean_tokens`
        (seeded, clipped to [1, 4 x mean]) or, `fixed`, all `mean_tokens`; `in_flight` 0:
        `concurrency`."""
        lengths = ([mean_tokens] * n if fixed
                   else output_lengths(n, mean_tokens, 1, 4 * mean_tokens, seed=SEED))
        return cls(tuple((prompt(i, 16), k) for i, k in enumerate(lengths)), concurrency,
                   in_flight or concurrency)

    @property
    def tokens(self) -> int:
        return sum(k for _, k in self.requests)

    def describe(self) -> str:
        kept = ("" if self.in_flight == self.concurrency
                else f", the mesh's client keeping {self.in_flight} in flight")
        return (f"{len(self.requests)} requests ({self.tokens} output tokens) at concurrency "
                f"{self.concurrency}{kept}")


async def limited(concurrency: int, calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run `calls` with at most `concurrency` in flight, in order; their results."""
    slots = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with slots:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))

