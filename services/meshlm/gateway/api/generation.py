"""The public API's behaviour, one method per SglangService RPC, shared by gRPC and HTTP.

Handlers take (request, CallContext) and return a response or yield a stream of them; they
raise MeshError for every failure. The gRPC servicer and the HTTP routes are thin adapters.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

import grpc

from meshlm.common import deadline
from meshlm.common.channels import ChannelPool
from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.common.metrics import GatewayMetrics
from meshlm.common.profiling import Profiling
from meshlm.common.rpc import CallContext
from meshlm.common.streams import BatchedStream
from meshlm.common.tasks import BackgroundTasks
from meshlm.common.tracing import carrier_of, tracer
from meshlm.gateway.api.admin import AdminRPCs
from meshlm.gateway.api.info import GatewayIdentity, InfoRPCs
from meshlm.gateway.api.openai import OpenAIRPCs
from meshlm.gateway.api.pause import PauseRPCs
from meshlm.gateway.api.profile import ProfileRPCs
from meshlm.gateway.api.scoring import ScoringRPCs
from meshlm.gateway.api.weights import WeightsRPCs
from meshlm.gateway.mesh.dependencies import Dependencies
from meshlm.gateway.mesh.inbox import PendingRequest, RequestTable, Update, next_updates
from meshlm.gateway.mesh.loads import LoadPoller
from meshlm.gateway.mesh.registry import RidRegistry
from meshlm.gateway.mesh.routing import Router, affinity_key
from meshlm.gateway.mesh.wire import tokenizer_request
from meshlm.gateway.protocol.bounds import Bounds
from meshlm.gateway.protocol.choices import Child, Choices, fan_out
from meshlm.gateway.protocol.logprob_meta import logprob_meta
from meshlm.gateway.protocol.validation import (
    Limits,
    ValidatedRequest,
    check_batch,
    check_prompt_chars,
    validate_detokenize,
    validate_embed,
    validate_generate,
    validate_text_embed,
    validate_text_generate,
    validate_tokenize,
)
from meshlm.v1 import (
    common_pb2,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

R = TypeVar("R")

CONTROL_TIMEOUT = 10.0  # seconds for internal unary calls


class GatewayAPI(InfoRPCs, AdminRPCs, OpenAIRPCs, ScoringRPCs, PauseRPCs, ProfileRPCs,
                 WeightsRPCs):
    def __init__(self, identity: GatewayIdentity, deps: Dependencies, table: RequestTable,
                 registry: RidRegistry, channels: ChannelPool,
                 submit_streams: dict[str, BatchedStream[tokenizer_pb2.GenerateRequest]],
                 metrics: GatewayMetrics | None = None, bounds: Bounds | None = None) -> None:
        self.identity = identity
        self.bounds = bounds or Bounds()  # size bounds checked before any work (protocol/bounds.py)
        self.max_inflight = self.bounds.max_inflight  # requests (each sample counts) here
        self.metrics = metrics or GatewayMetrics(lambda: identity.served_model_name)
        self.profiling = Profiling("gateway")
        self.deps = deps
        self.table = table
        self.registry = registry
        self.channels = channels
        self.submit = submit_streams
        self.info: common_pb2.ModelInfo | None = None
        self._tracer = tracer("meshlm.gateway")
        self.background = BackgroundTasks()
        self.router = Router()
        self.loads = LoadPoller(channels, lambda: deps.serving("scheduler"))

    # -- readiness ---------------------------------------------------------------------------

    async def refresh_info(self) -> None:
        """Fetch model facts from a tokenizer (limits for validation, model cards)."""
        address = self.deps.pick("tokenizer")
        if address is None:
            return
        stub = tokenizer_pb2_grpc.TokenizerStub(self.channels.get(address))
        try:
            self.info = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=CONTROL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            log.warning("model_info_failed", tokenizer=address, error=exc.details())

    async def _limits(self) -> Limits:
        if self.info is None:
            await self.refresh_info()
        if self.info is None or not self.deps.ready:
            raise MeshError(grpc.StatusCode.UNAVAILABLE,
                            f"not ready: waiting for {self.missing() or 'model info'}")
        return self._limits_of(self.info)

    def _limits_of(self, info: common_pb2.ModelInfo) -> Limits:
        return Limits(max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                      max_prompt_chars=self.bounds.prompt_chars(info.max_model_len),
                      max_batch=self.bounds.batch)

    def missing(self) -> str:
        """The roles with no SERVING replica, for log lines and UNAVAILABLE messages."""
        missing = [role for role in ("tokenizer", "scheduler", "detokenizer")
                   if not self.deps.serving(role)]
        return ", ".join(f"a serving {role}" for role in missing)

    def _pick(self, role: str) -> str:
        address = self.deps.pick(role)
        if address is None:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, f"no {role} is available")
        return address

    def _pick_scheduler(self, v: ValidatedRequest) -> str:
        """The replica asked for (routed_dp_rank), else the router's choice
        (`mesh/routing.py`: prefix or routing_key affinity, weighed against load)."""
        live = self.deps.serving("scheduler")
        if v.dp_rank is not None:
            ranks = self.deps.addresses["scheduler"]
            if v.dp_rank >= len(ranks):
                raise MeshError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"routed_dp_rank: must be in [0, {len(ranks)}), got {v.dp_rank}")
            if ranks[v.dp_rank] not in live:
                raise MeshError(grpc.StatusCode.UNAVAILABLE,
                                f"the scheduler of dp rank {v.dp_rank} is not serving")
            return ranks[v.dp_rank]
        if not live:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "no scheduler is available")
        key = affinity_key(v.routing_key, v.text, v.input_ids)
        return self.router.pick(live, self.table.count_on, self.loads.loads, key)

    # -- generation --------------------------------------------------------------------------

    async def TextGenerate(self, req: pb.TextGenerateRequest,
                           ctx: CallContext) -> AsyncIterator[pb.TextGenerateResponse]:
        v = validate_text_generate(req, await self._limits())
        async for update, meta in self._generate(v):
            yield pb.TextGenerateResponse(text=update.text, meta_info=meta,
                                          finished=update.final is not None,
                                          output_ids=update.token_ids)

    async def Generate(self, req: pb.GenerateRequest,
                       ctx: CallContext) -> AsyncIterator[pb.GenerateResponse]:
        v = validate_generate(req, await self._limits())
        async for update, meta in self._generate(v):
            yield pb.GenerateResponse(output_ids=update.token_ids, meta_info=meta,
                                      finished=update.final is not None)

    async def _generate(self, v: ValidatedRequest
                        ) -> AsyncGenerator[tuple[Update, dict[str, str]], None]:
        """Dispatch one request into the mesh (n child requests when it asks for n samples,
        `protocol/choices.py`) and yield what the client gets: (update, meta_info) pairs, each
        update one child's news (merged into one per child when the client did not ask to
        stream). Ends it in the mesh if the client goes away."""
        if v.text is not None:  # every text path (scoring, rerank pairs too) passes here
            check_prompt_chars(len(v.text) + len(v.text_pair or ""), await self._limits())
        check_batch(v.n, self.bounds.batch, "sampling_params.n")  # n samples never fitting
        inflight = len(self.table.requests)
        if inflight + v.n > self.max_inflight:
            raise MeshError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"this gateway has {inflight} requests in flight (limit "
                            f"{self.max_inflight}); retry later or use another gateway")
        deadline.remaining()  # DEADLINE_EXCEEDED at once if the client's deadline has passed
        expires = deadline.current()
        rid = v.rid or uuid.uuid4().hex
        tokenizer = self._pick("tokenizer")
        scheduler, detokenizer = self._pick_scheduler(v), self._pick("detokenizer")
        children = fan_out(rid, v.n, v.sampling)
        ready, started = asyncio.Event(), time.time()
        pendings = [PendingRequest(rid=c.rid, tokenizer=tokenizer, scheduler=scheduler,
                                   detokenizer=detokenizer, started_at=started, ready=ready)
                    for c in children]
        self.table.add_group(rid, pendings)
        choices = Choices(v.n, v.stream)
        clocks = [self.metrics.track() for _ in children]  # TTFT, ITL, tokens, e2e per child
        events = self.profiling.events  # request events of a profiling run, per child
        events.record("recv", (c.rid for c in children))
        # registered: the registry has (or will have) its record; ended: its final state
        dispatched = registered = ended = False
        name = "gateway.embed" if v.embed else "gateway.generate"
        with self._tracer.start_as_current_span(name, attributes={"meshlm.rid": rid,
                                                                  "meshlm.n": v.n}) as span:
            try:
                record = {"gateway": self.identity.inbox, "tokenizer": tokenizer,
                          "scheduler": scheduler, "detokenizer": detokenizer}
                if v.n > 1:
                    record["n"] = str(v.n)  # how an abort elsewhere finds the children
                if v.rid:
                    # A client's rid may clash with one on another gateway: check first.
                    if not await self.registry.create(rid, record):
                        raise MeshError(grpc.StatusCode.ALREADY_EXISTS,
                                        f"rid: {rid!r} is already in use")
                else:
                    # A fresh uuid4 cannot clash: record it off the request's path.
                    self.registry.create_later(rid, record)
                registered = True
                trace_context = carrier_of(span)
                route = common_pb2.Route(gateway=self.identity.inbox, scheduler=scheduler,
                                         detokenizer=detokenizer)
                submit = self.submit.get(tokenizer)
                if submit is None:  # the replica left (discovery) since it was picked
                    raise MeshError(grpc.StatusCode.UNAVAILABLE,
                                    f"the tokenizer at {tokenizer} became unavailable")
                await submit.put([  # one batch, the leader first
                    tokenizer_request(v, c, route, trace_context, started, expires)
                    for c in children])
                dispatched = True
                events.record("send", (c.rid for c in children))
                until = _loop_time(expires)  # once, not per update
                while not choices.done:
                    try:
                        if until is None:
                            updates = await next_updates(pendings)
                        else:
                            async with asyncio.timeout_at(until):
                                updates = await next_updates(pendings)
                    except TimeoutError:
                        self.registry.finish(rid, "error", finish_reason="deadline_exceeded")
                        ended = True
                        span.add_event("deadline_exceeded")
                        raise deadline.expired_error() from None
                    for index, update in updates:
                        if update.error is not None:
                            self.registry.finish(rid, "error", finish_reason="error")
                            ended = True
                            raise update.error
                        if not any(p.first_output for p in pendings):
                            span.add_event("first_output")
                            self.registry.update(rid, state="running")
                        if events.active and not pendings[index].first_output:
                            events.record("first", children[index].rid)
                        if events.active and update.final is not None:
                            events.record("finish", children[index].rid)
                        pendings[index].first_output = True
                        clocks[index].output(
                            prompt_tokens=update.prompt_tokens, cached_tokens=update.cached_tokens,
                            completion_tokens=update.completion_tokens,
                            finish_reason=update.final.finish_reason if update.final else None)
                        due = choices.add(index, update)
                        if choices.done and not ended:
                            ended = True
                            reason = choices.finish_reason()
                            span.set_attribute("meshlm.finish_reason", reason)
                            self.registry.finish(
                                rid, "aborted" if "abort" in reason.split(",") else "finished",
                                finish_reason=reason, completion_tokens=sum(
                                    f.completion_tokens for f in choices.finals if f is not None))
                        for i, out in due:
                            yield out, self._meta(v, children[i], out, started)
            finally:
                self.table.remove_group(rid)
                live = [p.rid for p in pendings if not p.done]
                if dispatched and live:
                    # The client went away (cancelled call, closed connection), or a sibling
                    # failed: end the rest now.
                    self.background.spawn(self.abort_in_scheduler(scheduler, live))
                    for p, clock in zip(pendings, clocks, strict=True):
                        if not p.done:
                            clock.finish("abort")
                if registered and not ended:
                    span.add_event("client_gone")
                    self.registry.finish(rid, "aborted", finish_reason="abort")

    def _meta(self, v: ValidatedRequest, child: Child, update: Update,
              started: float) -> dict[str, str]:
        meta = {"id": child.rid, "prompt_tokens": str(update.prompt_tokens),
                "completion_tokens": str(update.completion_tokens),
                "cached_tokens": str(update.cached_tokens)}
        if v.n > 1:
            meta["index"] = str(child.index)
        if v.embed:
            del meta["completion_tokens"]
        sampling = v.sampling
        if sampling.return_logprob:
            meta.update(logprob_meta(update.token_ids, update.logprobs,
                                     top=sampling.top_logprobs_num > 0,
                                     text=sampling.return_text_in_logprobs))
        final = update.final
        if final is not None:
            meta["finish_reason"] = final.finish_reason
            matched = final.WhichOneof("matched")
            if matched == "matched_token":
                meta["matched_stop"] = str(final.matched_token)
                meta["matched_stop_type"] = "token"
            elif matched == "matched_text":
                meta["matched_stop"] = final.matched_text
                meta["matched_stop_type"] = "text"
            meta["e2e_latency"] = f"{time.time() - started:.6f}"
        return meta

    # -- embeddings --------------------------------------------------------------------------

    async def TextEmbed(self, req: pb.TextEmbedRequest, ctx: CallContext) -> pb.TextEmbedResponse:
        update, meta = await self._embed(validate_text_embed(req, await self._limits()))
        return pb.TextEmbedResponse(embedding=update.embedding or [], meta_info=meta)

    async def Embed(self, req: pb.EmbedRequest, ctx: CallContext) -> pb.EmbedResponse:
        update, meta = await self._embed(validate_embed(req, await self._limits()))
        return pb.EmbedResponse(embedding=update.embedding or [], meta_info=meta)

    async def _embed(self, v: ValidatedRequest) -> tuple[Update, dict[str, str]]:
        """An embedding request takes the generation path; its one output has the vector."""
        stream = self._generate(v)
        try:
            async for update, meta in stream:
                if update.final is not None:
                    return update, meta
        finally:
            await stream.aclose()  # here, so its span ends in the context that began it
        raise MeshError(grpc.StatusCode.INTERNAL, "the embedding request ended without a result")

    def on_rejections(self, batch: tokenizer_pb2.RejectionBatch) -> None:
        """Requests a tokenizer refused (e.g. prompt too long) fail with its status."""
        for rejection in batch.rejections:
            self.table.fail(rejection.rid, MeshError.from_number(rejection.status.code,
                                                                 rejection.status.message))

    def on_dependency_down(self, role: str, address: str) -> None:
        """A replica stopped serving: end the requests that depended on it (UNAVAILABLE) rather
        than leave them hanging. Past the tokenizer a request no longer needs it."""
        for req in list(self.table.requests.values()):
            hit = (getattr(req, role) == address if role != "tokenizer"
                   else req.tokenizer == address and not req.first_output)
            if hit:
                req.fail(MeshError(grpc.StatusCode.UNAVAILABLE,
                                   f"the {role} at {address} became unavailable"))
                if role != "scheduler":
                    self.background.spawn(self.abort_in_scheduler(req.scheduler, [req.rid]))

    # -- tokenizer passthrough ---------------------------------------------------------------

    def _tokenizer_stub(self) -> tokenizer_pb2_grpc.TokenizerStub:
        return tokenizer_pb2_grpc.TokenizerStub(self.channels.get(self._pick("tokenizer")))

    async def Tokenize(self, req: pb.TokenizeRequest, ctx: CallContext) -> pb.TokenizeResponse:
        if self.info is None:
            await self.refresh_info()
        if self.info is None:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "not ready: waiting for model info")
        validate_tokenize(req, self._limits_of(self.info))
        add_special = req.add_special_tokens if req.HasField("add_special_tokens") else True
        reply = await self._call(self._tokenizer_stub().Tokenize(
            tokenizer_pb2.TokenizeRequest(text=req.text, add_special_tokens=add_special),
            timeout=deadline.timeout()))
        return pb.TokenizeResponse(tokens=reply.tokens, count=len(reply.tokens),
                                   max_model_len=reply.max_model_len, input_text=req.text)

    async def Detokenize(self, req: pb.DetokenizeRequest, ctx: CallContext,
                         skip_special_tokens: bool = False) -> pb.DetokenizeResponse:
        """The tokens' text; special tokens are kept unless asked (SGLang's /detokenize)."""
        validate_detokenize(req, await self._limits())
        reply = await self._call(self._tokenizer_stub().Detokenize(
            tokenizer_pb2.DetokenizeRequest(tokens=req.tokens,
                                            skip_special_tokens=skip_special_tokens),
            timeout=deadline.timeout()))
        return pb.DetokenizeResponse(text=reply.text)

    @staticmethod
    async def _call(call: Awaitable[R]) -> R:
        """Await an internal call; its failure becomes the client's status."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise MeshError(grpc.StatusCode.UNAVAILABLE,
                                f"internal service: {exc.details()}") from exc
            raise MeshError(code, exc.details() or code.name) from exc


def _loop_time(expires: float | None) -> float | None:
    """A unix-time deadline on the event loop's clock (asyncio.timeout_at); None stays None."""
    if expires is None:
        return None
    return asyncio.get_running_loop().time() + (expires - time.time())
