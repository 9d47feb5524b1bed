"""The engine's domain types: a request's sampling parameters, its sequence, plans and outputs.

Plain dataclasses without torch, shared by the policy (loop thread) and the model runner
(executor thread). Only the policy mutates a `Sequence`, and only outside `execute()`.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from meshlm.scheduler.engine.block_manager import BlockTable
from meshlm.scheduler.engine.thinking import ThinkingBudget

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
    max_new_tokens: int = 128  # 0: prefill only (the prompt's logits, no token drawn)
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    # Logprobs are of the model's own distribution (log_softmax of the raw logits, before
    # temperature, penalties and truncation), as SGLang and HF `output_logits` report them.
    return_logprob: bool = False
    top_logprobs_num: int = 0  # top alternatives per position, when return_logprob
    logprob_start_len: int = -1  # prompt positions from here get logprobs too; -1 = none
    # With return_logprob: the logprobs of these ids at each output position, and at the prompt
    # positions with logprobs (SGLang's token_ids_logprob; scoring asks for its label tokens).
    token_ids_logprob: tuple[int, ...] = ()
    # (token id, bias) pairs added to the logits before anything else (OpenAI's logit_bias; -100
    # bans a token, +100 all but forces it). Logprobs stay the model's own.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Only these ids may be drawn (vLLM's allowed_token_ids; empty: any): the others' logits are
    # -inf before anything else. Logprobs stay the model's own.
    allowed_token_ids: tuple[int, ...] = ()
    # Constrained decoding: an llguidance grammar the output must follow ("": none). The
    # sequence's matcher (`Sequence.matcher`) is built from it before the request is queued.
    grammar: str = ""
    # vLLM's bad_words, encoded: the last id of each is never drawn right after the ones before
    # it (a one-id word never).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # A thinking budget: (tokens, the opening tag's ids, the closing tag's ids), or None. The
    # sequence's matcher is then a ThinkingBudget (`engine/thinking.py`).
    thinking: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy, without penalties or logprobs: the token is the raw logits' argmax (once
        min_new_tokens allows every id), and the row's token statistics are never read.
        Asked every step for every row, so kept (these fields do not change once queued)."""
        return (self.temperature < GREEDY_EPS and self.repetition_penalty == 1.0
                and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0
                and not self.return_logprob and not self.logit_bias
                and not self.allowed_token_ids and not self.grammar and not self.bad_words
                and self.thinking is None)

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
        if self.top_logprobs_num < 0:
            return "top_logprobs_num must be >= 0"
        if self.logprob_start_len < -1:
            return "logprob_start_len must be >= -1"
        if any(t < 0 for t in self.token_ids_logprob):
            return "token_ids_logprob must be token ids >= 0"
        if any(t < 0 or not math.isfinite(b) for t, b in self.logit_bias):
            return "logit_bias must map token ids >= 0 to finite numbers"
        if any(t < 0 for t in self.allowed_token_ids):
            return "allowed_token_ids must be token ids >= 0"
        return None


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


TopLogprobs = list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: prompt + generated tokens, its KV blocks and its state.

    `num_computed_tokens` of `token_ids` have their KV in the cache (the prefix-cache hit
    included); the rest are computed by the coming steps, a chunk at a time while prefilling,
    one (the last sampled token) while decoding. `row` indexes the runner's per-request
    sampling state (penalty statistics) while the sequence runs.
    """

    rid: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    table: BlockTable = field(default_factory=BlockTable)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (first admission)
    row: int | None = None
    row_fresh: bool = False  # the row's statistics are still to be built from token_ids
    aborted: bool = False  # abort asked while running; released before the next step
    finish_reason: str | None = None
    matched_token: int | None = None
    admitted_once: bool = False
    embed: str | None = None  # an embedding request: its pooling ("last" | "mean")
    pool_at: int | None = None  # "last" pooling: the position whose hidden state is pooled
    held: bool = False  # waiting for a leader's prompt (n > 1), not in the waiting queue
    followers: list[Sequence] = field(default_factory=list)  # held for this one's prompt
    num_preemptions: int = 0
    priority: int = 0  # the client's: larger values are admitted first (waiting.py)
    # Prompt logprobs gathered chunk by chunk, sent with the first output.
    input_logprobs: list[float | None] = field(default_factory=list)
    input_ranks: list[int] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_token_ids_logprobs: list[TopLogprobs] = field(default_factory=list)
    first_output_sent: bool = False
    # Constrained decoding: the grammar's matcher (an llguidance LLMatcher, opaque here), fed
    # each token drawn; None without a grammar.
    matcher: Any = None

    @classmethod
    def new(cls, rid: str, prompt_ids: list[int], params: SamplingParams,
            priority: int = 0, matcher: Any = None) -> Sequence:
        if params.thinking is not None:
            matcher = ThinkingBudget(*params.thinking, prompt_ids, matcher)
        return cls(rid, list(prompt_ids), len(prompt_ids), params, priority=priority,
                   matcher=matcher)

    @classmethod
    def new_embed(cls, rid: str, prompt_ids: list[int], pooling: str,
                  pool_at: int | None = None) -> Sequence:
        """An embedding request: its prompt is pooled ("last" at `pool_at`, default the last
        position, clamped to the prompt; or "mean"), one forward pass and no token drawn."""
        seq = cls.new(rid, prompt_ids, SamplingParams(max_new_tokens=1))
        seq.embed = pooling
        if pooling == "last":
            last = max(len(prompt_ids) - 1, 0)
            seq.pool_at = last if pool_at is None else min(max(pool_at, 0), last)
        return seq

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def input_logprob_start(self) -> int | None:
        """First prompt position whose logprob is asked for, or None."""
        p = self.params
        if not p.return_logprob or p.logprob_start_len < 0:
            return None
        return min(p.logprob_start_len, self.num_prompt_tokens)

    @property
    def wants_prompt_logprobs(self) -> bool:
        start = self.input_logprob_start
        return start is not None and not self.first_output_sent and start < self.num_prompt_tokens

    @property
    def prefill_only(self) -> bool:
        """max_new_tokens 0 (SGLang's prefill-only request): the prompt is computed and the
        request ends ("length") with no token drawn; with return_logprob its output carries
        the prompt logprobs asked and, for the position after the prompt, the top and asked
        ids' logprobs."""
        return self.embed is None and self.params.max_new_tokens == 0

    @property
    def wants_next_logprobs(self) -> bool:
        """A prefill-only request that wants logprobs of the position after its prompt."""
        p = self.params
        return self.prefill_only and p.return_logprob and bool(
            p.top_logprobs_num or p.token_ids_logprob)

    def keep_prompt_logprobs(self, result: ItemResult) -> None:
        """A computed chunk's prompt logprobs, kept for the first output."""
        if self.wants_prompt_logprobs:
            self.input_logprobs += result.input_logprobs
            self.input_ranks += result.input_ranks
            self.input_top_logprobs += result.input_top_logprobs
            self.input_token_ids_logprobs += result.input_token_ids_logprobs

    def drop_prompt_logprobs(self) -> None:
        """Recomputed from the start (preempted, retracted): unless its first output has
        gone, its prompt logprobs are gathered again."""
        if not self.first_output_sent:
            self.input_logprobs, self.input_top_logprobs = [], []
            self.input_ranks, self.input_token_ids_logprobs = [], []

    def release_followers(self) -> list[Sequence]:
        """This one's prompt is computed (or it ended): its followers, in order, held no more."""
        followers, self.followers = self.followers, []
        for follower in followers:
            follower.held = False
        return followers

    @property
    def prefilling(self) -> bool:
        """Live, and its prompt not all computed yet."""
        return self.status is not SequenceStatus.FINISHED and (
            self.num_computed_tokens < self.num_prompt_tokens
        )

    @property
    def decoding(self) -> bool:
        """Past its prompt: one token to compute, the one it sampled last."""
        n = self.num_computed_tokens
        return n == self.num_tokens - 1 and n >= self.num_prompt_tokens

    @property
    def reusable_prefix(self) -> int:
        """How many leading tokens may take their KV from the prefix cache: at least the last
        token is computed, for its logits; prompt logprobs need the positions from one before
        logprob_start_len, pooling the positions it pools."""
        limit = self.num_tokens - 1
        start = self.input_logprob_start
        if start is not None and self.wants_prompt_logprobs:
            limit = min(limit, max(start - 1, 0))
        if self.embed == "mean":
            limit = 0  # every position's hidden state is pooled
        elif self.pool_at is not None:
            limit = min(limit, self.pool_at)  # the pooled position is computed
        return limit

    def problem(self, max_model_len: int, vocab_size: int | None,
                can_generate: bool) -> str | None:
        """Why this request cannot run on a model of `max_model_len` positions and
        `vocab_size` ids (that `can_generate` or only embeds), or None when it can."""
        n = self.num_prompt_tokens
        if n == 0:
            return "empty prompt"
        if n >= max_model_len:
            return f"prompt has {n} tokens; max_model_len is {max_model_len}"
        if vocab_size is not None and not (
            0 <= min(self.token_ids) and max(self.token_ids) < vocab_size
        ):
            return f"prompt token id out of range [0, {vocab_size})"
        if vocab_size is not None and any(t >= vocab_size for t in self.params.token_ids_logprob):
            return f"token_ids_logprob: token id out of range [0, {vocab_size})"
        if vocab_size is not None and any(t >= vocab_size for t, _ in self.params.logit_bias):
            return f"logit_bias: token id out of range [0, {vocab_size})"
        if vocab_size is not None and any(t >= vocab_size for t in self.params.allowed_token_ids):
            return f"allowed_token_ids: token id out of range [0, {vocab_size})"
        if self.embed is None and not can_generate:
            return "this model serves embeddings only (it has no language-model head)"
        if self.params.grammar and self.matcher is None:
            return "grammar: no matcher was built for it"
        return self.params.problem()


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute positions [start, start + num_tokens) and,
    when `sample`, draw the token after them. `reset_row` asks the runner to rebuild the
    sequence's sampling row from its tokens first (it was just admitted)."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool
    reset_row: bool = False

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class Plan:
    """One step of work for the model runner: chunks of prompts and decode tokens, mixed.

    The runner reads the items, their sequences' token ids, block tables, rows and params,
    and nothing else of the policy.
    """

    items: list[ScheduledSeq]

    @property
    def seqs(self) -> list[Sequence]:
        return [item.seq for item in self.items]

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes."""
        return sum(item.num_tokens for item in self.items)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items if item.num_tokens > 1)


@dataclass
class ItemResult:
    """What one plan item produced: the sampled token (if it sampled), its logprobs, and the
    logprobs of the prompt positions this chunk covered (when asked)."""

    token: int | None = None
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None
    input_logprobs: list[float | None] = field(default_factory=list)
    input_ranks: list[int] = field(default_factory=list)  # 1 = most likely; 0 at position 0
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_token_ids_logprobs: list[TopLogprobs] = field(default_factory=list)  # [] at position 0
    # An embedding request's result: the pooled, normalised vector, or a classifier's logits.
    embedding: list[float] | None = None
    # (id, logprob) per params.token_ids_logprob at the sampled position (a prefill-only
    # request's: the position after its prompt, where `token` stays None).
    token_ids_logprobs: TopLogprobs | None = None
    # Constrained decoding, after the token: "done" when the grammar is complete (the request
    # stops), else why the grammar refused it; None while it goes on (or without a grammar).
    grammar_end: str | None = None


@dataclass
class ExecResult:
    """What `execute()` produced: one ItemResult per plan item, or an error."""

    items: list[ItemResult] = field(default_factory=list)
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
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # message when finish_reason == "error"
    # With return_logprob: one entry per new token; top lists hold (token_id, logprob) pairs,
    # best first, top_logprobs_num long.
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With return_logprob and logprob_start_len >= 0, on the request's first output only:
    # prompt positions [input_logprob_start, prompt_tokens); position 0 has no logprob (None).
    input_logprob_start: int = 0
    input_logprobs: list[float | None] = field(default_factory=list)
    input_ranks: list[int] = field(default_factory=list)  # each prompt token's; 0 at position 0
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With token_ids_logprob: per new token, (id, logprob) of each asked id, in asked order; on
    # the first output, the same per prompt position of input_logprobs ([] at position 0).
    # A prefill-only request has no new token, but its top and asked ids' logprobs at the
    # position after the prompt (one entry each, when asked).
    output_token_ids_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's result (then finished)
