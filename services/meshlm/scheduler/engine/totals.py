"""The policy's running totals (no torch), reported by stats() as `<name>_total`."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Totals:
    steps: int = 0  # forward passes whose results came back (tokens per step: batching)
    finished: int = 0  # every end: aborts and errors included
    aborted: int = 0
    preempted: int = 0
    retracted: int = 0  # sequences a "retract" pause moved back to the queue
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (first admissions)
    chunked_prefills: int = 0  # prompt chunks that did not finish their prompt

    def figures(self) -> dict[str, int]:
        return {f"{name}_total": value for name, value in asdict(self).items()}
