"""Detokenizer service: token ids in from schedulers (one batch per engine step), text out to
each request's owning gateway (one batch per received batch and gateway). Stop strings are
matched here; a match finishes the request for the client and tells its scheduler to stop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from meshlm.common import config as cfg
from meshlm.common.channels import ChannelPool
from meshlm.common.logs import get_logger
from meshlm.common.metrics import DetokenizerMetrics
from meshlm.common.packed import Plain, Run, entry_ids, packer, unpack
from meshlm.common.profiling import Profiling, profiler_binding
from meshlm.common.roles import MESH_PORTS
from meshlm.common.server import Binding
from meshlm.common.service import (
    MeshPeers,
    ServiceConfig,
    mesh_server,
    resolve_model_path,
    serve_until_signal,
    start_mesh_server,
)
from meshlm.common.streams import StreamPool
from meshlm.common.tasks import BackgroundTasks
from meshlm.common.tracing import context_of, tracer
from meshlm.detokenizer import wire
from meshlm.detokenizer.decode_state import DecodeState
from meshlm.detokenizer.incremental import IncrementalDetokenizer
from meshlm.detokenizer.token_texts import TokenTexts
from meshlm.tokenizer.tokenization import TextTokenizer
from meshlm.v1 import (
    common_pb2,
    detokenizer_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from meshlm.v1 import detokenizer_pb2_grpc as pb_grpc

log = get_logger(__name__)

# What goes to a gateway: a whole output, a running request's entry, or a step's entries packed.
Outgoing = gateway_pb2.TextOutput | Plain | Run


@dataclass
class DetokenizerConfig(ServiceConfig):
    """meshlm detokenizer service."""

    port: int = cfg.field(MESH_PORTS["detokenizer"],
                          "mesh gRPC port (mutual TLS); 0 picks a free port")
    model_path: str = cfg.field("", "checkpoint directory (HF layout); empty = embedded default")


class DetokenizerServicer(pb_grpc.DetokenizerServicer):
    def __init__(self, tok: TextTokenizer, gateways: StreamPool[Outgoing],
                 channels: ChannelPool, model_name: str = "") -> None:
        self._tok = tok
        self._token_texts = TokenTexts(tok.tokenizer)
        self._gateways = gateways
        self._channels = channels
        self._states: dict[str, DecodeState] = {}
        self._tracer = tracer("meshlm.detokenizer")
        self._background = BackgroundTasks()
        self.metrics = DetokenizerMetrics(model_name, lambda: len(self._states))
        self.profiling = Profiling("detokenizer")

    async def Push(self, request_iterator: AsyncIterator[detokenizer_pb2.TokenBatch],
                   context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        events = self.profiling.events
        async for batch in request_iterator:
            new = [o.rid for o in batch.outputs if o.HasField("header")] if events.active else []
            events.record("recv", new)
            by_gateway, stops = self.decode_batch(batch)
            self.metrics.decoded(len(batch.outputs) + len(batch.packed.rids),
                                 sum(len(rids) for rids in stops.values()))
            if events.active:  # before the hand-off: a put may write at once
                events.record("send", new)
                events.record("finish", [o.rid for items in by_gateway.values() for o in items
                                         if isinstance(o, gateway_pb2.TextOutput)
                                         and o.finished])
            for address, items in by_gateway.items():
                await self._gateways.get(address).put(items)
            for scheduler, rids in stops.items():
                self._stop_in_scheduler(scheduler, rids)
        return common_pb2.Empty()

    def decode_batch(self, batch: detokenizer_pb2.TokenBatch
                     ) -> tuple[dict[str, list[Outgoing]], dict[str, list[str]]]:
        """Decode one step's outputs, in order; returns the items for each gateway (running
        requests' texts packed, common/packed.py; anything more whole) and, per scheduler, the
        rids that matched a stop string (to be stopped there).

        Logprobs travel with the token ids they belong to (held-back text does not hold them
        back), with their tokens' texts added when the request asked for them."""
        by_gateway: dict[str, list[Outgoing]] = {}
        stops: dict[str, list[str]] = {}
        needs_texts: list[tuple[Sequence[int], common_pb2.Logprobs]] = []
        outputs, packed = batch.outputs, batch.packed
        if packed.rids and (not outputs or {o.rid for o in outputs}.isdisjoint(packed.rids)):
            # No request both packed and whole here: the entries can go first, as one run.
            self._decode_run(packed, entry_ids(outputs, packed), by_gateway, stops)
            items: Sequence[detokenizer_pb2.TokenOutput | Plain] = outputs
        else:
            items = unpack(outputs, packed)
        for item in items:
            if isinstance(item, tuple):
                routed = self._route_running(self._decoded(item), stops)
            else:
                routed = self._decode_whole(item, stops, needs_texts)
            if routed is not None:
                by_gateway.setdefault(routed[0], []).append(routed[1])
        if needs_texts:
            self._token_texts.fill(needs_texts)
        return by_gateway, stops

    def _decode_run(self, packed: common_pb2.PackedOutputs, new_ids: list[Sequence[int]],
                    by_gateway: dict[str, list[Outgoing]], stops: dict[str, list[str]]) -> None:
        """A step's packed entries (running requests' new ids), a column at a time. In the
        common case (every request live here, one gateway, no stop string matched) the
        entries go on as they came, with their texts added: one Run, no per-entry message or
        tuple. Otherwise they are routed one by one."""
        states = self._states
        texts: list[str] = []
        regular = True
        gateway = None
        for rid, ids in zip(packed.rids, new_ids, strict=True):
            state = states.get(rid)
            if state is None:  # already finished here (stop string): nothing to deliver
                regular = False
                texts.append("")
                continue
            decoder = state.decoder
            if decoder is None:  # token ids only
                texts.append("")
            else:
                texts.append(decoder.push(ids))
                if decoder.matched_stop is not None:
                    regular = False
            if state.gateway != gateway:
                regular = regular and gateway is None
                gateway = state.gateway
        if regular and gateway is not None:
            run = Run()
            run.CopyFrom(packed)
            run.ClearField("outputs_at")
            run.ClearField("texts")
            run.texts.extend(texts)
            by_gateway.setdefault(gateway, []).append(run)
            return
        for entry in zip(packed.rids, new_ids, packed.prompt_tokens, packed.completion_tokens,
                         packed.cached_tokens, texts, strict=True):
            routed = self._route_running(entry, stops)
            if routed is not None:
                by_gateway.setdefault(routed[0], []).append(routed[1])

    def _decoded(self, item: Plain) -> Plain:
        """A running request's entry with its new text."""
        state = self._states.get(item[0])
        if state is None or state.decoder is None:
            return item
        return (*item[:5], state.decoder.push(item[1]))

    def _route_running(self, entry: Plain, stops: dict[str, list[str]]
                       ) -> tuple[str, Outgoing] | None:
        """A decoded running entry for its gateway: packed, or whole when its text matched a
        stop string; None when the request is over here."""
        rid, ids, prompt, completion, cached, text = entry
        state = self._states.get(rid)
        if state is None:
            return None  # already finished here (stop string): nothing to deliver
        decoder = state.decoder
        if decoder is None or not decoder.stopped:
            return state.gateway, entry
        text_out = gateway_pb2.TextOutput(rid=rid, text=text, token_ids=ids,
                                          prompt_tokens=prompt, completion_tokens=completion,
                                          cached_tokens=cached)
        self._stopped(text_out, decoder, state, stops)
        return state.gateway, text_out

    def _decode_whole(self, out: detokenizer_pb2.TokenOutput, stops: dict[str, list[str]],
                      needs_texts: list[tuple[Sequence[int], common_pb2.Logprobs]]
                      ) -> tuple[str, gateway_pb2.TextOutput] | None:
        """A request's first output (its header opens its state), its last, or one with
        logprobs: its text output; None when the request is unknown or over here."""
        state = self._states.get(out.rid)
        if out.HasField("header"):
            state = self._open(out)
        if state is None:
            return None  # already finished here (stop string) or unknown: nothing to deliver
        text_out = wire.text_output(out)
        if state.logprob_texts and out.HasField("logprobs"):
            needs_texts.append((out.token_ids, text_out.logprobs))
        decoder = state.decoder
        if decoder is not None:
            text_out.text = decoder.push(wire.text_ids(out, state))
            if decoder.stopped:
                self._stopped(text_out, decoder, state, stops)
        if out.finished and not text_out.finished:
            if decoder is not None:
                text_out.text += decoder.finish()
            wire.end_as_scheduled(text_out, out)
            self._close(out.rid, state, text_out.finish_reason)
        return state.gateway, text_out

    def _stopped(self, text_out: gateway_pb2.TextOutput, decoder: IncrementalDetokenizer,
                 state: DecodeState, stops: dict[str, list[str]]) -> None:
        """`text_out`'s request matched a stop string in `decoder`: it finishes here, and its
        scheduler is told to stop it."""
        text_out.finished = True
        text_out.finish_reason = "stop"
        text_out.matched_text = decoder.matched_stop or ""
        stops.setdefault(state.scheduler, []).append(text_out.rid)
        self._close(text_out.rid, state, "stop")

    def _open(self, out: detokenizer_pb2.TokenOutput) -> DecodeState:
        """A request's state from its header (one it had already, a scheduler sending its end
        again after a lost stream, is closed first)."""
        old = self._states.get(out.rid)
        if old is not None:
            self._close(out.rid, old, "error")
        span = self._tracer.start_span("detokenizer.request",
                                       context=context_of(out.header.trace),
                                       attributes={"meshlm.rid": out.rid})
        state = wire.decode_state(out.header, self._tok.tokenizer, span)
        self._states[out.rid] = state
        return state

    def _close(self, rid: str, state: DecodeState, reason: str) -> None:
        self._states.pop(rid, None)
        state.span.set_attribute("meshlm.finish_reason", reason)
        state.span.end()

    def gateway_lost(self, address: str) -> None:
        """The stream to the gateway at `address` failed, and what was queued for it is gone:
        its requests are ended here and in their schedulers (a dead gateway aborts nothing, and
        its outputs would pile up for ever), and a final UNAVAILABLE for each is queued, for a
        gateway that is still there (a broken connection, not a dead process)."""
        lost = [(rid, state) for rid, state in self._states.items() if state.gateway == address]
        if not lost:
            return
        by_scheduler: dict[str, list[str]] = {}
        finals = []
        for rid, state in lost:
            self._close(rid, state, "error")
            by_scheduler.setdefault(state.scheduler, []).append(rid)
            finals.append(wire.lost_output(rid, address))
        log.warning("gateway_lost", gateway=address, requests=len(lost))
        for scheduler, rids in by_scheduler.items():
            self._abort_in_scheduler(scheduler, rids, "abort")
        self._gateways.get(address).put_nowait(finals)

    def _stop_in_scheduler(self, scheduler: str, rids: list[str]) -> None:
        self._abort_in_scheduler(scheduler, rids, "stop")

    def _abort_in_scheduler(self, scheduler: str, rids: list[str], reason: str) -> None:
        stub = scheduler_pb2_grpc.SchedulerStub(self._channels.for_role("scheduler", scheduler))

        async def call() -> None:
            try:
                await stub.Abort(scheduler_pb2.AbortRequest(rids=rids, reason=reason),
                                 timeout=10)
            except grpc.aio.AioRpcError as exc:
                log.warning("abort_failed", scheduler=scheduler, reason=reason,
                            error=exc.details(), rids=len(rids))

        self._background.spawn(call())


async def serve(config: DetokenizerConfig) -> None:
    model_path = resolve_model_path(config.model_path)
    tok = TextTokenizer.from_pretrained(model_path)
    peers = MeshPeers(config)

    def on_gateway_lost(address: str) -> None:  # streams start after the servicer exists
        servicer.gateway_lost(address)

    gateways: StreamPool[Outgoing] = peers.stream_pool(
        "detokenizer->gateway", "gateway",
        lambda ch: gateway_pb2_grpc.GatewayInboxStub(ch).Deliver,
        packer(gateway_pb2.TextBatch, texts=True), on_lost=on_gateway_lost,
        weight=lambda item: len(item.rids) if type(item) is Run else 1, write_through=True)
    servicer = DetokenizerServicer(tok, gateways, peers.channels, Path(model_path).name)
    server = mesh_server(config, [Binding(pb_grpc.add_DetokenizerServicer_to_server, servicer,
                                  "meshlm.v1.Detokenizer"), profiler_binding(servicer.profiling)])
    bound = await start_mesh_server(server, config, peers.tls)
    await serve_until_signal(server, config, bound, metrics=servicer.metrics,
                             model_path=model_path, role="detokenizer")
    await peers.close()
