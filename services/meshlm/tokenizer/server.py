"""Tokenizer service: turns gateways' generation requests into token ids, checks them against
the context length, and forwards them to the scheduler named in each request's route."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry import trace

from meshlm.common import config as cfg
from meshlm.common import deadline
from meshlm.common.errors import invalid
from meshlm.common.logs import get_logger
from meshlm.common.metrics import TokenizerMetrics
from meshlm.common.profiling import Profiling, profiler_binding
from meshlm.common.roles import MESH_PORTS
from meshlm.common.server import Binding, GrpcServer
from meshlm.common.service import (
    MeshPeers,
    ServiceConfig,
    model_info_json,
    resolve_model_path,
    serve_until_signal,
)
from meshlm.common.streams import StreamPool
from meshlm.common.tracing import carrier_of, context_of, tracer
from meshlm.tokenizer.tokenization import TextTokenizer
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, tokenizer_pb2
from meshlm.v1 import tokenizer_pb2_grpc as pb_grpc

log = get_logger(__name__)

INLINE_CHARS = 8192  # below this a batch is tokenized on the event loop (cheaper than a thread)


@dataclass
class TokenizerConfig(ServiceConfig):
    """meshlm tokenizer service."""

    port: int = cfg.field(MESH_PORTS["tokenizer"],
                          "mesh gRPC port (mutual TLS); 0 picks a free port")
    model_path: str = cfg.field("", "checkpoint directory (HF layout); empty = embedded default")


class TokenizerServicer(pb_grpc.TokenizerServicer):
    def __init__(self, tok: TextTokenizer, schedulers: StreamPool[scheduler_pb2.TokenizedRequest],
                 info: common_pb2.ModelInfo, metrics: TokenizerMetrics | None = None) -> None:
        self._tok = tok
        self._schedulers = schedulers
        self._info = info
        self._tracer = tracer("meshlm.tokenizer")
        self.metrics = metrics or TokenizerMetrics(Path(info.model_path).name)
        self.profiling = Profiling("tokenizer")

    async def Submit(
        self, request_iterator: AsyncIterator[tokenizer_pb2.GenerateBatch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.RejectionBatch]:
        async for batch in request_iterator:
            rejections = await self._forward(batch)
            if rejections:
                yield tokenizer_pb2.RejectionBatch(rejections=rejections)

    async def _forward(self, batch: tokenizer_pb2.GenerateBatch) -> list[tokenizer_pb2.Rejection]:
        requests = list(batch.requests)
        events = self.profiling.events
        events.record("recv", (r.rid for r in requests))
        text_idx = [i for i, r in enumerate(requests) if r.WhichOneof("prompt") == "text"]
        ids: list[list[int]] = [list(r.input_ids.ids) for r in requests]
        if text_idx:
            # add_special_tokens is per request; group so each group is one encode_batch call.
            for special in (True, False):
                group = [i for i in text_idx if requests[i].add_special_tokens == special]
                if not group:
                    continue
                texts = [_text_of(requests[i]) for i in group]
                if sum(len(t) + len(requests[i].text_pair)
                       for i, t in zip(group, texts, strict=True)) < INLINE_CHARS:
                    encoded = self._tok.encode_batch(texts, add_special_tokens=special)
                else:
                    encoded = await asyncio.to_thread(self._tok.encode_batch, texts, special)
                for i, e in zip(group, encoded, strict=True):
                    ids[i] = e
        rejections: list[tokenizer_pb2.Rejection] = []
        by_scheduler: dict[str, list[scheduler_pb2.TokenizedRequest]] = {}
        now = time.time()
        for req, prompt in zip(requests, ids, strict=True):
            with self._tracer.start_as_current_span(
                "tokenizer.tokenize", context=context_of(req.trace),
                attributes={"meshlm.rid": req.rid, "meshlm.prompt_tokens": len(prompt)},
            ) as span:
                sampling = req.sampling
                start = sampling.logprob_start_len if sampling.return_logprob else -1
                code, problem = grpc.StatusCode.INVALID_ARGUMENT, self._tok.check_context(
                    len(prompt), sampling.max_new_tokens, logprob_start_len=start)
                if problem is None and deadline.passed(req.deadline, now):
                    code, problem = (grpc.StatusCode.DEADLINE_EXCEEDED,
                                     "the client's deadline passed before the request was "
                                     "tokenized")
                if problem is not None:
                    span.set_status(trace.StatusCode.ERROR, problem)
                    rejections.append(tokenizer_pb2.Rejection(rid=req.rid, status=common_pb2.Status(
                        code=code.value[0], message=problem)))
                    continue
                by_scheduler.setdefault(req.route.scheduler, []).append(
                    scheduler_pb2.TokenizedRequest(
                        rid=req.rid, input_ids=prompt, sampling=req.sampling, stream=req.stream,
                        return_text=req.return_text, route=req.route, trace=carrier_of(span),
                        arrival_time=req.arrival_time, embed=req.embed, after=req.after,
                        deadline=req.deadline,
                    )
                )
        for address, items in by_scheduler.items():
            await self._schedulers.get(address).put(items)
            events.record("send", (r.rid for r in items))
        self.metrics.forwarded(len(requests) - len(rejections), sum(
            len(r.input_ids) for items in by_scheduler.values() for r in items), len(rejections))
        return rejections

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        tokens = self._tok.encode(request.text, add_special_tokens=request.add_special_tokens)
        return tokenizer_pb2.TokenizeResponse(tokens=tokens, max_model_len=self._tok.max_model_len)

    async def Detokenize(self, request: tokenizer_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> tokenizer_pb2.DetokenizeResponse:
        text = self._tok.decode(list(request.tokens),
                                skip_special_tokens=request.skip_special_tokens)
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def ApplyChatTemplate(
        self, request: tokenizer_pb2.ChatTemplateRequest, context: grpc.aio.ServicerContext,
    ) -> tokenizer_pb2.ChatTemplateResponse:
        try:
            messages = json.loads(request.messages_json)
        except ValueError as e:
            raise invalid("messages", f"not valid JSON: {e}") from None
        if not isinstance(messages, list):
            raise invalid("messages", "must be a list of messages")
        try:
            text = self._tok.apply_chat_template(messages, request.add_generation_prompt)
        except ValueError as e:
            raise invalid("messages", str(e)) from None
        # Templates write their own special tokens (bos).
        if len(text) < INLINE_CHARS:
            tokens = self._tok.encode(text, add_special_tokens=False)
        else:
            tokens = await asyncio.to_thread(self._tok.encode, text, False)
        return tokenizer_pb2.ChatTemplateResponse(tokens=tokens)

    async def GetInfo(self, request: common_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return self._info


def _text_of(req: tokenizer_pb2.GenerateRequest) -> str | tuple[str, str]:
    """A request's text, or its (text, text_pair) pair (cross-encoder input)."""
    return (req.text, req.text_pair) if req.text_pair else req.text


async def serve(config: TokenizerConfig) -> None:
    model_path = resolve_model_path(config.model_path)
    tok = TextTokenizer.from_pretrained(model_path)
    peers = MeshPeers(config)
    schedulers: StreamPool[scheduler_pb2.TokenizedRequest] = peers.stream_pool(
        "tokenizer->scheduler", "scheduler", lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).Submit,
        lambda items: scheduler_pb2.TokenizedBatch(requests=items))
    info = common_pb2.ModelInfo(
        model_path=model_path, max_model_len=tok.max_model_len, vocab_size=tok.vocab_size,
        eos_token_ids=tok.eos_token_ids,
        json_info=model_info_json(model_path, {"max_model_len": tok.max_model_len}),
    )
    servicer = TokenizerServicer(tok, schedulers, info)
    server = GrpcServer([Binding(pb_grpc.add_TokenizerServicer_to_server, servicer,
                                 "meshlm.v1.Tokenizer"), profiler_binding(servicer.profiling)])
    bound = await server.start(config.host, config.port, peers.tls.server_credentials())
    await serve_until_signal(server, config, bound, metrics=servicer.metrics,
                             model_path=model_path, role="tokenizer")
    await peers.close()
