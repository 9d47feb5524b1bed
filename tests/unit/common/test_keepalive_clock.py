"""The native connections' keepalive (`native_grpc.flow.Keepalive`) on a loop whose clock does not
move between a PING and its answer, as uvloop's (read once a loop turn, to the millisecond): an
answer in the same tick keeps the connection, silence still ends it after the timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshlm.common.native_grpc import frames as h2
from meshlm.common.native_grpc.flow import Keepalive

IDLE, TIMEOUT = 1.0, 2.0


class FrozenLoop:
    """A loop stand-in: `time()` moves only when the test says; timers run when it does."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Any:
        entry = (self.now + delay, callback)
        self.timers.append(entry)

        class Handle:
            def cancel(_self) -> None:  # noqa: N805 - a handle of this loop
                if entry in self.timers:
                    self.timers.remove(entry)
        return Handle()

    def advance(self, seconds: float) -> None:
        """Move the clock, running each timer due on the way at its own time."""
        end = self.now + seconds
        while (due := [t for t in self.timers if t[0] <= end]):
            entry = min(due, key=lambda t: t[0])
            self.timers.remove(entry)
            self.now = entry[0]
            entry[1]()
        self.now = end


class Frames:
    """What the keepalive writes; `on_ping` runs when it sends a PING (the peer's answer)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.on_ping: Callable[[], None] = lambda: None

    def queue(self, data: bytes) -> None:
        self.sent.append(data)
        if data[3] == h2.PING:
            self.on_ping()


def pings(frames: Frames) -> int:
    return sum(1 for f in frames.sent if f[3] == h2.PING)


def keepalive() -> tuple[FrozenLoop, Frames, list[float], Keepalive]:
    loop, frames, expired = FrozenLoop(), Frames(), []
    ka = Keepalive(loop, IDLE, TIMEOUT, frames, expired.append)  # type: ignore[arg-type]
    return loop, frames, expired, ka


def test_an_answer_in_the_same_clock_tick_as_the_ping_keeps_the_connection() -> None:
    loop, frames, expired, ka = keepalive()
    frames.on_ping = ka.heard  # the ACK is read before the clock moves
    loop.advance(20 * (IDLE + TIMEOUT))
    assert pings(frames) >= 5
    assert expired == []


def test_a_peer_that_answers_nothing_is_expired_after_the_timeout() -> None:
    loop, frames, expired, ka = keepalive()
    loop.advance(IDLE)
    assert pings(frames) == 1
    loop.advance(TIMEOUT - 0.01)
    assert expired == []
    loop.advance(0.02)
    assert len(expired) == 1 and expired[0] >= TIMEOUT


def test_bytes_before_the_ping_do_not_answer_it() -> None:
    loop, frames, expired, ka = keepalive()
    loop.advance(IDLE - 0.5)
    ka.heard()  # traffic, then silence: the PING after it must be answered on its own
    loop.advance(IDLE)
    assert pings(frames) == 1
    loop.advance(TIMEOUT)
    assert len(expired) == 1


def test_a_busy_peer_is_not_pinged() -> None:
    loop, frames, expired, ka = keepalive()
    for _ in range(50):
        loop.advance(IDLE / 4)
        ka.heard()
    assert pings(frames) == 0 and expired == []
