"""TextGenerate, Generate, TextEmbed and Embed, and the one path every generating or embedding
call takes into the mesh (the OpenAI and scoring calls too): `GenerationRPCs.generate`.

A request goes through five steps, numbered in `generate`: admit (bounds, in-flight limit,
deadline), route (a tokenizer, a scheduler by affinity and load, a detokenizer), record (the RID
registry, `api/request_record.py`), dispatch (one batch to the tokenizer: n samples are n child
requests, `protocol/choices.py`) and stream (each sample's updates, folded into what the client
asked for). Tracing, metrics and profiling watch the updates (`api/observers.py`). When the
client goes away, or one sample fails, the rest are ended in the scheduler.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, NamedTuple, TypeVar

import grpc

from meshlm.common import deadline
from meshlm.common.channels import MESH_MESSAGE_BYTES, MessageTooLarge
from meshlm.common.errors import MeshError
from meshlm.common.metrics import GatewayMetrics
from meshlm.common.profiling import Profiling
from meshlm.common.rpc import CallContext
from meshlm.common.streams import BatchedStream
from meshlm.common.tracing import carrier_of, detached_span, tracer
from meshlm.gateway.api.core import GatewayCore
from meshlm.gateway.api.direct import Express, direct_write
from meshlm.gateway.api.observers import RequestObservers
from meshlm.gateway.api.request_record import RequestRecord
from meshlm.gateway.mesh.aborts import abort_in_scheduler
from meshlm.gateway.mesh.inbox import PendingRequest, Update, next_updates
from meshlm.gateway.mesh.loads import LoadPoller
from meshlm.gateway.mesh.routing import Router, affinity_key
from meshlm.gateway.mesh.wire import tokenizer_request
from meshlm.gateway.protocol.choices import Choices, fan_out
from meshlm.gateway.protocol.constraints import large_constraint
from meshlm.gateway.protocol.meta_info import meta_info
from meshlm.gateway.protocol.running_wire import RunningEncoder
from meshlm.gateway.protocol.validation import (
    ValidatedRequest,
    check_batch,
    check_prompt_chars,
    validate_embed,
    validate_generate,
    validate_text_embed,
    validate_text_generate,
)
from meshlm.v1 import common_pb2, tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

Generation = tuple[Update, dict[str, str]]  # an update and the meta_info the client gets


class Generated(NamedTuple):
    """One message of TextGenerate / Generate before it is a proto message: what the HTTP
    front folds into SGLang's JSON (a proto's meta_info map costs about 0.2 µs per entry to
    fill and as much to read back). Its fields are the messages' own."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, str]
    finished: bool


class GenerationRPCs:
    def __init__(self, core: GatewayCore,
                 submit: dict[str, BatchedStream[tokenizer_pb2.GenerateRequest]],
                 metrics: GatewayMetrics, profiling: Profiling) -> None:
        self.core = core
        self.submit = submit  # each tokenizer's batched request stream, by address
        self.metrics = metrics
        self.profiling = profiling
        self.router = Router()
        self.loads = LoadPoller(core.channels, lambda: core.deps.serving("scheduler"))
        self.tracer = tracer("meshlm.gateway")

    async def TextGenerate(self, req: pb.TextGenerateRequest,
                           ctx: CallContext) -> AsyncIterator[pb.TextGenerateResponse]:
        async for g in self.generated(req, ctx, _express(ctx, text=True)):
            yield _with_meta(pb.TextGenerateResponse(text=g.text, finished=g.finished,
                                                     output_ids=g.output_ids), g.meta_info)

    async def Generate(self, req: pb.GenerateRequest,
                       ctx: CallContext) -> AsyncIterator[pb.GenerateResponse]:
        async for g in self.generated(req, ctx, _express(ctx, text=False)):
            yield _with_meta(pb.GenerateResponse(output_ids=g.output_ids, finished=g.finished),
                             g.meta_info)

    async def generated(self, req: pb.TextGenerateRequest | pb.GenerateRequest,
                        ctx: CallContext, express: Express | None = None
                        ) -> AsyncIterator[Generated]:
        """TextGenerate's (a text request) or Generate's (ids) messages, not yet protos;
        `express` sends a running message straight to the client (`api/direct.py`)."""
        limits = await self.core.limits()
        is_text = isinstance(req, pb.TextGenerateRequest)
        check = validate_text_generate if is_text else validate_generate
        v = await validated(check, req.sampling_params, req, limits)
        async for update, meta in self.generate(v, express):
            _raise_if_cancelled(update, ctx)
            yield Generated(update.text if is_text else "", update.token_ids, meta,
                            update.final is not None)

    async def TextEmbed(self, req: pb.TextEmbedRequest, ctx: CallContext) -> pb.TextEmbedResponse:
        update, meta = await self.embed(validate_text_embed(req, await self.core.limits()))
        return pb.TextEmbedResponse(embedding=update.embedding or [], meta_info=meta)

    async def Embed(self, req: pb.EmbedRequest, ctx: CallContext) -> pb.EmbedResponse:
        update, meta = await self.embed(validate_embed(req, await self.core.limits()))
        return pb.EmbedResponse(embedding=update.embedding or [], meta_info=meta)

    # -- the path ----------------------------------------------------------------------------

    async def generate(self, v: ValidatedRequest, express: Express | None = None
                       ) -> AsyncGenerator[Generation, None]:
        """Run `v` through the mesh, yielding each (update, meta_info) the client gets: one
        per sample's news, or one per sample when the client did not ask to stream (some
        running ones sent by `express` instead, where it is given: `api/direct.py`)."""
        # 1. admit: within this gateway's bounds and the client's deadline
        await self._admit(v)
        expires = deadline.current()
        rid = v.rid or fresh_rid()
        # 2. route: the replicas every sample takes
        tokenizer, route = self._tokenizer(), self._route(v)
        children, started = fan_out(rid, v.n, v.sampling), time.time()
        ready = asyncio.Event()
        pendings = [PendingRequest(rid=c.rid, tokenizer=tokenizer, scheduler=route.scheduler,
                                   detokenizer=route.detokenizer, started_at=started, ready=ready)
                    for c in children]
        self.core.table.add_group(rid, pendings)
        record = RequestRecord(self.core.registry, rid, route, tokenizer, v.n)
        name = "gateway.embed" if v.embed else "gateway.generate"
        with detached_span(self.tracer, name, {"meshlm.rid": rid, "meshlm.n": v.n}) as span:
            watch = RequestObservers(span, [self.metrics.track() for _ in children],
                                     self.profiling.events, [c.rid for c in children])
            dispatched = False
            try:
                # 3. record: where it runs, for an Abort on any gateway
                await record.open(client_rid=v.rid is not None)
                # 4. dispatch: one batch to the tokenizer, the first sample first
                trace_context = carrier_of(span)
                context = self.core.model.max_model_len if self.core.model else 0
                requests = [tokenizer_request(v, c, route, trace_context, started, expires,
                                              context) for c in children]
                watch.sent()  # before the hand-off: a lone request is written by the put
                await self._dispatch(tokenizer, requests)
                dispatched = True
                # 5. stream: each sample's updates, folded as the client asked
                direct = direct_write(v, watch.clocks[0], express)
                stream = self._stream(pendings, Choices(v.n, v.stream), expires, record, watch,
                                      direct)
                async with aclosing(stream):
                    async for i, out in stream:
                        yield out, meta_info(v, children[i], out, started)
            finally:
                self.core.table.remove_group(rid)
                self._end_unfinished(pendings, route.scheduler, dispatched, watch)
                if record.abandoned():
                    watch.client_gone()

    async def _admit(self, v: ValidatedRequest) -> None:
        if v.text is not None:  # every text path (scoring, rerank pairs too) passes here
            check_prompt_chars(len(v.text) + len(v.text_pair or ""), await self.core.limits())
        bounds = self.core.bounds
        check_batch(v.n, bounds.batch, "sampling_params.n")  # n samples never fitting
        inflight = len(self.core.table.requests)
        if inflight + v.n > bounds.max_inflight:
            raise MeshError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"this gateway has {inflight} requests in flight (limit "
                            f"{bounds.max_inflight}); retry later or use another gateway")
        deadline.remaining()  # DEADLINE_EXCEEDED at once if the client's deadline has passed

    def _tokenizer(self) -> str:
        """A serving tokenizer whose Submit stream is not down: while it reconnects, what is
        put on it waits, and it may never reconnect (a peer that hangs)."""
        address = self.core.deps.pick("tokenizer", self._submit_up)
        if address is None:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "no tokenizer is available")
        return address

    def _submit_up(self, address: str) -> bool:
        stream = self.submit.get(address)
        return stream is not None and not stream.lost

    def _route(self, v: ValidatedRequest) -> common_pb2.Route:
        """The scheduler asked for (routed_dp_rank), else the router's choice (routing_key,
        session_id or prefix affinity, weighed against load: `mesh/routing.py`); any
        detokenizer."""
        deps = self.core.deps
        live = deps.serving("scheduler")
        if v.dp_rank is not None:
            ranks = deps.addresses["scheduler"]
            if v.dp_rank >= len(ranks):
                raise MeshError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"routed_dp_rank: must be in [0, {len(ranks)}), got {v.dp_rank}")
            if ranks[v.dp_rank] not in live:
                raise MeshError(grpc.StatusCode.UNAVAILABLE,
                                f"the scheduler of dp rank {v.dp_rank} is not serving")
            scheduler = ranks[v.dp_rank]
        elif not live:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "no scheduler is available")
        else:
            text = v.chat.messages_json if v.chat is not None else v.text
            key = affinity_key(v.routing_key, text, v.input_ids, v.session_id)
            scheduler = self.router.pick(live, self.core.table.count_on, self.loads.loads, key)
        return common_pb2.Route(gateway=self.core.identity.inbox, scheduler=scheduler,
                                detokenizer=self.core.pick("detokenizer"))

    async def _dispatch(self, tokenizer: str,
                        requests: list[tokenizer_pb2.GenerateRequest]) -> None:
        submit = self.submit.get(tokenizer)
        if submit is None:  # the replica left (discovery) since it was picked
            raise MeshError(grpc.StatusCode.UNAVAILABLE,
                            f"the tokenizer at {tokenizer} became unavailable")
        await submit.put(requests)

    async def _stream(self, pendings: list[PendingRequest], choices: Choices,
                      expires: float | None, record: RequestRecord,
                      watch: RequestObservers, direct: Express | None = None
                      ) -> AsyncGenerator[tuple[int, Update], None]:
        """(sample, update) pairs due to the client, until every sample has ended; the
        request's failure (a sample's error, the deadline) is raised. While it waits after
        the first output, `direct` (one sample) may send running outputs itself."""
        until = _loop_time(expires)  # once, not per update
        any_output = any(p.first_output for p in pendings)  # kept, not computed per update
        lead = pendings[0]
        while not choices.done:
            if any_output:
                lead.direct = direct
            try:
                if until is None:
                    updates = await next_updates(pendings)
                else:
                    async with asyncio.timeout_at(until):
                        updates = await next_updates(pendings)
                lead.direct = None
            except TimeoutError:
                record.failed("deadline_exceeded")
                watch.deadline_exceeded()
                raise deadline.expired_error() from None
            for index, update in updates:
                if update.error is not None:
                    record.failed("error")
                    raise update.error
                first_of_request = not any_output
                if first_of_request:
                    any_output = True
                    record.running()
                watch.output(index, update, not pendings[index].first_output,  # first of sample
                             first_of_request)
                pendings[index].first_output = True
                due = choices.add(index, update)
                if choices.done:
                    reason = choices.finish_reason()
                    watch.finished(reason)
                    record.finished(reason, sum(f.completion_tokens for f in choices.finals
                                                if f is not None))
                for item in due:
                    yield item

    def _end_unfinished(self, pendings: list[PendingRequest], scheduler: str, dispatched: bool,
                        watch: RequestObservers) -> None:
        """The client went away (cancelled call, closed connection) or a sample failed: end
        the samples still running, in their scheduler."""
        live = [i for i, p in enumerate(pendings) if not p.done]
        if dispatched and live:
            self.core.background.spawn(abort_in_scheduler(
                self.core.channels, scheduler, [pendings[i].rid for i in live]))
            watch.aborted(live)

    async def embed(self, v: ValidatedRequest) -> Generation:
        """An embedding request takes the generation path; its one output has the vector."""
        stream = self.generate(v)
        try:
            async for update, meta in stream:
                if update.final is not None:
                    return update, meta
        finally:
            await stream.aclose()  # here, so its span ends in the context that began it
        raise MeshError(grpc.StatusCode.INTERNAL, "the embedding request ended without a result")

    # -- news from the mesh ------------------------------------------------------------------

    def on_rejections(self, batch: tokenizer_pb2.RejectionBatch, tokenizer: str) -> None:
        """Requests a tokenizer refused (e.g. prompt too long) fail with its status; those it
        sent to a scheduler whose stream it lost, and that still have had no output
        LOST_STREAM_GRACE later, end UNAVAILABLE (what the stream carried is gone, and which
        it was is not known)."""
        for rejection in batch.rejections:
            self.core.table.fail(rejection.rid, MeshError.from_number(
                rejection.status.code, rejection.status.message))
        for scheduler in batch.lost_schedulers:
            rids = {rid for rid, req in self.core.table.requests.items()
                    if req.tokenizer == tokenizer and req.scheduler == scheduler}
            why = (f"the stream from the tokenizer at {tokenizer} to the scheduler at "
                   f"{scheduler} was lost")
            asyncio.get_running_loop().call_later(
                LOST_STREAM_GRACE, self._end,
                lambda req, rids=rids: req.rid in rids and not req.first_output, why, True)

    def on_too_large(self, request: tokenizer_pb2.GenerateRequest,
                     error: MessageTooLarge) -> None:
        """A sample's request over the mesh's message limit was not sent (a prompt past what
        --max-prompt-chars or the public message limits should let in)."""
        self.core.table.fail(request.rid, MeshError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is {error.size} bytes on the mesh, over its limit of "
            f"{MESH_MESSAGE_BYTES}; send a shorter prompt"))

    def on_submit_lost(self, address: str) -> None:
        """The Submit stream to a tokenizer failed while the tokenizer may still serve (its
        health is watched on another connection): what was on the stream is lost, and which
        requests those were is not known, so every request there without output ends
        UNAVAILABLE (a client may retry it), and none goes there until the stream is back
        (`_tokenizer`)."""
        self._end(_before_output_on(address),
                  f"the stream to the tokenizer at {address} was lost", abort=True)

    def on_dependency_down(self, role: str, address: str) -> None:
        """A replica stopped serving: end the requests that depended on it (UNAVAILABLE) rather
        than leave them hanging. Past the tokenizer a request no longer needs it."""
        def on_it(req: PendingRequest) -> bool:
            return bool(getattr(req, role) == address)
        self._end(_before_output_on(address) if role == "tokenizer" else on_it,
                  f"the {role} at {address} became unavailable", abort=role != "scheduler")

    def _end(self, hit: Callable[[PendingRequest], bool], why: str, abort: bool) -> None:
        """End the requests `hit` picks UNAVAILABLE saying `why`; `abort`: in their scheduler
        too (unless it is the one that went away)."""
        for req in list(self.core.table.requests.values()):
            if hit(req):
                req.fail(MeshError(grpc.StatusCode.UNAVAILABLE, why))
                if abort:
                    self.core.background.spawn(abort_in_scheduler(
                        self.core.channels, req.scheduler, [req.rid]))


# A tokenizer's stream to a scheduler is lost when the scheduler dies, too: its health watch
# then ends its requests and keeps new ones off it within milliseconds. Ended at once on the
# tokenizer's word instead, a client's retry could reach the dead scheduler in between, so the
# requests the lost stream may have carried are ended this long after the word, if still
# waiting: the ones a scheduler that still serves will never see.
LOST_STREAM_GRACE = 1.0  # seconds


def _before_output_on(tokenizer: str) -> Callable[[PendingRequest], bool]:
    """Picks the requests that went to `tokenizer` and have had no output (past it, a request
    no longer needs it)."""
    return lambda req: req.tokenizer == tokenizer and not req.first_output


def fresh_rid() -> str:
    """A new request's id: 128 random bits as 32 hex digits, the shape of SGLang's
    `uuid4().hex` (and more random: no version bits), at a fifth of its cost."""
    return os.urandom(16).hex()


def _express(ctx: CallContext, text: bool) -> Express | None:
    """TextGenerate's (`text`) or Generate's running messages sent as bytes straight to the
    client, where the transport can (`api/direct.py`)."""
    write = ctx.write_now
    if write is None:
        return None
    encode = RunningEncoder(text)
    return lambda item: write(encode(item))


def _raise_if_cancelled(update: Update, ctx: CallContext) -> None:
    """A sample ended by an abort of every request (abort_all) ends a gRPC stream CANCELLED,
    as SGLang's gRPC server does; over HTTP it is a final message with finish_reason abort."""
    final = update.final
    if (final is not None and final.error.code == grpc.StatusCode.CANCELLED.value[0]
            and ctx.transport == "grpc"):
        raise MeshError(grpc.StatusCode.CANCELLED, final.error.message)


Response = TypeVar("Response", pb.TextGenerateResponse, pb.GenerateResponse)
R = TypeVar("R")


def _with_meta(message: Response, meta: dict[str, str]) -> Response:
    """`message` with `meta` in its meta_info map, set entry by entry: given to the
    constructor, the map is filled by Python's MutableMapping.update (0.5 µs more a message)."""
    entries = message.meta_info
    for key, value in meta.items():
        entries[key] = value
    return message


def _loop_time(expires: float | None) -> float | None:
    """A unix-time deadline on the event loop's clock (asyncio.timeout_at); None stays None."""
    if expires is None:
        return None
    return asyncio.get_running_loop().time() + (expires - time.time())


async def validated(check: Callable[..., R], sampling: pb.SamplingParams, *args: Any) -> R:
    """`check(*args)`, a request's validation: on a worker thread when its constraint is too
    large to build on the event loop (`constraints.large_constraint`)."""
    if large_constraint(sampling):
        return await asyncio.to_thread(check, *args)
    return check(*args)
