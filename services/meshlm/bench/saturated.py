"""Throughput while every slot is busy: the saturation phase without its ramp and its drain.

A saturation phase (N requests kept C in flight) starts by filling its C slots and ends with
a drain: once the last request has started, the batch empties as requests finish, down to
one row, and steps of a few rows cost each path its fixed per-step work over very few tokens.
`Arrivals` records when each request's first tokens came and when every later token came
(in-process: after each engine step; in the mesh: as the client reads each message) and
`window` counts the tokens that came between the C-th request's first token (every slot has
been filled) and the last request's first token (the last slot refilled): the same events on
every path, so the window's throughputs compare as the whole phases' do.
"""

from __future__ import annotations


class Arrivals:
    def __init__(self) -> None:
        self.firsts: list[float] = []  # when each request's first token came
        self.tokens: list[tuple[float, int]] = []  # (when, how many tokens came then)

    def first(self, when: float) -> None:
        self.firsts.append(when)

    def add(self, when: float, tokens: int) -> None:
        self.tokens.append((when, tokens))

    def window(self, concurrency: int) -> tuple[int, float]:
        """(tokens, seconds) from the `concurrency`-th first token to the last; (0, 0.0) when
        no request waited for a slot (nothing to measure)."""
        firsts = sorted(self.firsts)
        if len(firsts) <= concurrency:
            return 0, 0.0
        start, end = firsts[concurrency - 1], firsts[-1]
        return sum(n for when, n in self.tokens if start < when <= end), end - start

    def fill_seconds(self, concurrency: int, start: float) -> float:
        """Seconds from the phase's `start` to the `concurrency`-th request's first token (to
        the last's, where fewer came): how long filling every slot took."""
        firsts = sorted(self.firsts)
        return firsts[min(concurrency, len(firsts)) - 1] - start if firsts else 0.0
