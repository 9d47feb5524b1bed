"""Where the engine's forward passes run: on the engine thread, or on the event loop itself.

On the engine thread a step computes while the event loop sends the previous step's outputs
and takes in new requests: worth it wherever the two can run at once (two CPUs or more, or a
GPU doing the step's work). On one CPU without a GPU they only take turns, and every turn
costs thread switches and GIL hand-overs inside the step's torch calls. There (`choose`,
"auto") the loop runs the forward pass itself, between its other work. Measured on the
bench's pinned mesh (the scheduler alone on one CPU, the tiny model, 64 streams): 12.8 k
against 13.4 k output tok/s, scheduler CPU 77.7 against 74.5 µs per token, 3 alternated runs.

While a step runs on the loop nothing else in the service runs: health checks, new requests,
aborts and the watchdog's clock wait for it. So only a step expected to be short runs there
(`StepPlacement.on_loop`): its tokens, at the recent cost per token, within MAX_LOOP_STEP_S.
A long prompt's chunk still goes to the engine thread, and so does every step while a torch
trace records (the profiler records only the thread it started on, the engine's).
"""

from __future__ import annotations

from collections.abc import Callable

MODES = ("auto", "thread", "loop")
MAX_LOOP_STEP_S = 0.02  # the longest step the event loop waits out
COST_WEIGHT = 0.25  # weight of the newest step in the running cost per token


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"--engine-steps must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def choose(mode: str, device: str, cpus: float, threads: int) -> tuple[bool, str]:
    """Whether steps may run on the event loop (`mode` "auto" decides from the device, the
    cores this service may use and the engine's torch threads), and why."""
    if check_mode(mode) != "auto":
        return mode == "loop", f"--engine-steps {mode}"
    if device != "cpu":
        return False, f"the steps run on {device}"
    if cpus > 1:
        return False, f"{cpus:g} CPUs: the event loop and the engine run at once"
    if threads > 1:
        return False, f"{threads} torch threads"
    return True, "one CPU, no GPU, one torch thread: a thread would only take turns"


class StepPlacement:
    """Decides, step by step, whether the event loop runs the forward pass itself."""

    def __init__(self, allowed: bool = False, held: Callable[[], bool] = lambda: False,
                 max_seconds: float = MAX_LOOP_STEP_S) -> None:
        self.allowed = allowed
        self.held = held  # true while steps must stay on the engine thread (a torch trace)
        self.max_seconds = max_seconds
        self.seconds_per_token: float | None = None  # unknown until a step has run

    def on_loop(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` runs on the event loop."""
        cost = self.seconds_per_token
        return (self.allowed and cost is not None and cost * num_tokens <= self.max_seconds
                and not self.held())

    def observe(self, seconds: float, num_tokens: int) -> None:
        """A step of `num_tokens` took `seconds` (wherever it ran)."""
        cost = seconds / max(1, num_tokens)
        previous = self.seconds_per_token
        self.seconds_per_token = (cost if previous is None
                                  else previous + COST_WEIGHT * (cost - previous))
