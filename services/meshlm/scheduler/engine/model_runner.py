"""ModelRunner: carries out a Plan on the device: one packed forward pass, sampling, logprobs,
pooling. A prefill-only item (max_new_tokens 0) draws no token: its last position's logits give
only the logprobs it asked for there (SGLang's compute_logprobs_only).

It owns the paged KV cache and the per-row sampling state (tokens seen, for the repetition
penalty; output token counts, for the frequency and presence penalties; pooled hidden states of
embedding requests). Runs on the executor thread.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from meshlm.scheduler.engine.grammar import allowed_masks, feed
from meshlm.scheduler.engine.kv_cache import (
    MAX_DECODE_GROUPS,
    AttentionMeta,
    KVCache,
    PagedAttention,
    StepItem,
    build_attention_meta,
    long_tensor,
)
from meshlm.scheduler.engine.logprobs import (
    chosen_and_top,
    log_softmax,
    of_token_ids,
    ranks,
    top,
)
from meshlm.scheduler.engine.sampler import Sampler, SamplingBatch, argmax_rows, restrict
from meshlm.scheduler.engine.sequence import ItemResult, Plan, ScheduledSeq, Sequence
from meshlm.scheduler.kernels.native import Kernels
from meshlm.scheduler.models import llama_fused
from meshlm.scheduler.models.llama import LlamaForCausalLM


class ModelRunner:
    """Forward + sample for the items of a plan; one ItemResult per item."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_rows: int,
        num_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        kernels: Kernels | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.kernels = kernels  # None: attention and the layers' other work in torch ops
        # The whole forward through the kernels, where the model's projections were packed.
        self.fused = llama_fused.fuse(model) if kernels is not None else None
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        dtype = kv_dtype or model.model.embed_tokens.weight.dtype  # None: the model's
        self.kv = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                          cfg.head_dim, dtype, device)
        self.windows = [cfg.window_of(layer) for layer in range(cfg.num_layers)]
        self.sampler = Sampler()
        self.seen = torch.zeros(num_rows, cfg.vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(num_rows, cfg.vocab_size, dtype=torch.int32, device=device)
        # Embedding requests with mean pooling: the sum of their hidden states so far.
        self.pooled = torch.zeros(num_rows, cfg.hidden_size, dtype=torch.float32, device=device)

    @torch.inference_mode()
    def run(self, plan: Plan) -> list[ItemResult]:
        items = plan.items
        input_ids, positions, meta = self._prepare(items)
        attention = PagedAttention(self.kv, meta, self.windows, self.kernels)
        offsets = _offsets(items)
        # Rows whose logits are needed: the last token of each item that draws one, then of
        # each prefill-only item that wants logprobs there, then prompt positions whose next
        # token's logprob is asked for. Where every item only draws its next token they are
        # known now, and the forward returns only theirs (its last layer computes no others);
        # in a step of decodes alone that is every row, in order, as the whole forward gives.
        plain = not any(_asks_more(item.seq) for item in items)
        drawing = [i for i, item in enumerate(items) if item.sample] if plain else []
        every = plain and len(drawing) == input_ids.shape[0]
        keep = long_tensor([offsets[i] + items[i].num_tokens - 1 for i in drawing],
                           self.device) if plain and not every else None
        logits: Tensor | None = None
        if self.fused is not None:
            assert self.kernels is not None
            if plain and drawing:  # only the drawn rows' logits: the head in the same call
                logits = llama_fused.fused_logits(self.fused, self.kernels, input_ids,
                                                  positions, attention, keep)
            if logits is None:
                hidden = llama_fused.fused_forward(self.fused, self.kernels, input_ids,
                                                   positions, attention, keep)
        else:
            hidden = self.model(input_ids[None], positions[None], attention, keep)[0]
        results = [ItemResult() for _ in items]
        self._reset_rows([item for item in items if item.reset_row])
        peeking: list[int] = []
        prompt_rows: list[int] = []
        prompt_targets: list[tuple[int, int]] = []
        if not plain:
            self._pool(items, offsets, hidden, results)
            ends = [i for i, item in enumerate(items) if item.sample and item.seq.embed is None]
            drawing = [i for i in ends if not items[i].seq.prefill_only]
            peeking = [i for i in ends if items[i].seq.wants_next_logprobs]
            prompt_rows, prompt_targets = self._prompt_logprob_rows(items, offsets)
            _first_prompt_position(items, results)
        last_rows = [offsets[i] + items[i].num_tokens - 1 for i in drawing + peeking]
        if not last_rows and not prompt_rows:
            return results
        if logits is None:
            if keep is None and not every:
                hidden = hidden.index_select(0, long_tensor(last_rows + prompt_rows,
                                                            self.device))
            logits = self.model.compute_logits(hidden)
        if prompt_rows:
            self._prompt_logprobs(items, logits[len(last_rows):], prompt_targets, results)
        if drawing:
            self._sample(items, drawing, logits[: len(drawing)], results)
        if peeking:
            _position_logprobs([items[i].seq for i in peeking], peeking,
                               log_softmax(logits[len(drawing) : len(last_rows)]), None, results)
        return results

    def _pool(self, items: list[ScheduledSeq], offsets: list[int], hidden: Tensor,
              results: list[ItemResult]) -> None:
        """Embedding requests: sum each chunk's hidden states (mean pooling) or keep the one
        at `pool_at` (last-token pooling) and, on the last chunk, pool and normalise. A
        sequence-classification model instead returns its score head's logits of the pooled
        state, unnormalised (its "embedding", as in SGLang)."""
        for i, item in enumerate(items):
            seq = item.seq
            if seq.embed is None:
                continue
            rows = hidden[offsets[i] : offsets[i] + item.num_tokens]
            row = _row_of(item)
            if seq.embed == "mean":
                self.pooled[row] += rows.float().sum(dim=0)
            else:
                at = seq.pool_at if seq.pool_at is not None else seq.num_tokens - 1
                if item.start <= at < item.end:
                    self.pooled[row] = rows[at - item.start].float()
            if item.sample:
                vector = self.pooled[row] / item.end if seq.embed == "mean" else self.pooled[row]
                if self.model.score is not None:
                    logits = self.model.classify(vector.to(hidden.dtype))
                    results[i].embedding = logits.tolist()
                else:
                    results[i].embedding = F.normalize(vector, dim=-1).tolist()

    def _prepare(self, items: list[ScheduledSeq]) -> tuple[Tensor, Tensor, AttentionMeta]:
        ids: list[int] = []
        pos: list[int] = []
        for item in items:
            start = item.start
            if item.num_tokens == 1:  # a decode: most items
                ids.append(item.seq.token_ids[start])
                pos.append(start)
            else:
                ids += item.seq.token_ids[start : item.end]
                pos += range(start, item.end)
        meta = build_attention_meta(
            [StepItem(item.seq.table.blocks, item.start, item.num_tokens) for item in items],
            self.block_size, self.device,
            max_groups=1 if self.kernels else MAX_DECODE_GROUPS,
        )
        input_ids = long_tensor(ids, self.device)
        positions = long_tensor(pos, self.device)
        return input_ids, positions, meta

    @staticmethod
    def _prompt_logprob_rows(
        items: list[ScheduledSeq], offsets: list[int]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Packed rows whose logits give prompt logprobs, and (item index, target token) per
        row: position p's logits score the prompt token at p + 1."""
        rows: list[int] = []
        targets: list[tuple[int, int]] = []
        for i, item in enumerate(items):
            seq = item.seq
            first = seq.input_logprob_start
            if first is None or not seq.wants_prompt_logprobs:
                continue
            for p in range(max(item.start, first - 1), min(item.end, seq.num_prompt_tokens - 1)):
                rows.append(offsets[i] + p - item.start)
                targets.append((i, seq.token_ids[p + 1]))
        return rows, targets

    def _prompt_logprobs(
        self, items: list[ScheduledSeq], logits: Tensor, targets: list[tuple[int, int]],
        results: list[ItemResult],
    ) -> None:
        """Row r of `logits` scores prompt token targets[r] of item targets[r][0]: its logprob
        and rank, the top ones and the asked ids' there (rows of one item come in position
        order)."""
        tokens = [t for _, t in targets]
        logp = log_softmax(logits)
        chosen, tops = chosen_and_top(logp, tokens, max(
            (items[i].seq.params.top_logprobs_num for i, _ in targets), default=0
        ))
        rank = ranks(logp, tokens)
        for row, (i, _) in enumerate(targets):
            results[i].input_logprobs.append(chosen[row])
            results[i].input_ranks.append(rank[row])
            k = items[i].seq.params.top_logprobs_num
            if k:
                results[i].input_top_logprobs.append(tops[row][:k])
        asked = [row for row, (i, _) in enumerate(targets)
                 if items[i].seq.params.token_ids_logprob]
        values = of_token_ids(logp, asked,
                              [items[targets[row][0]].seq.params.token_ids_logprob
                               for row in asked])
        for row, pairs in zip(asked, values, strict=True):
            results[targets[row][0]].input_token_ids_logprobs.append(pairs)

    def _sample(self, items: list[ScheduledSeq], sampling: list[int], logits: Tensor,
                results: list[ItemResult]) -> None:
        chosen = [items[i] for i in sampling]
        seqs = [item.seq for item in chosen]
        if all(_plain(s) for s in seqs):  # the common case: argmax, nothing to build or track
            greedy = (self.kernels.argmax_rows(logits)
                      if self.kernels is not None and logits.dtype == torch.float32
                      and logits.device.type == "cpu" and logits.stride(1) == 1
                      else argmax_rows(logits).tolist())
            for i, token in zip(sampling, greedy, strict=True):
                results[i].token = token
            return
        rows = torch.tensor([_row_of(item) for item in chosen], dtype=torch.long,
                            device=self.device)
        batch = SamplingBatch.build(
            [s.params for s in seqs],
            [s.num_completion_tokens for s in seqs],
            self.eos_token_ids,
            [s.params.seed for s in seqs],
            self.vocab_size,
            self.device,
            [s.completion_ids for s in seqs] if any(s.params.bad_words for s in seqs) else None,
        )
        constrained = [j for j, s in enumerate(seqs) if s.matcher is not None]
        if constrained:  # what each grammar allows next
            restrict(batch, constrained, allowed_masks(
                [seqs[j].matcher for j in constrained], self.vocab_size, self.device))
        raw = logits.clone() if any(s.params.return_logprob for s in seqs) else None
        seen = self.seen[rows] if batch.repetition is not None else None
        counts = self.counts[rows] if batch.needs_counts else None
        tokens = self.sampler.sample(logits, batch, seen, counts)
        self.seen[rows, tokens] = True
        self.counts[rows, tokens] += 1  # rows are distinct within a plan
        token_list = tokens.tolist()
        for i, token in zip(sampling, token_list, strict=True):
            results[i].token = token
        for j in constrained:
            results[sampling[j]].grammar_end = feed(seqs[j].matcher, token_list[j])
        if raw is not None:
            _position_logprobs(seqs, sampling, log_softmax(raw), token_list, results)

    def _reset_rows(self, items: list[ScheduledSeq]) -> None:
        """A newly admitted sequence's row starts over from its tokens."""
        if not items:
            return
        rows = torch.tensor([_row_of(item) for item in items], dtype=torch.long,
                            device=self.device)
        self.pooled[rows] = 0
        # The token statistics, for the rows whose sampling reads them.
        items = [item for item in items if not item.seq.params.plain_greedy]
        if not items:
            return
        rows = torch.tensor([_row_of(item) for item in items], dtype=torch.long,
                            device=self.device)
        self.seen[rows] = False
        self.counts[rows] = 0
        seqs = [item.seq for item in items]
        index = [i for i, s in enumerate(seqs) for _ in range(s.num_tokens)]
        ids = torch.tensor([t for s in seqs for t in s.token_ids], device=self.device)
        self.seen[rows[index], ids] = True
        out_index = [i for i, s in enumerate(seqs) for _ in range(s.num_completion_tokens)]
        if out_index:  # a sequence readmitted after preemption carries its output
            out_ids = torch.tensor([t for s in seqs for t in s.completion_ids],
                                   device=self.device)
            self.counts.index_put_(
                (rows[out_index], out_ids), torch.ones_like(out_ids, dtype=torch.int32),
                accumulate=True,
            )


def _first_prompt_position(items: list[ScheduledSeq], results: list[ItemResult]) -> None:
    """Prompt position 0 has no logprob (nothing precedes it): None, and empty top and asked
    ids' lists, for an item that starts there and wants prompt logprobs from there."""
    for item, result in zip(items, results, strict=True):
        seq = item.seq
        if item.start == 0 and seq.input_logprob_start == 0 and seq.wants_prompt_logprobs:
            result.input_logprobs.append(None)
            result.input_ranks.append(0)
            if seq.params.top_logprobs_num:
                result.input_top_logprobs.append([])
            if seq.params.token_ids_logprob:
                result.input_token_ids_logprobs.append([])


def _position_logprobs(seqs: list[Sequence], targets: list[int], logp: Tensor,
                       tokens: list[int] | None, results: list[ItemResult]) -> None:
    """Logprobs at one position per sequence (row j of `logp` [N, V] is seqs[j]'s, its result
    results[targets[j]]), for those with return_logprob: the drawn token's (`tokens`; None: a
    prefill-only position, nothing drawn), the top ones and the asked ids' (token_ids_logprob,
    one gather for all rows)."""
    k = max(s.params.top_logprobs_num for s in seqs)
    chosen, tops = chosen_and_top(logp, tokens, k) if tokens is not None else (None, top(logp, k))
    for j, (i, seq) in enumerate(zip(targets, seqs, strict=True)):
        p = seq.params
        if not p.return_logprob:
            continue
        if chosen is not None:
            results[i].logprob = chosen[j]
        if p.top_logprobs_num:
            results[i].top_logprobs = tops[j][: p.top_logprobs_num]
    asked = [j for j, s in enumerate(seqs)
             if s.params.return_logprob and s.params.token_ids_logprob]
    values = of_token_ids(logp, asked, [seqs[j].params.token_ids_logprob for j in asked])
    for j, pairs in zip(asked, values, strict=True):
        results[targets[j]].token_ids_logprobs = pairs


def _plain(seq: Sequence) -> bool:
    """Its next token is the logits' argmax: greedy, no penalty, no logprobs, and no id
    banned by min_new_tokens any more."""
    params = seq.params
    return params.plain_greedy and (
        not params.min_new_tokens
        or len(seq.token_ids) - seq.num_prompt_tokens >= params.min_new_tokens)


def _asks_more(seq: Sequence) -> bool:
    """Logprobs, an embedding or the prompt alone (max_new_tokens 0): more than a token."""
    params = seq.params
    return params.return_logprob or seq.embed is not None or params.max_new_tokens == 0


def _offsets(items: list[ScheduledSeq]) -> list[int]:
    offsets, total = [], 0
    for item in items:
        offsets.append(total)
        total += item.num_tokens
    return offsets


def _row_of(item: ScheduledSeq) -> int:
    if item.seq.row is None:
        raise RuntimeError(f"request {item.seq.rid!r} has no sampling row")
    return item.seq.row
