"""Scheduler: the engine's policy. Queues, KV slots, prefill budget, finish rules, aborts.

No torch here: `schedule()` returns a `Plan` that the model runner carries out, and
`postprocess()` takes the sampled token ids back. All methods run on one thread (the event
loop's); the runner may execute a plan concurrently, reading only that plan's sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from meshlm.scheduler.engine.sequence import (
    Plan,
    SamplingParams,
    Sequence,
    SequenceStatus,
    StepOutput,
)
from meshlm.scheduler.engine.slot_table import SlotTable


class Scheduler:
    """Continuous batching over a fixed number of KV slots.

    Each step is either a prefill of newly admitted sequences (FIFO, while a slot is free and
    the step's prompt tokens fit `max_prefill_tokens`; the first always fits) or one decode
    step of every running sequence. Prefill goes first, except that after
    `max_consecutive_prefills` prefills in a row a decode step is due if anything is running.
    """

    def __init__(
        self,
        max_running: int,
        max_model_len: int,
        max_prefill_tokens: int = 4096,
        eos_token_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        max_consecutive_prefills: int = 1,
    ) -> None:
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_consecutive_prefills = max_consecutive_prefills
        self.slots = SlotTable(max_running)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._live: dict[str, Sequence] = {}  # waiting + running, by rid
        self._aborting: list[Sequence] = []  # running, abort asked, not yet released
        self._pending: list[StepOutput] = []  # outputs for the next postprocess
        self._prefill_streak = 0
        self.finished_total = 0
        self.aborted_total = 0
        self.generated_tokens_total = 0

    # -- requests ---------------------------------------------------------------------------

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError if `rid` is live. An unusable request is not
        queued: it finishes with "error" (or "length" when max_new_tokens is 0) at once, its
        output coming from the next postprocess."""
        if rid in self._live:
            raise ValueError(f"duplicate request id {rid!r}")
        seq = Sequence.new(rid, prompt_ids, params)
        problem = self._problem(seq)
        if problem is not None:
            self._finish(seq, "error")
            self._pending.append(self._output(seq, [], error=problem))
        elif params.max_new_tokens == 0:
            self._finish(seq, "length")
            self._pending.append(self._output(seq, []))
        else:
            self._live[rid] = seq
            self.waiting.append(seq)

    def _problem(self, seq: Sequence) -> str | None:
        n = seq.num_prompt_tokens
        if n == 0:
            return "empty prompt"
        if n >= self.max_model_len:
            return f"prompt has {n} tokens; max_model_len is {self.max_model_len}"
        if self.vocab_size is not None and not (
            0 <= min(seq.token_ids) and max(seq.token_ids) < self.vocab_size
        ):
            return f"prompt token id out of range [0, {self.vocab_size})"
        return seq.params.problem()

    def abort(self, rid: str) -> bool:
        """End a live request; True if found. Waiting: removed now. Running: marked, and
        released (slot freed) by the next postprocess. Either way one "abort" output follows."""
        seq = self._live.get(rid)
        if seq is None or seq.aborted:
            return False
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._finish(seq, "abort")
            self._pending.append(self._output(seq, []))
        else:
            seq.aborted = True
            self._aborting.append(seq)
        return True

    def abort_all(self) -> int:
        """Abort every live request; returns how many."""
        return sum(self.abort(rid) for rid in list(self._live))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    # -- steps ------------------------------------------------------------------------------

    def schedule(self) -> Plan | None:
        """Pick the next step's work, or None when there is nothing to run."""
        decodable = [s for s in self.running if not s.aborted]
        prefill_due = not decodable or self._prefill_streak < self.max_consecutive_prefills
        if self.waiting and self.slots.can_allocate() and prefill_due:
            self._prefill_streak += 1
            return Plan(True, self._admit())
        self._prefill_streak = 0
        return Plan(False, decodable) if decodable else None

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and self.slots.can_allocate():
            seq = self.waiting[0]
            if admitted and seq.num_tokens > budget:
                break
            self.waiting.popleft()
            seq.slot = self.slots.allocate()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            budget -= seq.num_tokens
        return admitted

    def postprocess(
        self, plan: Plan | None, token_ids: list[int] | None, error: str | None = None
    ) -> list[StepOutput]:
        """Take a step's sampled tokens (one per plan sequence, or an error for all of them),
        finish what is done, release aborted sequences, and return every output due."""
        outputs, self._pending = self._pending, []
        if plan is not None:
            if token_ids is None or error is not None:
                for seq in plan.seqs:
                    if seq.status is SequenceStatus.RUNNING and not seq.aborted:
                        self._finish(seq, "error")
                        outputs.append(self._output(seq, [], error=error or "no result"))
            else:
                for seq, token in zip(plan.seqs, token_ids, strict=True):
                    if seq.status is SequenceStatus.RUNNING and not seq.aborted:
                        outputs.append(self._append(seq, token))
        for seq in self._aborting:
            if seq.status is SequenceStatus.RUNNING:
                self._finish(seq, "abort")
                outputs.append(self._output(seq, []))
        self._aborting.clear()
        return outputs

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        seq.token_ids.append(token)
        self.generated_tokens_total += 1
        p = seq.params
        # min_new_tokens: EOS and stop ids may not be among the first min_new_tokens tokens.
        may_stop = seq.num_completion_tokens > p.min_new_tokens
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop", token)
        elif may_stop and token in p.stop_token_ids:
            self._finish(seq, "stop", token)
        elif seq.num_completion_tokens >= p.max_new_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")
        return self._output(seq, [token])

    def _finish(self, seq: Sequence, reason: str, matched: int | None = None) -> None:
        """The one place a sequence ends: frees its slot (once) and forgets it."""
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.matched_token = reason, matched
        self._live.pop(seq.rid, None)
        self.finished_total += 1
        if reason == "abort":
            self.aborted_total += 1

    @staticmethod
    def _output(seq: Sequence, new: list[int], error: str | None = None) -> StepOutput:
        finished = seq.status is SequenceStatus.FINISHED
        return StepOutput(
            rid=seq.rid,
            new_token_ids=new,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            matched_token=seq.matched_token,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_completion_tokens,
            cached_tokens=0,
            error=error,
        )

    def stats(self) -> dict[str, Any]:
        """Load figures; `finished_total` counts every end (aborts and errors included)."""
        capacity = self.max_running * self.max_model_len
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "max_running": self.max_running,
            "free_slots": self.slots.num_free,
            "finished_total": self.finished_total,
            "aborted_total": self.aborted_total,
            "generated_tokens_total": self.generated_tokens_total,
            "token_usage": sum(s.num_tokens for s in self.running) / capacity,
        }
