"""The engine benchmark's pure parts: the seeded workload, KV waste and summary statistics.

One workload drives every system: prompts of natural text (runs of the default model's corpus)
whose token lengths are drawn uniformly, and output lengths drawn from an exponential
distribution. Requests ignore EOS, so each produces exactly `max_new_tokens` tokens wherever
it runs. No torch here: the unit tests run in milliseconds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from meshlm.common.default_corpus import CORPUS

WORDS = CORPUS.split()


@dataclass(frozen=True)
class BenchRequest:
    rid: str
    text: str
    prompt_ids: tuple[int, ...]  # what `encode(text)` gave, special tokens included
    max_new_tokens: int


def prompt_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """`n` target prompt lengths in tokens, uniform over [lo, hi]."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def output_lengths(n: int, mean: float, lo: int, hi: int, seed: int) -> list[int]:
    """`n` output lengths: exponential with `mean`, rounded, clipped to [lo, hi]."""
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.expovariate(1.0 / mean)))) for _ in range(n)]


def prompt_text(start: int, target_tokens: int, encode: Callable[[str], Sequence[int]]) -> str:
    """The shortest run of corpus words from word `start` (wrapping) that `encode` makes at
    least `target_tokens` long."""
    def text(n_words: int) -> str:
        return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n_words))

    n = max(1, target_tokens // 2)  # every word is at least one token, most are one or two
    while n > 1 and len(encode(text(n))) > target_tokens:
        n //= 2
    while len(encode(text(n))) < target_tokens:
        n += 1
    return text(n)


def build_workload(
    n: int, encode: Callable[[str], Sequence[int]], seed: int, prompt_range: tuple[int, int],
    output_mean: float, output_range: tuple[int, int],
) -> list[BenchRequest]:
    """The benchmark's requests: deterministic for a given seed and tokenizer."""
    targets = prompt_lengths(n, *prompt_range, seed=seed)
    outputs = output_lengths(n, output_mean, *output_range, seed=seed + 1)
    rng = random.Random(seed + 2)
    starts = [rng.randrange(len(WORDS)) for _ in range(n)]
    requests = []
    for i, (target, out, start) in enumerate(zip(targets, outputs, starts, strict=True)):
        text = prompt_text(start, target, encode)
        requests.append(BenchRequest(f"bench-{i}", text, tuple(encode(text)), out))
    return requests


def workload_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The workload's command-line options, one set for every benchmark command: requests,
    seed, prompt lengths (uniform) and output lengths (exponential, clipped)."""
    options = [
        click.option("--requests", "n_requests", default=64, show_default=True),
        click.option("--seed", default=20240917, show_default=True),
        click.option("--prompt-min", default=16, show_default=True,
                     help="prompt tokens, uniform"),
        click.option("--prompt-max", default=256, show_default=True),
        click.option("--output-mean", default=64.0, show_default=True,
                     help="output tokens, exponential"),
        click.option("--output-max", default=256, show_default=True,
                     help="outputs clipped to [1, this]"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def warmup_request(encode: Callable[[str], Sequence[int]]) -> BenchRequest:
    """A short request, not in any workload, to warm a system up before it is timed."""
    text = "warm up"
    return BenchRequest("warmup", text, tuple(encode(text)), 4)


def static_batches(requests: Sequence[BenchRequest], size: int) -> list[list[BenchRequest]]:
    """Consecutive batches of `size` (the last may be shorter)."""
    return [list(requests[i:i + size]) for i in range(0, len(requests), size)]


def static_steps(batch: Sequence[BenchRequest]) -> int:
    """Decode steps a static batch runs: every row until its longest row is done."""
    return max(r.max_new_tokens for r in batch)


# -- KV waste ---------------------------------------------------------------------------------

def kv_waste(stats: Mapping[str, Any]) -> tuple[int, int] | None:
    """(wasted slots, allocated slots) of a paged KV cache from engine stats(), or None if the
    engine does not report blocks. Allocated = used blocks x block size; wasted = allocated
    slots holding no token (the unfilled tail of each sequence's last block)."""
    size, used, tokens = (stats.get(k) for k in ("kv_block_size", "kv_blocks_used",
                                                   "kv_tokens_used"))
    if size is None or used is None or tokens is None:
        return None
    allocated = int(used) * int(size)
    return allocated - int(tokens), allocated


@dataclass
class WasteMeter:
    """Collects KV waste over engine steps: call `add(engine.stats())` after each step."""

    block_size: int | None = None
    fractions: list[float] = field(default_factory=list)  # waste / allocated, per step
    held_tokens: int = 0  # summed over steps, with
    held_seqs: int = 0    # the running sequences holding them

    def add(self, stats: Mapping[str, Any]) -> None:
        waste = kv_waste(stats)
        if waste is None:
            return
        self.block_size = int(stats["kv_block_size"])
        wasted, allocated = waste
        if allocated > 0:
            self.fractions.append(wasted / allocated)
        running = int(stats.get("running", 0) or 0)
        if running > 0:
            self.held_tokens += int(stats["kv_tokens_used"])
            self.held_seqs += running

    @property
    def mean_fraction(self) -> float | None:
        return sum(self.fractions) / len(self.fractions) if self.fractions else None

    @property
    def mean_seq_len(self) -> float | None:
        """Mean tokens a running sequence holds in the cache, over all steps."""
        return self.held_tokens / self.held_seqs if self.held_seqs else None

    @property
    def target(self) -> float | None:
        """block_size / mean sequence length: at most one partly filled block per sequence."""
        mean_len = self.mean_seq_len
        if self.block_size is None or not mean_len:
            return None
        return self.block_size / mean_len


# -- statistics -------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """`value` formatted, or "n/a"."""
    return "n/a" if value is None else f"{value:{spec}}{suffix}"
