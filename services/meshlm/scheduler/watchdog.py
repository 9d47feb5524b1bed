"""The engine watchdog: a scheduler whose engine stops making progress while it has work leaves
service within a bound, and its requests end UNAVAILABLE instead of waiting for ever.

`StallDetector` and `PauseClock.tick` are the rules, over timestamps only (unit-tested in
milliseconds); `EngineWatchdog` applies them on the event loop every CHECK_INTERVAL:

- **stalled**: one engine step (the forward pass on the engine thread) has run longer than the
  stall timeout (a hung device or kernel, a deadlock). The scheduler reports NOT_SERVING: every
  gateway's health Watch ends the requests routed here (UNAVAILABLE) and routes new ones
  elsewhere. Its live requests are forfeited and late arrivals refused (UNAVAILABLE), as nobody
  waits for them any more. When the step returns it reports SERVING and is used again.
  Bound: the stall timeout + CHECK_INTERVAL (+ the Watch's delivery).
- **frozen**: the whole process did not run for FREEZE_LIMIT (SIGSTOP, a paused VM): a thread
  of its own (`PauseClock`) ticked that late. Its peers' keepalive may have given up on it
  meanwhile (a ping unanswered for PING_TIMEOUT_MS, common/channels.py) and ended its requests
  there, so when it runs again it forfeits them all: none goes on generating for nobody. A
  blocked event loop alone is no freeze (the process answers pings, peers keep it).

A forfeited request is aborted in the engine and its final output is an UNAVAILABLE error: the
detokenizer frees its state, and a gateway that has not ended it yet ends it with that.

The stall timeout must exceed the longest legitimate step: a `--max-batched-tokens` prompt
chunk over a long context on a slow device under load (the embedded default model: under
0.5 s on one CPU thread, unloaded). A step that takes more than half of it is logged
(`slow_step`, each time the slowest so far) as a warning that the timeout is too tight. Steps
alone are timed: waiting for a paused engine, a weight load or a slow peer's backpressure is
not a stall.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from enum import Enum

from meshlm.common.channels import PING_TIMEOUT_MS
from meshlm.common.logs import get_logger

log = get_logger(__name__)

CHECK_INTERVAL = 0.25  # seconds between checks
DEFAULT_STALL_TIMEOUT = 4.0  # seconds; with CHECK_INTERVAL and the Watch, within DOWN_BOUND
FREEZE_LIMIT = PING_TIMEOUT_MS / 1000  # seconds not running after which peers may give up


class Verdict(Enum):
    STALLED = "stalled"  # a step runs past the timeout: out of service until it returns
    FROZEN = "frozen"  # the process did not run: its peers may have given up on it


class StallDetector:
    """When the engine counts as stalled or frozen, from the times of steps and checks."""

    def __init__(self, timeout: float, freeze_limit: float = FREEZE_LIMIT) -> None:
        self.timeout, self.freeze_limit = timeout, freeze_limit
        self.step_since: float | None = None  # when the step in flight started
        self.stalled = False

    def step_started(self, now: float) -> None:
        self.step_since = now

    def step_finished(self, now: float) -> tuple[float, bool]:
        """A step returned: (its duration, whether it ends a declared stall)."""
        took = now - self.step_since if self.step_since is not None else 0.0
        self.step_since = None
        recovered, self.stalled = self.stalled, False
        return took, recovered

    def check(self, now: float, paused: float = 0.0) -> Verdict | None:
        """Run every CHECK_INTERVAL, with the longest time the process did not run since the
        last check (`PauseClock.take`): what, if anything, the engine has just become."""
        if paused > self.freeze_limit:
            if self.step_since is not None:
                self.step_since = now  # the step did not run either: its clock restarts
            return Verdict.FROZEN
        if (not self.stalled and self.step_since is not None
                and now - self.step_since > self.timeout):
            self.stalled = True
            return Verdict.STALLED
        return None


class PauseClock:
    """A daemon thread that ticks every `interval`: ticks more than `limit` apart mean the whole
    process did not run meanwhile, not only its event loop (which this thread does not need).
    `take()` returns the longest such gap since the last take (0.0 if none)."""

    def __init__(self, interval: float = CHECK_INTERVAL, limit: float = FREEZE_LIMIT) -> None:
        self.interval, self.limit = interval, limit
        self._last: float | None = None
        self._paused = 0.0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, now: float) -> None:
        with self._lock:
            # The gap between ticks: at least the pause, at most the pause + one interval.
            if self._last is not None and now - self._last > self.limit:
                self._paused = max(self._paused, now - self._last)
            self._last = now

    def take(self) -> float:
        with self._lock:
            paused, self._paused = self._paused, 0.0
        return paused

    @property
    def pending(self) -> bool:
        """A pause not taken yet (a step that spanned it was not slow)."""
        return self._paused > 0

    def start(self) -> None:
        def run() -> None:
            self.tick(time.monotonic())
            while not self._stopped.wait(self.interval):  # the tick period
                self.tick(time.monotonic())

        self._thread = threading.Thread(target=run, name="pause-clock", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()


class EngineWatchdog:
    """The detector and the clock at work. `forfeit(reason)` gives up every live request and
    returns how many; `report(serving)` sets the scheduler's health (None: not served, as in
    tests). A timeout of 0 turns the watchdog off."""

    def __init__(self, timeout: float, forfeit: Callable[[str], int],
                 report: Callable[[bool], Awaitable[None]] | None = None,
                 interval: float = CHECK_INTERVAL) -> None:
        self.detector = StallDetector(timeout)
        self.clock = PauseClock(interval)
        self.forfeit = forfeit
        self.report = report
        self.interval = interval
        self.reason = ""  # why requests are refused while stalled
        self.slowest = 0.0  # seconds, the longest step so far (not spanning a pause)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def enabled(self) -> bool:
        return self.detector.timeout > 0

    @property
    def stalled(self) -> bool:
        return self.detector.stalled

    def step_started(self) -> None:
        if not self.enabled:
            return
        if self._task is None:  # from the first step on: before it, nothing can be lost
            self.clock.start()
            self._task = asyncio.create_task(self._run(), name="engine-watchdog")
        self.detector.step_started(time.monotonic())

    async def step_finished(self) -> None:
        if not self.enabled:
            return
        took, recovered = self.detector.step_finished(time.monotonic())
        if not recovered and not self.clock.pending and took > self.slowest:
            self.slowest = took
            if took > self.detector.timeout / 2:
                log.warning("slow_step", seconds=round(took, 3),
                            stall_timeout=self.detector.timeout)
        if recovered:
            log.warning("engine_recovered", step_seconds=round(took, 3))
            self.reason = ""
            await self._report(True)

    async def _run(self) -> None:
        while True:
            paused = self.clock.take()
            verdict = self.detector.check(time.monotonic(), paused)
            if verdict is Verdict.STALLED:
                self.reason = (f"the scheduler's engine stalled: a step has run for over "
                               f"{self.detector.timeout:g} s")
                forfeited = self.forfeit(self.reason)
                log.error("engine_stalled", stall_timeout=self.detector.timeout,
                          forfeited=forfeited)
                await self._report(False)
            elif verdict is Verdict.FROZEN:
                forfeited = self.forfeit(f"the scheduler did not run for {paused:.1f} s")
                log.error("process_frozen", seconds=round(paused, 3), forfeited=forfeited)
            await asyncio.sleep(self.interval)  # the check period, not synchronisation

    async def _report(self, serving: bool) -> None:
        if self.report is not None and not self._stopping:
            await self.report(serving)

    def stop(self) -> None:
        """The service is shutting down: health is no longer the watchdog's to set."""
        self._stopping = True

    def close(self) -> None:
        self.stop()
        self.clock.stop()
        if self._task is not None:
            self._task.cancel()
