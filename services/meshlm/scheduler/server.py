"""Scheduler service: the engine behind a gRPC face.

Tokenizers stream requests in (Submit); an engine loop runs schedule -> execute -> postprocess
(the forward pass in a worker thread, all scheduling state on the event loop), and each step's
outputs leave as one TokenBatch per detokenizer. Abort ends requests between steps; FlushCache,
Pause, Continue and UpdateWeights run between steps too (the engine loop runs them before
planning the next).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import trace

from meshlm.common import config as cfg
from meshlm.common import deadline
from meshlm.common.logs import get_logger
from meshlm.common.metrics import SchedulerMetrics
from meshlm.common.profiling import Profiling, profiler_binding
from meshlm.common.roles import MESH_PORTS
from meshlm.common.server import Binding, GrpcServer
from meshlm.common.service import (
    MeshPeers,
    ServiceConfig,
    advertised,
    model_info_json,
    resolve_model_path,
    serve_until_signal,
)
from meshlm.common.streams import StreamPool
from meshlm.common.tracing import carrier_of, context_of, tracer
from meshlm.scheduler.control import ControlRPCs
from meshlm.scheduler.engine.engine import Engine, EngineConfig, SamplingParams, StepOutput
from meshlm.scheduler.torch_trace import EngineTorchTrace
from meshlm.scheduler.watchdog import DEFAULT_STALL_TIMEOUT, EngineWatchdog
from meshlm.scheduler.wire import engine_params, fill_logprobs, has_logprobs
from meshlm.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2
from meshlm.v1 import scheduler_pb2_grpc as pb_grpc

log = get_logger(__name__)

PRE_ABORT_TTL = 60.0  # seconds an abort for a not-yet-seen rid is remembered
EXPIRY_CHECK = 0.05  # seconds between scans for requests past their deadline

@dataclass
class SchedulerConfig(ServiceConfig):
    """meshlm scheduler service (the engine)."""

    port: int = cfg.field(MESH_PORTS["scheduler"],
                          "mesh gRPC port (mutual TLS); 0 picks a free port")
    model_path: str = cfg.field("", "checkpoint directory (HF layout); empty = embedded default")
    device: str = cfg.field("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = cfg.field("auto", "auto | float32 | bfloat16 | float16")
    load_format: str = cfg.field("auto", "auto | safetensors | dummy (random weights from "
                                         "config.json)")
    max_running: int = cfg.field(64, "requests in the running batch")
    max_batched_tokens: int = cfg.field(2048, "tokens per engine step (decodes + prompt "
                                              "chunks); longer prompts are chunked")
    max_model_len: int = cfg.field(0, "context length; 0 = the checkpoint's")
    block_size: int = cfg.field(16, "tokens per KV cache block")
    kv_cache_bytes: int = cfg.field(0, "KV cache budget in bytes; 0 = auto (CUDA: "
                                       "mem-fraction; CPU: max-running full sequences, <= 2 GiB)")
    num_kv_blocks: int = cfg.field(0, "KV cache blocks; overrides kv-cache-bytes when set")
    mem_fraction: float = cfg.field(0.85, "CUDA: share of device memory for weights + KV")
    prefix_cache: bool = cfg.field(True, "reuse the KV of shared prompt prefixes")
    packed_linears: bool = cfg.field(True, "CPU: pack the decoder's weights once for oneDNN "
                                           "(faster small batches)")
    num_threads: int = cfg.field(0, "torch CPU threads; 0 = torch's default")
    max_queued: int = cfg.field(1024, "requests waiting for a running slot; beyond it a new "
                                      "request ends at once with RESOURCE_EXHAUSTED")
    stall_timeout: float = cfg.field(DEFAULT_STALL_TIMEOUT,
                                     "seconds one engine step may run before the scheduler "
                                     "counts as stalled (NOT_SERVING, its requests end "
                                     "UNAVAILABLE) until the step returns; must exceed the "
                                     "longest step (a --max-batched-tokens prompt chunk; large "
                                     "models on CPU need more); 0 = off")


@dataclass
class Tracked:
    """What the service keeps per request beside the engine's own state."""

    route: common_pb2.Route
    return_text: bool
    stop: list[str]
    skip_special_tokens: bool
    prompt_tokens: int
    span: trace.Span
    header_sent: bool = False
    silent: bool = False  # finished elsewhere (stop string): its abort output is not sent
    first_token_at: float | None = None
    return_text_in_logprobs: bool = False
    prompt_ids: list[int] = field(default_factory=list)  # kept until prompt logprobs are sent
    # Status code of an engine refusal: a generation request to an embedding-only model is
    # FAILED_PRECONDITION (the model cannot do it), any other refusal INVALID_ARGUMENT.
    error_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    deadline: float = 0.0  # unix seconds the client waits until; 0 = none
    expired: bool = False  # aborted because the deadline passed: ends DEADLINE_EXCEEDED
    forfeit: str = ""  # given up by the watchdog (why): ends UNAVAILABLE


@dataclass
class SchedulerState:
    tracked: dict[str, Tracked] = field(default_factory=dict)
    pre_aborted: dict[str, float] = field(default_factory=dict)


class SchedulerServicer(ControlRPCs, pb_grpc.SchedulerServicer):
    def __init__(self, engine: Engine, executor: ThreadPoolExecutor,
                 outputs: StreamPool[detokenizer_pb2.TokenOutput],
                 info: common_pb2.ModelInfo, address: str, max_queued: int = 1024,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self.outputs = outputs
        self.info = info
        self.address = address
        self.state = SchedulerState()
        self.wake = asyncio.Event()
        self._tracer = tracer("meshlm.scheduler")
        self._executor = executor
        self.profiling = Profiling("scheduler", EngineTorchTrace(executor))
        self._pending: list[StepOutput] = []  # outputs made outside a step (refusals)
        # Control calls (FlushCache, Pause, Continue, UpdateWeights) awaiting a step boundary,
        # in arrival order.
        self._controls: list[tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any]]] = []
        self._updating = asyncio.Lock()  # one weight update at a time, in arrival order
        self._next_expiry_check = 0.0  # time.time() of the next deadline scan
        # Stalled engine or frozen process: requests forfeited; `report` set by serve().
        self.watchdog = EngineWatchdog(stall_timeout, self.forfeit)

    # -- requests in -------------------------------------------------------------------------

    async def Submit(self, request_iterator: AsyncIterator[scheduler_pb2.TokenizedBatch],
                     context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        events = self.profiling.events
        async for batch in request_iterator:
            events.record("recv", (r.rid for r in batch.requests))
            for req in batch.requests:
                self._admit(req)
            self.wake.set()
        return common_pb2.Empty()

    def _admit(self, req: scheduler_pb2.TokenizedRequest) -> None:
        span = self._tracer.start_span(
            "scheduler.request", context=context_of(req.trace),
            attributes={"meshlm.rid": req.rid, "meshlm.prompt_tokens": len(req.input_ids)},
        )
        tracked = Tracked(
            route=req.route, return_text=req.return_text, stop=list(req.sampling.stop),
            skip_special_tokens=req.sampling.skip_special_tokens,
            prompt_tokens=len(req.input_ids), span=span,
            return_text_in_logprobs=req.sampling.return_text_in_logprobs,
            deadline=req.deadline,
        )
        if req.sampling.return_logprob and req.sampling.logprob_start_len >= 0:
            tracked.prompt_ids = list(req.input_ids)
        if not req.embed and not self.engine.model_config.has_lm_head:
            tracked.error_code = grpc.StatusCode.FAILED_PRECONDITION
        if req.rid in self.state.tracked:
            span.end()
            self._refuse_now(req, tracked, grpc.StatusCode.ALREADY_EXISTS,
                             f"rid {req.rid!r} is already running on this scheduler")
            return
        if self.watchdog.stalled:  # NOT_SERVING: only a request already on its way gets here
            span.end()
            self._refuse_now(req, tracked, grpc.StatusCode.UNAVAILABLE, self.watchdog.reason)
            return
        self.state.tracked[req.rid] = tracked
        if self.state.pre_aborted.pop(req.rid, None) is not None:
            self._pending.append(_final(req.rid, len(req.input_ids), "abort"))
            return
        refusal = self._refusal(req)
        if refusal is not None:
            tracked.error_code, message = refusal
            self._pending.append(_final(req.rid, len(req.input_ids), "error", message))
            return
        try:
            if req.embed:
                self.engine.add_embed_request(req.rid, list(req.input_ids))
            else:
                self.engine.add_request(req.rid, list(req.input_ids), engine_params(req.sampling),
                                        after=req.after or None)
        except ValueError as exc:
            self._pending.append(_final(req.rid, len(req.input_ids), "error", str(exc)))

    def _refusal(self, req: scheduler_pb2.TokenizedRequest
                 ) -> tuple[grpc.StatusCode, str] | None:
        """Why a request cannot be queued now: its deadline has passed, or the waiting queue
        is full (bounded admission: the client is told at once rather than queued without
        end)."""
        if deadline.passed(req.deadline):
            return (grpc.StatusCode.DEADLINE_EXCEEDED,
                    "the client's deadline passed before the request reached the scheduler")
        waiting = self.engine.num_waiting
        if waiting >= self.max_queued:
            return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the scheduler at {self.address} has {waiting} requests waiting (limit "
                    f"{self.max_queued}); retry later")
        return None

    def _expire(self) -> float | None:
        """Abort the live requests whose deadline has passed (they end DEADLINE_EXCEEDED, KV
        freed); at most every EXPIRY_CHECK seconds. Returns the seconds until the next live
        deadline (None: none), so an idle (paused) loop wakes for it."""
        now = time.time()
        if now < self._next_expiry_check:
            return self._next_expiry_check - now
        self._next_expiry_check = now + EXPIRY_CHECK
        soonest = None
        for rid, tracked in self.state.tracked.items():
            if not tracked.deadline or tracked.expired:
                continue
            if tracked.deadline <= now:
                tracked.expired = True
                self.engine.abort(rid)
            elif soonest is None or tracked.deadline < soonest:
                soonest = tracked.deadline
        return None if soonest is None else max(soonest - now, EXPIRY_CHECK)

    def _refuse_now(self, req: scheduler_pb2.TokenizedRequest, tracked: Tracked,
                    code: grpc.StatusCode, message: str) -> None:
        """Answer an untracked request on its own route at once, not from the engine loop: a
        duplicate (the running request keeps the rid), or one that reaches a stalled engine."""
        out = _to_pb(_final(req.rid, len(req.input_ids), "error", message), tracked)
        out.error.code = code.value[0]
        self.outputs.get(tracked.route.detokenizer).put_nowait([out])

    def forfeit(self, reason: str) -> int:
        """Give up every live request (the watchdog's answer to a stall or a freeze): each is
        aborted in the engine and ends with an UNAVAILABLE error saying `reason`. Returns how
        many."""
        count = 0
        for rid, tracked in self.state.tracked.items():
            if tracked.forfeit or tracked.silent or tracked.expired:
                continue
            tracked.forfeit = reason
            self.engine.abort(rid)
            count += 1
        self.wake.set()
        return count

    # -- control -----------------------------------------------------------------------------

    async def Abort(self, request: scheduler_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.AbortResponse:
        rids = list(self.state.tracked) if request.all else list(request.rids)
        aborted = 0
        now = time.monotonic()
        for rid in rids:
            tracked = self.state.tracked.get(rid)
            if tracked is None:
                if not request.all:
                    self.state.pre_aborted[rid] = now + PRE_ABORT_TTL
                continue
            if request.reason == "stop":
                tracked.silent = True
            if self.engine.abort(rid):
                aborted += 1
        self._expire_pre_aborts(now)
        self.wake.set()
        log.info("abort", rids=len(rids), all=request.all, aborted=aborted, reason=request.reason)
        return scheduler_pb2.AbortResponse(aborted=aborted)

    def _expire_pre_aborts(self, now: float) -> None:
        for rid in [r for r, t in self.state.pre_aborted.items() if t < now]:
            del self.state.pre_aborted[rid]

    async def GetLoad(self, request: scheduler_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> scheduler_pb2.Load:

        s = self.engine.stats()
        return scheduler_pb2.Load(
            address=self.address, running=s["running"], waiting=s["waiting"],
            max_running=s["max_running"], finished_total=s["finished_total"],
            aborted_total=s["aborted_total"], generated_tokens_total=s["generated_tokens_total"],
            token_usage=s["token_usage"], json_info=json.dumps(s),
        )

    async def GetInfo(self, request: common_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return self.info

    # -- the engine loop ---------------------------------------------------------------------

    async def run_engine(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # 1. sleep until there is work or a deadline to enforce; between steps, run control
            # calls (flush, pause)
            next_deadline = self._expire()
            if not self.engine.has_work() and not self._pending and not self._controls:
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), next_deadline)
            if self._controls:
                await self._run_controls()
            # 2. plan on the loop thread, run the forward pass in the engine thread
            plan = self.engine.schedule()
            result = None
            if plan is not None:
                self.watchdog.step_started()
                result = await loop.run_in_executor(self._executor, self.engine.execute, plan)
                await self.watchdog.step_finished()
            # 3. fold results back, then send this step's outputs
            outputs = self._pending + self.engine.postprocess(plan, result)
            self._pending = []
            if outputs:
                await self._emit(outputs)
            elif plan is None:
                await asyncio.sleep(0)

    async def _emit(self, outputs: list[StepOutput]) -> None:
        by_detokenizer: dict[str, list[detokenizer_pb2.TokenOutput]] = {}
        now = time.time()
        events = self.profiling.events
        for out in outputs:
            tracked = self.state.tracked.get(out.rid)
            if tracked is None:
                continue
            if out.new_token_ids and tracked.first_token_at is None:
                tracked.first_token_at = now
                tracked.span.add_event("first_token")
                events.record("first", out.rid)
            if out.finished and tracked.expired and out.finish_reason == "abort":
                tracked.error_code = grpc.StatusCode.DEADLINE_EXCEEDED
                out = dataclasses.replace(out, finish_reason="error", error=(
                    f"the client's deadline passed after {out.completion_tokens} tokens"))
            elif tracked.forfeit and not out.finished:
                continue  # nobody waits for its tokens: only its end is sent
            elif tracked.forfeit and out.finish_reason == "abort":
                tracked.error_code = grpc.StatusCode.UNAVAILABLE
                out = dataclasses.replace(out, finish_reason="error", error=tracked.forfeit)
            if out.finished:
                events.record("finish", out.rid)
                del self.state.tracked[out.rid]
                tracked.span.set_attribute("meshlm.finish_reason", out.finish_reason or "")
                tracked.span.set_attribute("meshlm.completion_tokens", out.completion_tokens)
                tracked.span.end()
                if tracked.silent:
                    continue
            by_detokenizer.setdefault(tracked.route.detokenizer, []).append(_to_pb(out, tracked))
        for address, items in by_detokenizer.items():
            await self.outputs.get(address).put(items)

    def close(self) -> None:
        self.watchdog.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _final(rid: str, prompt_tokens: int, reason: str, error: str | None = None) -> StepOutput:
    return StepOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=reason,
                      matched_token=None, prompt_tokens=prompt_tokens, completion_tokens=0,
                      cached_tokens=0, error=error)


def _to_pb(out: StepOutput, tracked: Tracked) -> detokenizer_pb2.TokenOutput:
    """StepOutput -> wire; the first output of a request carries its header."""
    msg = detokenizer_pb2.TokenOutput(
        rid=out.rid, token_ids=out.new_token_ids, finished=out.finished,
        finish_reason=out.finish_reason or "", prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
    )
    if out.matched_token is not None:
        msg.matched_token = out.matched_token
    if out.error is not None:
        msg.error.code = tracked.error_code.value[0]
        msg.error.message = out.error
    if out.embedding is not None:
        msg.embedding.extend(out.embedding)
    if has_logprobs(out):
        fill_logprobs(msg.logprobs, out, tracked.prompt_ids)
        if out.input_logprobs:
            tracked.prompt_ids = []
    if not tracked.header_sent:
        tracked.header_sent = True
        msg.header.route.CopyFrom(tracked.route)
        msg.header.stop.extend(tracked.stop)
        msg.header.skip_special_tokens = tracked.skip_special_tokens
        msg.header.return_text = tracked.return_text
        msg.header.prompt_tokens = tracked.prompt_tokens
        msg.header.return_text_in_logprobs = tracked.return_text_in_logprobs
        msg.header.trace.update(carrier_of(tracked.span))
    return msg


def _warm_up(engine: Engine) -> None:
    """One tiny request before SERVING, so the first client does not pay for torch's
    first-call set-up (hundreds of ms on CPU)."""
    if engine.model_config.has_lm_head:
        engine.add_request("meshlm-warm-up", [0, 1, 2, 3], SamplingParams(
            temperature=0.0, max_new_tokens=2, ignore_eos=True))
    else:
        engine.add_embed_request("meshlm-warm-up", [0, 1, 2, 3])
    while engine.has_work():
        engine.step()


async def serve(config: SchedulerConfig) -> None:
    model_path = resolve_model_path(config.model_path)
    # Every torch call happens on this one thread, the engine's: the model is built here too.
    # (Torch from a second thread brings a second OpenMP pool whose spinning workers halve the
    # speed of both on a small machine.)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    engine = await asyncio.get_running_loop().run_in_executor(executor, Engine, EngineConfig(
        model_path=model_path, device=config.device, dtype=config.dtype,
        load_format=config.load_format, max_running=config.max_running,
        max_batched_tokens=config.max_batched_tokens,
        max_model_len=config.max_model_len or None, num_threads=config.num_threads or None,
        block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
        kv_cache_bytes=config.kv_cache_bytes, mem_fraction=config.mem_fraction,
        enable_prefix_cache=config.prefix_cache, packed_cpu_linears=config.packed_linears,
    ))
    await asyncio.get_running_loop().run_in_executor(executor, _warm_up, engine)
    peers = MeshPeers(config)
    outputs: StreamPool[detokenizer_pb2.TokenOutput] = peers.stream_pool(
        "scheduler->detokenizer", "detokenizer",
        lambda ch: detokenizer_pb2_grpc.DetokenizerStub(ch).Push,
        lambda items: detokenizer_pb2.TokenBatch(outputs=items))
    info = common_pb2.ModelInfo(
        model_path=model_path, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
        eos_token_ids=sorted(engine.eos_token_ids),
        json_info=model_info_json(model_path, {"device": str(engine.device),
                                               "max_running": config.max_running}),
    )
    servicer = SchedulerServicer(engine, executor, outputs, info, "", config.max_queued,
                                 config.stall_timeout)
    server = GrpcServer([Binding(pb_grpc.add_SchedulerServicer_to_server, servicer,
                                 "meshlm.v1.Scheduler"), profiler_binding(servicer.profiling)])
    bound = await server.start(config.host, config.port, peers.tls.server_credentials())
    servicer.address = advertised(config, bound)
    servicer.watchdog.report = server.set_serving
    engine_task = asyncio.create_task(servicer.run_engine(), name="engine")
    metrics = SchedulerMetrics(Path(model_path).name, engine.stats)
    await serve_until_signal(server, config, bound, watch=engine_task, metrics=metrics,
                             on_stop=servicer.watchdog.stop,
                             model_path=model_path, device=str(engine.device),
                             max_running=config.max_running, stall_timeout=config.stall_timeout,
                             role="scheduler")
    engine_task.cancel()
    servicer.close()
    await peers.close()
