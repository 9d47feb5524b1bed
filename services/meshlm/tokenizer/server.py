"""Tokenizer service: turns gateways' generation requests into token ids, checks them against
the context length, and forwards them to the scheduler named in each request's route.

Tokenization runs on worker threads, never on the event loop (`tokenizer/workers.py`). On a
gateway's Submit stream, each batch's small prompts are tokenized and forwarded in order, and its
big ones as a job of their own on the big-input thread, so the batches behind them do not wait.
A long prompt is counted piece by piece before it is encoded whole (`tokenizer/long_prompts.py`),
so one that cannot fit is refused without encoding all of it."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry import trace

from meshlm.common import config as cfg
from meshlm.common import deadline
from meshlm.common.logs import get_logger
from meshlm.common.metrics import TokenizerMetrics
from meshlm.common.profiling import Profiling, profiler_binding
from meshlm.common.roles import MESH_PORTS
from meshlm.common.server import Binding
from meshlm.common.service import (
    MeshPeers,
    ServiceConfig,
    mesh_server,
    model_info_json,
    resolve_model_path,
    serve_until_signal,
    start_mesh_server,
)
from meshlm.common.streams import StreamPool
from meshlm.common.tracing import carrier_of, context_of, tracer
from meshlm.tokenizer import wire
from meshlm.tokenizer.chats import Refused, render_chat, rendered_or_refused
from meshlm.tokenizer.long_prompts import TooLong, encode_prompts
from meshlm.tokenizer.tokenization import TextTokenizer
from meshlm.tokenizer.workers import Workers
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, tokenizer_pb2
from meshlm.v1 import tokenizer_pb2_grpc as pb_grpc

log = get_logger(__name__)

Rejections = asyncio.Queue[tokenizer_pb2.RejectionBatch | None]


@dataclass
class TokenizerConfig(ServiceConfig):
    """meshlm tokenizer service."""

    port: int = cfg.field(MESH_PORTS["tokenizer"],
                          "mesh gRPC port (mutual TLS); 0 picks a free port")
    model_path: str = cfg.field("", "checkpoint directory (HF layout); empty = embedded default")


class TokenizerServicer(pb_grpc.TokenizerServicer):
    def __init__(self, tok: TextTokenizer, schedulers: StreamPool[scheduler_pb2.TokenizedRequest],
                 info: common_pb2.ModelInfo, metrics: TokenizerMetrics | None = None,
                 workers: Workers | None = None) -> None:
        self._tok = tok
        self.workers = workers or Workers()
        self._schedulers = schedulers
        self._replies: set[Rejections] = set()  # each open Submit call's
        self._info = info
        self._tracer = tracer("meshlm.tokenizer")
        self.metrics = metrics or TokenizerMetrics(Path(info.model_path).name)
        self.profiling = Profiling("tokenizer")

    async def Submit(
        self, request_iterator: AsyncIterator[tokenizer_pb2.GenerateBatch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.RejectionBatch]:
        replies: Rejections = asyncio.Queue()
        reader = asyncio.ensure_future(self._read(request_iterator, replies))
        self._replies.add(replies)
        try:
            while (batch := await replies.get()) is not None:
                yield batch
            await reader  # its failure ends the stream
        finally:
            self._replies.discard(replies)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, batches: AsyncIterator[tokenizer_pb2.GenerateBatch],
                    replies: Rejections) -> None:
        """Tokenize and forward each batch as it comes: its small prompts here, in order; its
        big ones as a job of their own. Rejections go to `replies`, then None at the end."""
        jobs: set[asyncio.Task[None]] = set()
        try:
            async for batch in batches:
                small, big = self._by_size(list(batch.requests))
                if big:
                    job = asyncio.create_task(self._big_job(big, replies))
                    jobs.add(job)
                    job.add_done_callback(jobs.discard)
                if small:
                    await self._reply(small, replies)
            await asyncio.gather(*list(jobs))  # their rejections before the stream ends
        finally:
            for job in jobs:
                job.cancel()
            replies.put_nowait(None)

    def _by_size(self, requests: list[tokenizer_pb2.GenerateRequest]
                 ) -> tuple[list[tokenizer_pb2.GenerateRequest],
                            list[tokenizer_pb2.GenerateRequest]]:
        """(small, big) by the characters to tokenize (n samples of a prompt stay together:
        they have the same text)."""
        small: list[tokenizer_pb2.GenerateRequest] = []
        big: list[tokenizer_pb2.GenerateRequest] = []
        for req in requests:
            (big if self.workers.is_big(wire.prompt_chars(req)) else small).append(req)
        return small, big

    async def _reply(self, requests: list[tokenizer_pb2.GenerateRequest],
                     replies: Rejections) -> None:
        rejections = await self._forward(requests)
        if rejections:
            replies.put_nowait(tokenizer_pb2.RejectionBatch(rejections=rejections))

    async def _big_job(self, requests: list[tokenizer_pb2.GenerateRequest],
                       replies: Rejections) -> None:
        """A failure fails these requests (INTERNAL), not the stream the others share."""
        try:
            await self._reply(requests, replies)
        except Exception:
            log.exception("tokenize_failed", requests=len(requests))
            replies.put_nowait(tokenizer_pb2.RejectionBatch(rejections=[
                wire.rejection(r.meta.rid, grpc.StatusCode.INTERNAL,
                               "the tokenizer failed on this prompt") for r in requests]))

    async def _tokenize(self, requests: Sequence[tokenizer_pb2.GenerateRequest]
                        ) -> list[list[int] | TooLong | Refused]:
        """Each request's prompt ids (given, or encoded on a worker thread; a chat rendered by
        the template first; cut when the client asked, truncate_prompt_tokens), TooLong, or
        Refused (a chat the template refused)."""
        ids: list[list[int] | TooLong | Refused] = [wire.truncated(r, list(r.input_ids.ids))
                                                    for r in requests]
        texts: dict[int, tuple[str | tuple[str, str], bool]] = {}  # to encode, with specials?
        chats: dict[str, str | Refused] = {}  # n samples of one chat: rendered once
        for i, r in enumerate(requests):
            kind = r.WhichOneof("prompt")
            if kind == "text":
                texts[i] = wire.prompt_text(r), r.add_special_tokens
            elif kind == "chat":
                key = r.chat.SerializeToString()
                rendered = chats.get(key)
                if rendered is None:
                    rendered = chats[key] = await self.workers.run(
                        len(r.chat.messages_json), rendered_or_refused, self._tok, r.chat)
                if isinstance(rendered, Refused):
                    ids[i] = rendered
                else:  # the templates write their own special tokens (bos), as a rule
                    texts[i] = rendered, r.chat.add_special_tokens
        # add_special_tokens is per request; group so each group is one encode_batch call. A
        # prompt to be cut is encoded whole (never TooLong: the gateway bounds its characters).
        for special, cut in ((True, False), (False, False), (True, True), (False, True)):
            group = [i for i, (_, flag) in texts.items()
                     if flag == special and bool(requests[i].truncate_prompt_tokens) == cut]
            if not group:
                continue
            chunk = [texts[i][0] for i in group]
            chars = sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in chunk)
            limit = sys.maxsize if cut else self._tok.max_model_len - 1
            encoded = await self.workers.run(chars, encode_prompts, self._tok, chunk, special,
                                             limit)
            for i, e in zip(group, encoded, strict=True):
                ids[i] = wire.truncated(requests[i], e) if isinstance(e, list) else e
        return ids

    async def _forward(self, requests: list[tokenizer_pb2.GenerateRequest]
                       ) -> list[tokenizer_pb2.Rejection]:
        events = self.profiling.events
        events.record("recv", (r.meta.rid for r in requests))
        ids = await self._tokenize(requests)
        rejections: list[tokenizer_pb2.Rejection] = []
        by_scheduler: dict[str, list[scheduler_pb2.TokenizedRequest]] = {}
        now = time.time()
        for req, prompt in zip(requests, ids, strict=True):
            meta = req.meta
            tokens = (prompt.tokens if isinstance(prompt, TooLong)
                      else 0 if isinstance(prompt, Refused) else len(prompt))
            with self._tracer.start_as_current_span(
                "tokenizer.tokenize", context=context_of(req.trace),
                attributes={"meshlm.rid": meta.rid, "meshlm.prompt_tokens": tokens},
            ) as span:
                sampling = meta.sampling
                start = sampling.logprob_start_len if sampling.return_logprob else -1
                limit = self._tok.context_length(req.max_model_len)
                # A rendered chat's ids stand for the client's messages, as ids do.
                field = "input_ids" if req.WhichOneof("prompt") == "chat" else "text"
                if req.fill_max_new_tokens and isinstance(prompt, list):
                    sampling.max_new_tokens = max(limit - len(prompt), 1)  # the room left
                code, problem = grpc.StatusCode.INVALID_ARGUMENT, (
                    prompt.message if isinstance(prompt, Refused)
                    else prompt.message(limit, field) if isinstance(prompt, TooLong)
                    else self._tok.check_context(len(prompt), sampling.max_new_tokens,
                                                 prompt_field=field, logprob_start_len=start,
                                                 limit=req.max_model_len)
                    or wire.min_over_max(sampling))
                if problem is None and deadline.passed(meta.deadline, now):
                    code, problem = (grpc.StatusCode.DEADLINE_EXCEEDED,
                                     "the client's deadline passed before the request was "
                                     "tokenized")
                if problem is not None or not isinstance(prompt, list):
                    span.set_status(trace.StatusCode.ERROR, problem)
                    rejections.append(wire.rejection(meta.rid, code, problem or ""))
                    continue
                words = self._tok.word_ids(sampling.bad_words) if sampling.bad_words else None
                budget = sampling.thinking_budget if sampling.HasField("thinking_budget") else None
                tags = None if budget is None else self._tok.encode_batch(
                    [budget.open, budget.close], add_special_tokens=False)
                by_scheduler.setdefault(meta.route.scheduler, []).append(
                    wire.tokenized(req, prompt, carrier_of(span), words, tags))
        for address, items in by_scheduler.items():
            events.record("send", (r.meta.rid for r in items))  # a put may write at once
            await self._schedulers.get(address).put(items)
        self.metrics.forwarded(len(requests) - len(rejections), sum(
            len(r.input_ids) for items in by_scheduler.values() for r in items), len(rejections))
        return rejections

    def scheduler_lost(self, address: str) -> None:
        """The stream to the scheduler at `address` failed (`BatchedStream.on_lost`) while the
        scheduler may still serve: what was on it is gone, and which requests those were this
        tokenizer does not keep. Every gateway with a Submit stream here is told, and ends its
        requests that came this way and have had no output."""
        log.warning("scheduler_lost", scheduler=address, gateways=len(self._replies))
        for replies in self._replies:
            replies.put_nowait(tokenizer_pb2.RejectionBatch(lost_schedulers=[address]))

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        tokens = await self.workers.run(len(request.text), self._tok.encode, request.text,
                                        request.add_special_tokens)
        return tokenizer_pb2.TokenizeResponse(tokens=tokens, max_model_len=self._tok.max_model_len)

    async def Detokenize(self, request: tokenizer_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> tokenizer_pb2.DetokenizeResponse:
        ids = list(request.tokens)
        text = await self.workers.run(len(ids) * _CHARS_PER_ID, self._tok.decode, ids,
                                      request.skip_special_tokens)
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def ApplyChatTemplate(
        self, request: tokenizer_pb2.ChatTemplateRequest, context: grpc.aio.ServicerContext,
    ) -> tokenizer_pb2.ChatTemplateResponse:
        text = await self.workers.run(len(request.messages_json), render_chat, self._tok,
                                      request)
        # Templates write their own special tokens (bos), unless more are asked for.
        tokens = await self.workers.run(len(text), self._tok.encode, text,
                                        request.add_special_tokens)
        return tokenizer_pb2.ChatTemplateResponse(tokens=tokens)

    async def GetInfo(self, request: common_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return self._info


_CHARS_PER_ID = 4  # about, to size a Detokenize job


async def serve(config: TokenizerConfig) -> None:
    model_path = resolve_model_path(config.model_path)
    tok = TextTokenizer.from_pretrained(model_path)
    peers = MeshPeers(config)

    def on_scheduler_lost(address: str) -> None:  # streams start after the servicer exists
        servicer.scheduler_lost(address)

    schedulers: StreamPool[scheduler_pb2.TokenizedRequest] = peers.stream_pool(
        "tokenizer->scheduler", "scheduler", lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).Submit,
        lambda items: scheduler_pb2.TokenizedBatch(requests=items), on_lost=on_scheduler_lost,
        write_through=True)
    info = common_pb2.ModelInfo(
        model_path=model_path, max_model_len=tok.max_model_len, vocab_size=tok.vocab_size,
        eos_token_ids=tok.eos_token_ids,
        json_info=model_info_json(model_path, {"max_model_len": tok.max_model_len}),
    )
    servicer = TokenizerServicer(tok, schedulers, info)
    server = mesh_server(config, [Binding(pb_grpc.add_TokenizerServicer_to_server, servicer,
                                  "meshlm.v1.Tokenizer"), profiler_binding(servicer.profiling)])
    bound = await start_mesh_server(server, config, peers.tls)
    await serve_until_signal(server, config, bound, metrics=servicer.metrics,
                             model_path=model_path, role="tokenizer")
    servicer.workers.close()
    await peers.close()
