"""The engine's domain types: a request's sampling parameters, its sequence, plans and outputs.

Plain dataclasses without torch, shared by the policy (loop thread) and the model runner
(executor thread). Only the policy mutates a `Sequence`, and only outside `execute()`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Temperatures below this are greedy (division by ~0 would overflow).
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop; defaults are neutral."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def problem(self) -> str | None:
        """Why these parameters are unusable, or None when they are fine."""
        if self.temperature < 0:
            return "temperature must be >= 0"
        if not 0 < self.top_p <= 1:
            return "top_p must be in (0, 1]"
        if self.top_k < -1:
            return "top_k must be -1 or 0 (off), or >= 1"
        if not 0 <= self.min_p <= 1:
            return "min_p must be in [0, 1]"
        if self.repetition_penalty <= 0:
            return "repetition_penalty must be > 0"
        if self.max_new_tokens < 0 or self.min_new_tokens < 0:
            return "max_new_tokens and min_new_tokens must be >= 0"
        return None


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: prompt + generated tokens, its KV slot and its state."""

    rid: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    aborted: bool = False  # abort asked while running; released by the next postprocess
    finish_reason: str | None = None
    matched_token: int | None = None

    @classmethod
    def new(cls, rid: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        return cls(rid, list(prompt_ids), len(prompt_ids), params)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class Plan:
    """One step of work for the model runner.

    A prefill plan runs every token of each sequence (which has just been given a slot) and
    samples its next token; a decode plan runs the last token of each running sequence.
    The runner reads `seqs` (token ids, slot, params) and nothing else of the policy.
    """

    is_prefill: bool
    seqs: list[Sequence]

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes."""
        return sum(s.num_tokens for s in self.seqs) if self.is_prefill else len(self.seqs)


@dataclass
class ExecResult:
    """What `execute()` produced: one sampled token per plan sequence, or an error."""

    token_ids: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass
class StepOutput:
    """One request's news from one step."""

    rid: str
    new_token_ids: list[int]  # may be empty (e.g. aborted before any token)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" when finished
    matched_token: int | None  # EOS / stop token that ended it
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # 0 for now (prefix cache comes later)
    error: str | None = None  # message when finish_reason == "error"
