"""The scheduler's engine loop: requests in, engine steps on the engine thread, outputs out.

`EngineLoop` owns what the service keeps per request beside the engine's own state (`Tracked`:
the request's meta, with its route and deadline, sent on whole in its first output's header;
aborts that came before their request) and runs the engine's step,
schedule -> execute -> postprocess, with the forward pass on the engine thread (the executor's
one worker) or, on one CPU, on the event loop itself (placement.py), and all scheduling state
on the event loop. Each step's outputs leave as one batch
per detokenizer, put on a sink (the stream pool to the detokenizers); a request's tokens may
leave in pieces (pacing.py: 50 for one that does not stream, --stream-interval for one that
does). Control calls (flush, pause, weights) queued with `at_step_boundary` run between two
steps, before the next is planned.

No grpc here: error outputs carry `Code` values, and the gRPC servicer (server.py) only calls in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from meshlm.common import deadline
from meshlm.common.logs import get_logger
from meshlm.common.packed import Plain
from meshlm.common.profiling import RequestEvents
from meshlm.common.tracing import context_of, tracer
from meshlm.scheduler import pacing, wire
from meshlm.scheduler.engine.sequence import Plan, StepOutput
from meshlm.scheduler.grammar import Grammars
from meshlm.scheduler.placement import StepPlacement
from meshlm.scheduler.tracked import Code, Tracked
from meshlm.scheduler.watchdog import DEFAULT_STALL_TIMEOUT, EngineWatchdog
from meshlm.v1 import common_pb2, detokenizer_pb2, scheduler_pb2

if TYPE_CHECKING:
    from meshlm.scheduler.engine.engine import Engine, ExecResult

log = get_logger(__name__)

PRE_ABORT_TTL = 60.0  # seconds an abort for a not-yet-seen rid is remembered
EXPIRY_CHECK = 0.05  # seconds between scans for requests past their deadline
# Turns of the event loop after a step run on it, before the next: enough for a send whose
# last write has completed to write again (one turn takes in the completion, the next resumes
# the sender), and for requests that came meanwhile to be admitted.
LOOP_TURNS = 3
MAX_INTAKE_TURNS = 16
ABORTED_ALL = "the request was aborted: every request was (abort_all)"

T = TypeVar("T")


class OutputQueue(Protocol):
    """One detokenizer's queue of outputs (a `BatchedStream`)."""

    async def put(self, items: Iterable[detokenizer_pb2.TokenOutput | Plain]) -> None: ...

    def put_nowait(self, items: Iterable[detokenizer_pb2.TokenOutput | Plain]) -> None: ...


class OutputSink(Protocol):
    """Where outputs go, by detokenizer address (a `StreamPool`)."""

    def get(self, address: str) -> OutputQueue: ...


class EngineLoop:
    """Admits requests into the engine, ends them (aborts, deadlines, the watchdog's forfeits)
    and runs the engine's steps. `address` names this scheduler in refusals (set once the
    server is bound). Everything but the forward pass runs on the event loop."""

    def __init__(self, engine: Engine, executor: ThreadPoolExecutor, sink: OutputSink,
                 events: RequestEvents | None = None, address: str = "",
                 max_queued: int = 1024,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT, stream_interval: int = 1,
                 placement: StepPlacement | None = None,
                 grammars: Grammars | None = None) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.engine = engine
        self.executor = executor  # the engine thread: every torch call but loop steps runs on it
        self.placement = placement or StepPlacement()  # where each forward pass runs
        self.sink = sink
        self.events = events or RequestEvents("scheduler")
        self.address = address
        self.max_queued = max_queued
        self.stream_interval = stream_interval  # tokens per streamed output (pacing.py)
        self.grammars = grammars  # constrained requests' matchers (None: refused)
        self._building: set[asyncio.Task[None]] = set()  # batches whose matchers are building
        self.tracked: dict[str, Tracked] = {}  # live requests, by rid
        self.pre_aborted: dict[str, float] = {}  # rid -> time.monotonic() it is forgotten at
        self.wake = asyncio.Event()
        self._received = 0  # tokenizers' batches submitted so far
        self._tracer = tracer("meshlm.scheduler")
        self._pending: list[StepOutput] = []  # outputs made outside a step (refusals)
        # Control calls awaiting a step boundary, in arrival order.
        self._controls: list[tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any]]] = []
        self._next_expiry_check = 0.0  # time.time() of the next deadline scan
        # Stalled engine or frozen process: requests forfeited; `report` set by serve().
        self.watchdog = EngineWatchdog(stall_timeout, self.forfeit)

    # -- requests in -------------------------------------------------------------------------

    def submit(self, batch: scheduler_pb2.TokenizedBatch) -> None:
        """A tokenizer's batch: each request admitted (or refused), then the loop woken. A
        batch with constrained requests waits for their matchers, built on a worker thread,
        and is then admitted in its order (n samples: the first before the others)."""
        self._received += 1
        self.events.record("recv", (r.meta.rid for r in batch.requests))
        if any(r.meta.sampling.grammar for r in batch.requests):
            task = asyncio.ensure_future(self._submit_constrained(batch))
            self._building.add(task)
            task.add_done_callback(self._building.discard)
            return
        for req in batch.requests:
            self.admit(req)
        self.wake.set()

    async def _submit_constrained(self, batch: scheduler_pb2.TokenizedBatch) -> None:
        grammars = [r.meta.sampling.grammar for r in batch.requests if r.meta.sampling.grammar]
        built: list[Any]
        if self.grammars is None:
            built = ["constrained decoding is not enabled on this scheduler"] * len(grammars)
        else:
            try:
                built = await asyncio.to_thread(self.grammars.build, grammars)
            except Exception as exc:  # never leave the batch unanswered
                log.exception("grammar_build_failed", requests=len(grammars))
                built = [f"the grammar could not be built ({type(exc).__name__})"] * len(grammars)
        matchers = iter(built)
        for req in batch.requests:
            self.admit(req, next(matchers) if req.meta.sampling.grammar else None)
        self.wake.set()

    def admit(self, req: scheduler_pb2.TokenizedRequest, matcher: Any = None) -> None:
        """Track `req` and queue it in the engine, or end it at once: a duplicate rid, a
        stalled engine, an abort that came first, a passed deadline, a full queue, a grammar
        that cannot constrain this tokenizer (`matcher` is then why), or a request the engine
        refuses."""
        meta, prompt_tokens = req.meta, len(req.input_ids)
        rid = meta.rid
        span = self._tracer.start_span(
            "scheduler.request", context=context_of(req.trace),
            attributes={"meshlm.rid": rid, "meshlm.prompt_tokens": prompt_tokens},
        )
        tracked = wire.tracked_of(req, span)
        tracked.hold = pacing.hold_tokens(meta, self.stream_interval)
        if not meta.embed and not self.engine.model_config.has_lm_head:
            tracked.error_code = Code.FAILED_PRECONDITION
        if rid in self.tracked:
            span.end()
            self._refuse_now(tracked, Code.ALREADY_EXISTS,
                             f"rid {rid!r} is already running on this scheduler")
            return
        if self.watchdog.stalled:  # NOT_SERVING: only a request already on its way gets here
            span.end()
            self._refuse_now(tracked, Code.UNAVAILABLE, self.watchdog.reason)
            return
        self.tracked[rid] = tracked
        if self.pre_aborted.pop(rid, None) is not None:
            self._pending.append(_final(rid, prompt_tokens, "abort"))
            return
        refusal = self._refusal(meta)
        if refusal is None and isinstance(matcher, str):
            refusal = (Code.INVALID_ARGUMENT,
                       f"sampling_params.grammar: the output constraint cannot be followed: "
                       f"{matcher}")
        if refusal is not None:
            tracked.error_code, message = refusal
            self._pending.append(_final(rid, prompt_tokens, "error", message))
            return
        try:
            if meta.embed:
                self.engine.add_embed_request(rid, list(req.input_ids))
            else:
                self.engine.add_request(rid, list(req.input_ids),
                                        wire.engine_params(meta.sampling, req.bad_words,
                                                           wire.thinking_tags(req)),
                                        after=meta.after or None,
                                        priority=meta.priority, matcher=matcher,
                                        cache_salt=meta.cache_salt)
        except ValueError as exc:
            self._pending.append(_final(rid, prompt_tokens, "error", str(exc)))

    def _refusal(self, meta: common_pb2.RequestMeta) -> tuple[Code, str] | None:
        """Why a request cannot be queued now: its deadline has passed, or the waiting queue
        is full (bounded admission: the client is told at once rather than queued without
        end)."""
        if deadline.passed(meta.deadline):
            return (Code.DEADLINE_EXCEEDED,
                    "the client's deadline passed before the request reached the scheduler")
        waiting = self.engine.num_waiting
        if waiting >= self.max_queued:
            return (Code.RESOURCE_EXHAUSTED,
                    f"the scheduler at {self.address} has {waiting} requests waiting (limit "
                    f"{self.max_queued}); retry later")
        return None

    def _refuse_now(self, tracked: Tracked, code: Code, message: str) -> None:
        """Answer an untracked request on its own route at once, not from the engine loop: a
        duplicate (the running request keeps the rid), or one that reaches a stalled engine."""
        tracked.error_code = code
        out = wire.token_output(
            _final(tracked.meta.rid, tracked.prompt_tokens, "error", message), tracked)
        self.sink.get(tracked.detokenizer).put_nowait([out])

    # -- requests ended ----------------------------------------------------------------------

    def abort(self, rids: Sequence[str], every: bool = False, reason: str = "abort") -> int:
        """End the live requests `rids` (`every`: all of them); returns how many the engine
        still had. A rid not seen yet is remembered for PRE_ABORT_TTL seconds and ends as soon
        as it arrives. `reason` "stop": finished elsewhere (a stop string), so the abort output
        is not sent."""
        rids = list(self.tracked) if every else list(rids)
        aborted = 0
        now = time.monotonic()
        for rid in rids:
            tracked = self.tracked.get(rid)
            if tracked is None:
                if not every:
                    self.pre_aborted[rid] = now + PRE_ABORT_TTL
                continue
            if reason == "stop":
                tracked.silent = True
            if self.engine.abort(rid):
                aborted += 1
                tracked.cancelled = every  # its abort output (not yet sent) says CANCELLED
        for rid in [r for r, t in self.pre_aborted.items() if t < now]:
            del self.pre_aborted[rid]
        self.wake.set()
        log.info("abort", rids=len(rids), all=every, aborted=aborted, reason=reason)
        return aborted

    def _expire(self) -> float | None:
        """Abort the live requests whose deadline has passed (they end DEADLINE_EXCEEDED, KV
        freed); at most every EXPIRY_CHECK seconds. Returns the seconds until the next live
        deadline (None: none), so an idle (paused) loop wakes for it."""
        now = time.time()
        if now < self._next_expiry_check:
            return self._next_expiry_check - now
        self._next_expiry_check = now + EXPIRY_CHECK
        soonest = None
        for rid, tracked in self.tracked.items():
            due = tracked.meta.deadline
            if not due or tracked.expired:
                continue
            if due <= now:
                tracked.expired = True
                self.engine.abort(rid)
            elif soonest is None or due < soonest:
                soonest = due
        return None if soonest is None else max(soonest - now, EXPIRY_CHECK)

    def forfeit(self, reason: str, only: Callable[[Tracked], bool] | None = None) -> int:
        """Give up every live request (the watchdog's answer to a stall or a freeze), or those
        `only` picks: each is aborted in the engine and ends with an UNAVAILABLE error saying
        `reason`. Returns how many."""
        count = 0
        for rid, tracked in self.tracked.items():
            if tracked.forfeit or tracked.silent or tracked.expired:
                continue
            if only is not None and not only(tracked):
                continue
            tracked.forfeit = reason
            self.engine.abort(rid)
            count += 1
        self.wake.set()
        return count

    def detokenizer_lost(self, address: str) -> int:
        """The stream to the detokenizer at `address` failed (`BatchedStream.on_lost`) while
        the detokenizer may still serve: outputs on it are gone, and which is not known, so
        each request whose outputs went there ends UNAVAILABLE now (a lost final would leave
        it waiting for ever, a lost token would leave a hole in its text). Its end carries its
        header again, for a detokenizer that never had it. Requests with no output yet lost
        nothing and go on. Returns how many ended."""
        def sent_there(tracked: Tracked) -> bool:
            if tracked.detokenizer != address or not tracked.header_sent:
                return False
            tracked.header_sent = False
            return True
        count = self.forfeit(f"the stream to the detokenizer at {address} was lost", sent_there)
        log.warning("detokenizer_lost", detokenizer=address, requests=count)
        return count

    # -- control calls -----------------------------------------------------------------------

    async def between_steps(self, action: Callable[[], T], timeout: float | None) -> T:
        """Run `action` on the event loop between two steps (no plan in flight), after the
        control calls queued before it; TimeoutError if the loop does not get there within
        `timeout` seconds (None: no limit)."""
        async def run() -> T:
            return action()

        return await self.at_step_boundary(run, timeout)

    async def at_step_boundary(self, action: Callable[[], Awaitable[T]],
                               timeout: float | None) -> T:
        """`between_steps` for an async action: the loop awaits it before planning the next
        step (so no step runs meanwhile), and `timeout` covers the wait and the action. An
        action not yet started when its caller gives up does not run; one started runs to its
        end."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._controls.append((action, done))
        self.wake.set()
        return await asyncio.wait_for(done, timeout)

    async def on_engine_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the engine thread (between steps: a step's forward pass runs there)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _run_controls(self) -> None:
        """Run the queued control calls (event loop, no plan in flight)."""
        controls, self._controls = self._controls, []
        for action, done in controls:
            if done.done():  # its caller gave up
                continue
            try:
                result = await action()
            except Exception as exc:  # noqa: BLE001 - the caller's error, not the loop's
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(result)

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Step the engine for ever (cancel to stop). A step's outputs are sent while the next
        step computes on the engine thread: it does not wait for the event loop's encoding and
        sending, which needs no engine state. A step run on the loop instead (placement.py)
        has its outputs sent before the next."""
        unsent: list[StepOutput] = []
        while True:
            # 1. sleep until there is work or a deadline to enforce; between steps, run control
            # calls (flush, pause)
            next_deadline = self._expire()
            if (not self.engine.has_work() and not self._pending and not self._controls
                    and not unsent):
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), next_deadline)
            if self._controls:
                await self._run_controls()
            # 2. plan on the loop thread, start the forward pass on the engine thread (or run it
            # here: placement.py)
            plan = self.engine.schedule()
            here = plan is not None and self.placement.on_loop(plan.num_tokens)
            if here and unsent:  # the last step ran on the engine thread: its outputs first
                await self._emit(unsent)
                unsent = []
                await self._turns()
            step: asyncio.Future[tuple[ExecResult, float]] | None = None
            result = None
            if plan is not None:
                self.watchdog.step_started()
                if here:
                    result = self._execute(plan)
                else:
                    step = asyncio.ensure_future(self.on_engine_thread(self._execute, plan))
            # 3. meanwhile, send the previous step's outputs
            if unsent:
                await self._emit(unsent)
            if step is not None:
                result = await step
            if plan is not None and result is not None:
                await self.watchdog.step_finished()
                self.placement.observe(result[1], plan.num_tokens)
            # 4. fold results back; their outputs leave during the next step (or now, when the
            # step ran here)
            unsent = self._pending + self.engine.postprocess(
                plan, None if result is None else result[0])
            self._pending = []
            if here:
                await self._emit(unsent)
                unsent = []
                await self._turns()
            elif not unsent and plan is None:
                await asyncio.sleep(0)

    def _execute(self, plan: Plan) -> tuple[ExecResult, float]:
        """The forward pass (either thread), and the seconds it took."""
        start = time.perf_counter()
        result = self.engine.execute(plan)
        return result, time.perf_counter() - start

    async def _turns(self) -> None:
        """Let the event loop run (sends, new requests) before the next step holds it; while
        tokenizers' batches keep coming in (a burst of requests), a few turns more, so that
        the next step admits them rather than one batch a step."""
        seen = self._received
        for _ in range(LOOP_TURNS):
            await asyncio.sleep(0)
        for _ in range(MAX_INTAKE_TURNS):
            if self._received == seen:
                return
            seen = self._received
            await asyncio.sleep(0)  # the next read's completion comes in
            await asyncio.sleep(0)  # and its batch is submitted

    async def _emit(self, outputs: list[StepOutput]) -> None:
        """Outputs -> one batch per detokenizer; a request's end also ends its tracking (and
        becomes the error its expiry or forfeit calls for)."""
        by_detokenizer: dict[str, list[detokenizer_pb2.TokenOutput | Plain]] = {}
        now = time.time()
        tracked_of = self.tracked.get
        for out in outputs:
            tracked = tracked_of(out.rid)
            if tracked is None:
                continue
            if (not out.finished and tracked.header_sent and tracked.hold <= 1
                    and not tracked.forfeit and not tracked.return_logprob
                    and out.embedding is None):
                item: detokenizer_pb2.TokenOutput | Plain = wire.plain_item(out)
            else:  # its first output or its last, held, logprobs, an embedding, given up
                other = self._item(out, tracked, now)
                if other is None:
                    continue
                item = other
            by_detokenizer.setdefault(tracked.detokenizer, []).append(item)
        for address, items in by_detokenizer.items():
            await self.sink.get(address).put(items)

    def _item(self, out: StepOutput, tracked: Tracked, now: float
              ) -> detokenizer_pb2.TokenOutput | Plain | None:
        """What `_emit` sends of any output but a running request's plain next tokens; None
        when nothing leaves now (held back, given up, finished elsewhere)."""
        if out.new_token_ids and tracked.first_token_at is None:
            tracked.first_token_at = now
            tracked.span.add_event("first_token")
            self.events.record("first", out.rid)
        if out.finished and tracked.expired and out.finish_reason == "abort":
            tracked.error_code = Code.DEADLINE_EXCEEDED
            out = dataclasses.replace(out, finish_reason="error", error=(
                f"the client's deadline passed after {out.completion_tokens} tokens"))
        elif tracked.forfeit and not out.finished:
            return None  # nobody waits for its tokens: only its end is sent
        elif tracked.forfeit and out.finish_reason == "abort":
            tracked.error_code = Code.UNAVAILABLE
            out = dataclasses.replace(out, finish_reason="error", error=tracked.forfeit)
        elif tracked.cancelled and out.finish_reason == "abort":
            # Still an "abort" finish; the status says why, for the gateway's gRPC
            # streams to end CANCELLED (HTTP keeps the finish_reason).
            tracked.error_code = Code.CANCELLED
            out = dataclasses.replace(out, error=ABORTED_ALL)
        if tracked.hold > 1:
            due = pacing.release(tracked, out)
            if due is None:
                return None  # held back, to leave with the next tokens
            out = due
        if out.finished:
            self.events.record("finish", out.rid)
            del self.tracked[out.rid]
            tracked.span.set_attribute("meshlm.finish_reason", out.finish_reason or "")
            tracked.span.set_attribute("meshlm.completion_tokens", out.completion_tokens)
            tracked.span.end()
            if tracked.silent:
                return None
        return wire.token_item(out, tracked)

    def close(self) -> None:
        self.watchdog.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


def _final(rid: str, prompt_tokens: int, reason: str, error: str | None = None) -> StepOutput:
    """A request's end without a step: no token, nothing computed."""
    return StepOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=reason,
                      matched_token=None, prompt_tokens=prompt_tokens, completion_tokens=0,
                      cached_tokens=0, error=error)
