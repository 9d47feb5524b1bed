"""ModelRunner: carries out a Plan on the device: one forward pass (per prefill group), sampling.

It owns everything indexed by KV slot: the KV cache, per-slot token statistics for the
penalties, and per-slot generators for seeded requests. A prefill plan (re)initialises the
slots it names; a decode plan continues them. Runs on the executor thread.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshlm.scheduler.engine.kv_cache import DecodeAttention, KVCache, PrefillAttention
from meshlm.scheduler.engine.sampler import Sampler, SamplingBatch
from meshlm.scheduler.engine.sequence import Plan, Sequence
from meshlm.scheduler.models.llama import LlamaForCausalLM

# A prefill group may hold at most this many padded token positions per real token.
PAD_SLACK = 1.3


class ModelRunner:
    """Forward + sample for the sequences of a plan; returns one token id per sequence."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_running: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = eos_token_ids
        dtype = model.lm_head.weight.dtype
        self.kv = KVCache(
            cfg.num_layers, max_running, cfg.num_kv_heads, max_model_len, cfg.head_dim,
            dtype, device,
        )
        self.sampler = Sampler()
        # Per slot: tokens seen in prompt + output (repetition penalty), output token counts
        # (frequency / presence penalties), and the generator of a seeded request.
        self.seen = torch.zeros(max_running, cfg.vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(max_running, cfg.vocab_size, dtype=torch.int32, device=device)
        self.generators: dict[int, torch.Generator] = {}

    @torch.inference_mode()
    def run(self, plan: Plan) -> list[int]:
        """Compute and sample the next token of each of `plan.seqs`, in order."""
        seqs = plan.seqs
        slot_ids = [_slot_of(s) for s in seqs]
        slots = torch.tensor(slot_ids, dtype=torch.long, device=self.device)
        if plan.is_prefill:
            self._reset_slots(seqs, slot_ids, slots)
            logits = self._prefill(seqs, slot_ids)
        else:
            logits = self._decode(seqs, slot_ids, slots)
        tokens = self._sample(seqs, slot_ids, slots, logits)
        self.seen[slots, tokens] = True
        self.counts[slots, tokens] += 1  # slots are distinct within a plan
        return tokens.tolist()

    def _prefill(self, seqs: list[Sequence], slot_ids: list[int]) -> Tensor:
        logits = torch.empty(len(seqs), self.vocab_size, device=self.device)
        for group in _length_groups([s.num_tokens for s in seqs]):
            lens = [seqs[i].num_tokens for i in group]
            width = max(lens)
            ids = [seqs[i].token_ids + [0] * (width - n) for i, n in zip(group, lens, strict=True)]
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            positions = torch.arange(width, device=self.device).expand(len(group), width)
            slots = torch.tensor([slot_ids[i] for i in group], device=self.device)
            hidden = self.model(input_ids, positions, PrefillAttention(self.kv, slots))
            last = torch.tensor([n - 1 for n in lens], device=self.device)
            rows = torch.arange(len(group), device=self.device)
            index = torch.tensor(group, device=self.device)
            logits[index] = self.model.compute_logits(hidden[rows, last])
        return logits

    def _decode(self, seqs: list[Sequence], slot_ids: list[int], slots: Tensor) -> Tensor:
        last = [s.token_ids[-1] for s in seqs]
        pos = [s.num_tokens - 1 for s in seqs]
        input_ids = torch.tensor(last, dtype=torch.long, device=self.device)[:, None]
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        attention = DecodeAttention(self.kv, slot_ids, slots, positions, max(pos) + 1)
        hidden = self.model(input_ids, positions[:, None], attention)
        return self.model.compute_logits(hidden[:, 0])

    def _reset_slots(self, seqs: list[Sequence], slot_ids: list[int], slots: Tensor) -> None:
        """A prefilled slot starts over: its stats from the sequence's tokens, a new seed."""
        self.seen[slots] = False
        self.counts[slots] = 0
        rows = [i for i, s in enumerate(seqs) for _ in range(s.num_tokens)]
        ids = [t for s in seqs for t in s.token_ids]
        self.seen[slots[rows], torch.tensor(ids, device=self.device)] = True
        out_rows = [i for i, s in enumerate(seqs) for _ in range(s.num_completion_tokens)]
        if out_rows:  # a sequence prefilled again after preemption carries its output
            out_ids = torch.tensor([t for s in seqs for t in s.completion_ids], device=self.device)
            self.counts.index_put_(
                (slots[out_rows], out_ids), torch.ones_like(out_ids, dtype=torch.int32),
                accumulate=True,
            )
        for seq, slot in zip(seqs, slot_ids, strict=True):
            seed = seq.params.seed
            if seed is None:
                self.generators.pop(slot, None)
            else:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed)
                self.generators[slot] = gen

    def _sample(
        self, seqs: list[Sequence], slot_ids: list[int], slots: Tensor, logits: Tensor
    ) -> Tensor:
        batch = SamplingBatch.build(
            [s.params for s in seqs],
            [s.num_completion_tokens for s in seqs],
            self.eos_token_ids,
            [self.generators.get(slot) for slot in slot_ids],
            self.vocab_size,
            self.device,
        )
        seen = self.seen[slots] if batch.repetition is not None else None
        counts = self.counts[slots] if batch.needs_counts else None
        return self.sampler.sample(logits, batch, seen, counts)


def _slot_of(seq: Sequence) -> int:
    if seq.slot is None:
        raise RuntimeError(f"request {seq.rid!r} has no KV slot")
    return seq.slot


def _length_groups(lens: list[int]) -> list[list[int]]:
    """Split sequence indices into groups of similar length (longest first) so that right
    padding to each group's longest wastes at most PAD_SLACK - 1 of the real tokens."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lens[groups[-1][0]] <= PAD_SLACK * (total + lens[i]):
            groups[-1].append(i)
            total += lens[i]
        else:
            groups.append([i])
            total = lens[i]
    return groups
