"""Sampler: one batched step from logits to next tokens, each row with its own parameters.

Order, as in vLLM: min_new_tokens masking, repetition / frequency / presence penalties,
greedy argmax (temperature 0), then temperature, top-k, top-p, min-p and a draw. The draw is
an exponential race, argmax(p / q) with q ~ Exp(1), which samples from p; seeded rows draw q
from their own torch.Generator, so their tokens depend only on the seed and the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from meshlm.scheduler.engine.sequence import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors; a None field means no row uses that feature."""

    greedy: Tensor  # [B] bool
    all_greedy: bool
    temperatures: Tensor  # [B], 1.0 on greedy rows
    top_ks: Tensor | None  # [B] long, vocab size where off
    top_ps: Tensor | None  # [B]
    min_ps: Tensor | None  # [B]
    repetition: Tensor | None  # [B]
    frequency: Tensor | None  # [B]
    presence: Tensor | None  # [B]
    banned: tuple[Tensor, Tensor] | None  # (rows, token ids) set to -inf: min_new_tokens
    generators: list[torch.Generator | None]  # per row; None = the shared random stream

    @property
    def needs_counts(self) -> bool:
        return self.frequency is not None or self.presence is not None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        num_generated: list[int],
        eos_token_ids: tuple[int, ...],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        """Gather the rows' parameters; `num_generated` counts each row's tokens so far."""
        greedy = [p.greedy for p in params]
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, (p, n) in enumerate(zip(params, num_generated, strict=True)):
            if n < p.min_new_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                ids = {t for t in ids if 0 <= t < vocab_size}
                ban_rows += [i] * len(ids)
                ban_ids += sorted(ids)

        def column(values: list[float], neutral: float) -> Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)

        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        top_ks = None
        if any(p.top_k > 0 for p in sampled):
            ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
            top_ks = torch.tensor(ks, dtype=torch.long, device=device)
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=not sampled,
            temperatures=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                dtype=torch.float32,
                device=device,
            ),
            top_ks=top_ks,
            top_ps=column([p.top_p for p in params], 1.0) if sampled else None,
            min_ps=column([p.min_p for p in params], 0.0) if sampled else None,
            repetition=column([p.repetition_penalty for p in params], 1.0),
            frequency=column([p.frequency_penalty for p in params], 0.0),
            presence=column([p.presence_penalty for p in params], 0.0),
            banned=(
                (
                    torch.tensor(ban_rows, dtype=torch.long, device=device),
                    torch.tensor(ban_ids, dtype=torch.long, device=device),
                )
                if ban_rows
                else None
            ),
            generators=[None if g else gen for gen, g in zip(generators, greedy, strict=True)],
        )


class Sampler:
    """Stateless: logits [B, V] float32 + a SamplingBatch -> token ids [B]."""

    def sample(
        self,
        logits: Tensor,
        batch: SamplingBatch,
        seen: Tensor | None = None,
        counts: Tensor | None = None,
    ) -> Tensor:
        """`seen` [B, V] bool marks prompt + output tokens (repetition penalty); `counts`
        [B, V] counts output tokens (frequency/presence). Needed only when the batch uses
        those penalties. `logits` may be modified in place."""
        if batch.banned is not None:
            logits[batch.banned] = float("-inf")
        logits = self._penalize(logits, batch, seen, counts)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        logits = logits / batch.temperatures[:, None]
        if batch.top_ks is not None or batch.top_ps is not None:
            logits = _top_k_top_p(logits, batch.top_ks, batch.top_ps)
        probs = logits.softmax(dim=-1)
        if batch.min_ps is not None:
            floor = batch.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        q = torch.empty_like(probs).exponential_()
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                q[row].exponential_(generator=gen)
        sampled = (probs / q.clamp_min_(1e-20)).argmax(dim=-1)
        return torch.where(batch.greedy, greedy_tokens, sampled)

    @staticmethod
    def _penalize(
        logits: Tensor, batch: SamplingBatch, seen: Tensor | None, counts: Tensor | None
    ) -> Tensor:
        if batch.repetition is not None:
            assert seen is not None, "repetition penalty needs seen tokens"
            pen = batch.repetition[:, None]
            penalized = torch.where(logits > 0, logits / pen, logits * pen)
            logits = torch.where(seen, penalized, logits)
        if batch.needs_counts:
            assert counts is not None, "frequency/presence penalty needs token counts"
            c = counts.to(logits.dtype)
            if batch.frequency is not None:
                logits = logits - batch.frequency[:, None] * c
            if batch.presence is not None:
                logits = logits - batch.presence[:, None] * (c > 0).to(logits.dtype)
        return logits


def _top_k_top_p(logits: Tensor, top_ks: Tensor | None, top_ps: Tensor | None) -> Tensor:
    """Mask all but each row's top_k logits and its top_p nucleus (at least one stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_ks is not None:
        kth = sorted_logits.gather(1, (vocab - top_ks).unsqueeze(1))  # each row's k-th largest
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_ps is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_ps[:, None]
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
