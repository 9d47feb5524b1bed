"""The engine watchdog: a scheduler whose engine stops making progress while it has work leaves
service within a bound, and its requests end UNAVAILABLE instead of waiting for ever.

`StallDetector` is the rule, over timestamps only (no clock, no I/O, unit-tested in
milliseconds); `EngineWatchdog` runs it on the event loop every CHECK_INTERVAL and acts on it:

- **stalled**: one engine step (the forward pass on the engine thread) has run longer than the
  stall timeout (a hung device or kernel, a deadlock). The scheduler reports NOT_SERVING: every
  gateway's health Watch ends the requests routed here (UNAVAILABLE) and routes new ones
  elsewhere. Its live requests are forfeited and new arrivals refused (UNAVAILABLE), as nobody
  waits for them any more. When the step returns it reports SERVING and is used again.
  Bound: the stall timeout + CHECK_INTERVAL.
- **frozen**: the event loop itself did not run for the stall timeout (SIGSTOP, a suspended VM,
  a blocked loop). Its peers' keepalive gave up on it meanwhile (within `DOWN_BOUND`,
  common/channels.py) and ended its requests, so when it runs again it forfeits them: none goes
  on generating for nobody.

A forfeited request is aborted in the engine and its final output is an UNAVAILABLE error: the
detokenizer frees its state, and a gateway that has not ended it yet ends it with that.

The stall timeout must exceed the longest legitimate step: a `--max-batched-tokens` prompt
chunk over a long context on a slow device under load (the embedded default model: under
0.5 s on one CPU thread). A step that takes more than half of it is logged (`slow_step`, each
time the slowest so far) as a warning that the timeout is too tight. Steps alone are timed:
waiting for a paused engine, a weight load or a slow peer's backpressure is not a stall.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from enum import Enum

from meshlm.common.logs import get_logger

log = get_logger(__name__)

CHECK_INTERVAL = 0.25  # seconds between checks
DEFAULT_STALL_TIMEOUT = 4.0  # seconds; with CHECK_INTERVAL and the Watch, within DOWN_BOUND


class Verdict(Enum):
    STALLED = "stalled"  # a step runs past the timeout: out of service until it returns
    FROZEN = "frozen"  # the process did not run for the timeout: peers gave up on it


class StallDetector:
    """When the engine counts as stalled or frozen, from the times of steps and checks."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.step_since: float | None = None  # when the step in flight started
        self.stalled = False
        self.slowest = 0.0  # seconds, the longest step so far
        self.gap = 0.0  # seconds between the last two checks
        self._last_check: float | None = None

    def step_started(self, now: float) -> None:
        self.step_since = now

    def step_finished(self, now: float) -> tuple[float, bool]:
        """A step returned: (its duration, whether it ends a declared stall)."""
        took = now - self.step_since if self.step_since is not None else 0.0
        self.step_since = None
        self.slowest = max(self.slowest, took)
        recovered, self.stalled = self.stalled, False
        return took, recovered

    def check(self, now: float) -> Verdict | None:
        """Run every CHECK_INTERVAL: what, if anything, the engine has just become."""
        last, self._last_check = self._last_check, now
        self.gap = now - last if last is not None else 0.0
        if self.gap > self.timeout:
            if self.step_since is not None:
                self.step_since = now  # the step did not run either: its clock restarts
            return Verdict.FROZEN
        if (not self.stalled and self.step_since is not None
                and now - self.step_since > self.timeout):
            self.stalled = True
            return Verdict.STALLED
        return None


class EngineWatchdog:
    """`StallDetector` on the event loop. `forfeit(reason)` gives up every live request and
    returns how many; `report(serving)` sets the scheduler's health (None: not served yet, as
    in tests). A timeout of 0 turns the watchdog off."""

    def __init__(self, timeout: float, forfeit: Callable[[str], int],
                 report: Callable[[bool], Awaitable[None]] | None = None,
                 interval: float = CHECK_INTERVAL) -> None:
        self.detector = StallDetector(timeout)
        self.forfeit = forfeit
        self.report = report
        self.interval = interval
        self.reason = ""  # why requests are refused while stalled
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
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-watchdog")
        self.detector.step_started(time.monotonic())

    async def step_finished(self) -> None:
        if not self.enabled:
            return
        slowest = self.detector.slowest
        took, recovered = self.detector.step_finished(time.monotonic())
        if took > self.detector.timeout / 2 and took > slowest and not recovered:
            log.warning("slow_step", seconds=round(took, 3), stall_timeout=self.detector.timeout)
        if recovered:
            log.warning("engine_recovered", step_seconds=round(took, 3))
            self.reason = ""
            await self._report(True)

    async def _run(self) -> None:
        while True:
            verdict = self.detector.check(time.monotonic())
            if verdict is Verdict.STALLED:
                self.reason = (f"the scheduler's engine stalled: a step has run for over "
                               f"{self.detector.timeout:g} s")
                forfeited = self.forfeit(self.reason)
                log.error("engine_stalled", stall_timeout=self.detector.timeout,
                          forfeited=forfeited)
                await self._report(False)
            elif verdict is Verdict.FROZEN:
                frozen = self.detector.gap
                forfeited = self.forfeit(f"the scheduler did not run for {frozen:.1f} s")
                log.error("process_frozen", seconds=round(frozen, 3), forfeited=forfeited)
            await asyncio.sleep(self.interval)  # the check period, not synchronisation

    async def _report(self, serving: bool) -> None:
        if self.report is not None and not self._stopping:
            await self.report(serving)

    def stop(self) -> None:
        """The service is shutting down: health is no longer the watchdog's to set."""
        self._stopping = True

    def close(self) -> None:
        self.stop()
        if self._task is not None:
            self._task.cancel()
