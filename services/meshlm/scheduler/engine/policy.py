"""BatchPlanner: the engine's policy. Queues, token budget, KV blocks, preemption, finish rules.

No torch here: `schedule()` returns a `Plan` that the model runner carries out, and
`postprocess()` takes what it produced back. All methods run on one thread (the event
loop's); the runner may execute a plan concurrently, reading only that plan's sequences.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from meshlm.scheduler.engine.block_manager import BlockManager, salt_root
from meshlm.scheduler.engine.outputs import step_output
from meshlm.scheduler.engine.sequence import (
    ItemResult,
    Plan,
    SamplingParams,
    ScheduledSeq,
    Sequence,
    SequenceStatus,
    StepOutput,
)
from meshlm.scheduler.engine.slot_table import SlotTable
from meshlm.scheduler.engine.totals import Totals
from meshlm.scheduler.engine.waiting import WaitingQueue

# How pause() treats the requests in flight (SGLang's PauseGenerationReqInput.mode).
PAUSE_MODES = ("abort", "retract", "in_place")


class BatchPlanner:
    """Continuous batching with chunked prefill over a paged KV cache.

    Every step spends at most `max_batched_tokens` tokens: first one decode token for each
    running sequence that has finished its prompt (oldest first), then the next chunk of each
    running sequence still prefilling, then new sequences from the waiting queue (larger
    priority first, then FIFO: waiting.py), each taking what is left of the budget as its
    first chunk. A waiting sequence is admitted only when blocks for its whole prompt are free
    (after reusing its cached prefix) with `watermark_blocks` to spare, and fewer than
    `max_running` run. When a decode needs a new block and none is free, the newest running
    sequence is preempted: its blocks are freed and it goes back to the front of the queue
    (of its priority), to be recomputed (its prefix likely cached).
    While paused (`pause()` .. `resume()`) no step is planned; requests still come and go.
    """

    def __init__(
        self,
        max_running: int,
        max_model_len: int,
        num_blocks: int,
        block_size: int = 16,
        max_batched_tokens: int = 2048,
        eos_token_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        watermark_blocks: int | None = None,
        prefix_cache: bool = True,
        can_generate: bool = True,
    ) -> None:
        if max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.max_batched_tokens = max_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.blocks = BlockManager(num_blocks, block_size)
        self.prefix_cache = prefix_cache
        self.can_generate = can_generate
        if watermark_blocks is None:
            watermark_blocks = num_blocks // 100
        self.watermark_blocks = watermark_blocks
        self.rows = SlotTable(max_running)
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # in admission order
        self._live: dict[str, Sequence] = {}  # waiting + running, by rid
        self._aborting: list[Sequence] = []  # running, abort asked, not yet released
        self._pending: list[StepOutput] = []  # outputs for the next postprocess
        self.paused: str | None = None  # the mode of the pause in force
        self.totals = Totals()

    # -- requests ---------------------------------------------------------------------------

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            after: str | None = None, priority: int = 0, matcher: Any = None,
            cache_salt: str = "") -> None:
        """Queue a request, ahead of those of lower `priority`. Raises ValueError if `rid` is
        live. An unusable request is not queued: it finishes with "error" at once, its output
        coming from the next postprocess. max_new_tokens 0 computes the prompt only
        (`Sequence.prefill_only`) and finishes with "length" and no token.

        `after` names a live request with the same prompt (n > 1 samples of one prompt):
        this one is held back until that one's prompt is computed, then admitted on the
        prefix cache, sharing its prompt blocks instead of computing them again.

        `matcher`: the grammar's (params.grammar), built by the caller; the model runner feeds
        it every token drawn, and the request stops once it is complete.

        `cache_salt` (vLLM's): the request shares cached prefix blocks only with requests of
        the same salt."""
        seq = Sequence.new(rid, prompt_ids, params, priority, matcher)
        seq.table.root = salt_root(cache_salt)
        self._enqueue(seq, after)

    def add_embed(self, rid: str, prompt_ids: list[int], pooling: str,
                  pool_at: int | None = None) -> None:
        """Queue an embedding request: its prompt is computed (chunked, prefix-cached when
        the pooling allows) and pooled; its one output carries the embedding. "last" pooling
        takes position `pool_at` (default: the last; a classifier's last non-pad token)."""
        self._enqueue(Sequence.new_embed(rid, prompt_ids, pooling, pool_at))

    def _enqueue(self, seq: Sequence, after: str | None = None) -> None:
        if seq.rid in self._live:
            raise ValueError(f"duplicate request id {seq.rid!r}")
        problem = seq.problem(self.max_model_len, self.vocab_size, self.can_generate)
        if problem is not None:
            self._finish(seq, "error")
            self._pending.append(step_output(seq, error=problem))
            return
        self._live[seq.rid] = seq
        leader = self._live.get(after) if after is not None else None
        if leader is not None and leader is not seq and leader.prefilling:
            leader.followers.append(seq)
            seq.held = True
        else:
            self.waiting.push(seq)

    def abort(self, rid: str) -> bool:
        """End a live request; True if found. Waiting: removed now. Running: marked, and
        released (blocks freed) before the next step is planned. Either way one "abort"
        output follows."""
        seq = self._live.get(rid)
        if seq is None or seq.aborted:
            return False
        if seq.status is SequenceStatus.WAITING:
            if seq.held:
                self._unhold(seq)
            else:
                self.waiting.remove(seq)
            self._finish(seq, "abort")
            self._pending.append(step_output(seq))
        else:
            seq.aborted = True
            self._aborting.append(seq)
        return True

    def _unhold(self, seq: Sequence) -> None:
        for leader in self._live.values():
            if seq in leader.followers:
                leader.followers.remove(seq)
        seq.held = False

    def abort_all(self) -> int:
        """Abort every live request; returns how many."""
        return sum(self.abort(rid) for rid in list(self._live))

    def has_work(self) -> bool:
        """Outputs due, aborts to release, or (unless paused) requests to run."""
        return bool(self._pending or self._aborting or (self._live and self.paused is None))

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while any request is live, unless paused
        with none of them holding blocks (after a "retract" pause: they recompute anyway)."""
        if self._live and (self.paused is None or self.running):
            return False
        return self.blocks.reset_prefix_cache()

    # -- pause ------------------------------------------------------------------------------

    def pause(self, mode: str) -> int:
        """Plan no step until resume(); returns how many requests `mode` touched.

        "abort": every live request is aborted (one "abort" output each). "retract": every
        running request goes back to the front of the waiting queue in its order, its blocks
        and row freed, to be recomputed after resume() (its prefix is likely still cached;
        seeded sampling draws the same tokens), so no token is lost or repeated. "in_place":
        requests keep their place and their KV. Requests added while paused wait; aborts still
        work. Pausing again applies the new mode. Not while a plan executes: "retract" frees
        blocks the runner may be writing."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        self.paused = mode
        if mode == "abort":
            return self.abort_all()
        if mode == "in_place":
            return sum(not seq.aborted for seq in self.running)
        return self.retract()

    def resume(self) -> bool:
        """Plan steps again; False if it was not paused."""
        was_paused, self.paused = self.paused is not None, None
        return was_paused

    def retract(self) -> int:
        """Move every running request back to the front of the waiting queue in its order,
        its blocks and row freed, to be recomputed (a "retract" pause without the pause);
        returns how many. Not while a plan executes."""
        self._release_aborted()
        retracted = list(self.running)
        for seq in reversed(retracted):  # each goes first in line: the oldest ends up first
            self._requeue(seq)
        self.totals.retracted += len(retracted)
        return len(retracted)

    def drop_kv(self) -> int:
        """The model's weights are about to change: retract every running request and empty
        the prefix cache, so that no KV computed with the old weights is read again (each
        request recomputes its prompt and the tokens it already has). Returns how many were
        retracted; a pause in force stays. Not while a plan executes."""
        retracted = self.retract()
        if not self.blocks.reset_prefix_cache():  # cannot happen: nothing holds a block
            raise RuntimeError("KV blocks still referenced after retracting every request")
        return retracted

    # -- steps ------------------------------------------------------------------------------

    def schedule(self) -> Plan | None:
        """Pick the next step's work, or None when there is nothing to run (or paused)."""
        self._release_aborted()
        if self.paused is not None:
            return None
        budget = self.max_batched_tokens
        items: list[ScheduledSeq] = []
        scheduled: set[int] = set()
        preempted = False
        # 1. Decodes, oldest first; a decode that needs a block may preempt the newest.
        blocks = self.blocks
        room = blocks.block_size  # slots per block
        running = SequenceStatus.RUNNING
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running:
                continue
            n = len(seq.token_ids)
            computed = seq.num_computed_tokens
            if computed != n - 1 or computed < seq.num_prompt_tokens:
                continue  # not decoding (Sequence.decoding)
            if n <= len(seq.table.blocks) * room:  # its last block has a free slot
                fresh = seq.row_fresh
                seq.row_fresh = False
                items.append(ScheduledSeq(seq, computed, 1, True, fresh))
                scheduled.add(id(seq))
                budget -= 1
                continue
            while not blocks.can_grow(seq.table, seq.num_tokens):
                victim = next(
                    (s for s in reversed(self.running) if id(s) not in scheduled and s is not seq),
                    None,
                )
                self._preempt(victim or seq)
                preempted = True
                if victim is None:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.blocks.grow(seq.table, seq.num_tokens)
            items.append(self._item(seq, 1))
            scheduled.add(id(seq))
            budget -= 1
        # 2. Prompts already admitted: their next chunk (their blocks are all allocated).
        for seq in self.running:
            if budget == 0:
                break
            if id(seq) in scheduled or seq.decoding:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            items.append(self._item(seq, n))
            scheduled.add(id(seq))
            budget -= n
        # 3. Admissions in queue order while blocks, rows and budget last (none if preempted).
        while self.waiting and budget > 0 and not preempted and self.rows.can_allocate():
            seq = self.waiting[0]
            if not self._try_allocate(seq):
                break
            self.waiting.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            items.append(self._item(seq, n))
            budget -= n
        return Plan(items) if items else None

    def _item(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        item = ScheduledSeq(seq, start, n, sample=start + n == seq.num_tokens,
                            reset_row=seq.row_fresh)
        seq.row_fresh = False
        return item

    def _try_allocate(self, seq: Sequence) -> bool:
        """Admit `seq` if its prompt's blocks (minus the cached prefix) are free."""
        bm = self.blocks
        reused, hashes = bm.match_prefix(seq.token_ids,
                                         seq.reusable_prefix if self.prefix_cache else 0,
                                         seq.table.root)
        need = bm.blocks_for(seq.num_tokens) - len(reused)
        if not bm.can_allocate(need + self.watermark_blocks, reused):
            if self.running or not bm.can_allocate(need, reused):
                return False  # alone, it may use the watermark too
        bm.allocate(seq.table, reused, hashes, seq.num_tokens)
        cached = len(reused) * bm.block_size
        seq.num_computed_tokens = cached
        if not seq.admitted_once:
            seq.num_cached_tokens = cached
            self.totals.prompt_tokens += seq.num_prompt_tokens
            self.totals.cached_tokens += cached
        seq.admitted_once = True
        seq.row = self.rows.allocate()
        seq.row_fresh = True
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.num_preemptions += 1
        self.totals.preempted += 1

    def _requeue(self, seq: Sequence) -> None:
        """Free the sequence's blocks and row and put it first in line, to be recomputed."""
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.drop_prompt_logprobs()
        self.waiting.push_front(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.table)
        if seq.row is not None:
            self.rows.free(seq.row)
            seq.row = None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)

    def _release_aborted(self) -> None:
        for seq in self._aborting:
            if seq.status is SequenceStatus.RUNNING:
                self._finish(seq, "abort")
                self._pending.append(step_output(seq))
        self._aborting.clear()

    def postprocess(
        self, plan: Plan | None, results: list[ItemResult] | None, error: str | None = None
    ) -> list[StepOutput]:
        """Take a step's results (one per plan item, or an error for all of them), advance
        and finish sequences, release aborted ones, and return every output due."""
        if plan is not None:
            if results is None or error is not None:
                for item in plan.items:
                    seq = item.seq
                    if seq.status is SequenceStatus.RUNNING and not seq.aborted:
                        self._finish(seq, "error")
                        self._pending.append(step_output(seq, error=error or "no result"))
            else:
                self.totals.steps += 1
                for item, result in zip(plan.items, results, strict=True):
                    self._advance(item, result)
        self._release_aborted()
        outputs, self._pending = self._pending, []
        return outputs

    def _advance(self, item: ScheduledSeq, result: ItemResult) -> None:
        seq = item.seq
        if seq.status is not SequenceStatus.RUNNING or seq.aborted:
            return
        seq.num_computed_tokens = computed = item.start + item.num_tokens
        table = seq.table
        # Only a block just filled is new to the prefix cache (one step in block_size).
        if self.prefix_cache and computed // self.blocks.block_size > len(table.hashes):
            self.blocks.register_full_blocks(table, seq.token_ids, computed)
        if seq.params.return_logprob:
            seq.keep_prompt_logprobs(result)
        if seq.followers and seq.num_computed_tokens >= seq.num_prompt_tokens:
            self.waiting.push_front(*seq.release_followers())  # they share its prompt's KV
        if not item.sample:
            if item.start < seq.num_prompt_tokens:
                self.totals.chunked_prefills += 1
            return
        if seq.embed is not None or seq.prefill_only:  # no token drawn
            self._finish(seq, "stop" if seq.embed is not None else "length")
            out = step_output(seq, result=result)
            out.embedding = result.embedding
            self._pending.append(out)
            return
        if result.token is None:
            raise RuntimeError(f"no token sampled for {seq.rid!r}")
        self._pending.append(self._append(seq, result))

    def _append(self, seq: Sequence, result: ItemResult) -> StepOutput:
        token = result.token
        assert token is not None
        ids = seq.token_ids
        ids.append(token)
        self.totals.generated_tokens += 1
        p = seq.params
        n = len(ids)
        completion = n - seq.num_prompt_tokens
        # min_new_tokens: EOS and stop ids may not be among the first min_new_tokens tokens.
        may_stop = completion > p.min_new_tokens
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop", token)
        elif may_stop and token in p.stop_token_ids:
            self._finish(seq, "stop", token)
        elif result.grammar_end == "done":  # the constrained output is complete
            self._finish(seq, "stop", token if token in self.eos_token_ids else None)
        elif result.grammar_end is not None:
            self._finish(seq, "error")
            return step_output(seq, [token], result, error=result.grammar_end)
        elif completion >= p.max_new_tokens or n >= self.max_model_len:
            self._finish(seq, "length")
        return step_output(seq, [token], result)

    def _finish(self, seq: Sequence, reason: str, matched: int | None = None) -> None:
        """The one place a sequence ends: frees its blocks and row (once) and forgets it."""
        self.waiting.push_front(*seq.release_followers())
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.matched_token = reason, matched
        self._live.pop(seq.rid, None)
        self.totals.finished += 1
        if reason == "abort":
            self.totals.aborted += 1

    def stats(self) -> dict[str, Any]:
        """Load figures, the totals, the pause in force and the KV cache's figures."""
        # Shared blocks are full; only each sequence's last block has unused slots.
        unused = sum(len(s.table.blocks) * self.blocks.block_size - s.num_tokens
                     for s in self.running)
        return {"running": len(self.running), "waiting": len(self.waiting),
                "max_running": self.max_running, "free_slots": self.rows.num_free,
                **self.totals.figures(), "paused": self.paused, **self.blocks.figures(unused)}
