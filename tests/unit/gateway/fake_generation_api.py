"""A fake api for the HTTP front's tests (wrap it in FlatApi): text generation with behaviours
chosen by the prompt, ids generation, embeddings, tokenize, load, flush_cache, health and the
model cards; and an httpx client over the HTTP app built on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
from flat_api import FlatApi

from meshlm.common.errors import MeshError
from meshlm.common.rpc import CallContext
from meshlm.gateway.front.http_app import build_http_app
from meshlm.gateway.protocol.validation import validate_tokenize
from sglang.runtime.v1 import sglang_pb2 as pb

FINAL_TEXT_META = {
    "id": "r1",
    "prompt_tokens": "3",
    "completion_tokens": "3",
    "cached_tokens": "1",
    "finish_reason": "stop",
    "matched_stop": "!",
    "matched_stop_type": "text",
}


class FakeApi:
    """Text prompts pick a behaviour: "early"/"late" fail before/after the first message,
    "hang" never finishes; anything else streams "Hel", "lo", "!"."""

    def __init__(self) -> None:
        self.healthy = True
        self.flushable = True
        self.contexts: list[CallContext] = []
        self.ended: list[tuple[str, bool]] = []  # (prompt, ran to completion)

    async def Tokenize(self, req: pb.TokenizeRequest, ctx: CallContext) -> pb.TokenizeResponse:
        self.contexts.append(ctx)
        if req.text == "crash":
            raise RuntimeError("bug")
        validate_tokenize(req)
        return pb.TokenizeResponse(tokens=[1, 2], count=2, max_model_len=64, input_text=req.text)

    async def GetLoad(self, req: pb.GetLoadRequest, ctx: CallContext) -> pb.GetLoadResponse:
        return pb.GetLoadResponse(json_info=f"rank={req.dp_rank}")

    async def Abort(self, req: pb.AbortRequest, ctx: CallContext) -> pb.AbortResponse:
        raise MeshError(grpc.StatusCode.UNIMPLEMENTED, "Abort is not implemented yet")

    def generated(self, req: pb.TextGenerateRequest | pb.GenerateRequest, ctx: CallContext,
                  express: Any = None
                  ) -> AsyncIterator[pb.TextGenerateResponse | pb.GenerateResponse]:
        """What the HTTP front reads: the messages (the api's own are Generated tuples, with
        the same fields); every message through it (`express`, direct writes, unused)."""
        if isinstance(req, pb.TextGenerateRequest):
            return self.TextGenerate(req, ctx)
        return self.Generate(req, ctx)

    def TextGenerate(
        self, req: pb.TextGenerateRequest, ctx: CallContext
    ) -> AsyncIterator[pb.TextGenerateResponse]:
        self.contexts.append(ctx)
        if req.sampling_params.n > 1:
            return self._samples(req)
        return self._text(req)

    async def _samples(self, req: pb.TextGenerateRequest
                       ) -> AsyncIterator[pb.TextGenerateResponse]:
        """n samples "a", "b", ...: streamed as two pieces each, interleaved (the last sample
        first), or as one finished message each, in index order."""
        n = req.sampling_params.n
        letters = "abcdefghijklmnop"[:n]

        def meta(i: int, done: bool) -> dict[str, str]:
            m = {"id": f"r1-{i}", "index": str(i), "prompt_tokens": "3",
                 "completion_tokens": str(2 if done else 1), "cached_tokens": str(i and 3)}
            return m | {"finish_reason": "length"} if done else m

        if not req.stream:
            for i, c in enumerate(letters):
                yield pb.TextGenerateResponse(text=c * 2, meta_info=meta(i, True), finished=True)
            return
        for i in reversed(range(n)):
            yield pb.TextGenerateResponse(text=letters[i], meta_info=meta(i, False))
        for i in range(n):
            yield pb.TextGenerateResponse(text=letters[i], meta_info=meta(i, True),
                                          finished=True)

    async def TextEmbed(self, req: pb.TextEmbedRequest, ctx: CallContext) -> pb.TextEmbedResponse:
        if not req.text:
            raise MeshError(grpc.StatusCode.INVALID_ARGUMENT, "text: must not be empty")
        return pb.TextEmbedResponse(embedding=[0.6, 0.8], meta_info={
            "id": req.rid or "e1", "prompt_tokens": "2", "cached_tokens": "0",
            "finish_reason": "stop"})

    async def Embed(self, req: pb.EmbedRequest, ctx: CallContext) -> pb.EmbedResponse:
        return pb.EmbedResponse(embedding=[1.0, 0.0], meta_info={
            "id": "e2", "prompt_tokens": str(len(req.input_ids)), "cached_tokens": "1"})

    async def FlushCache(self, req: pb.FlushCacheRequest,
                         ctx: CallContext) -> pb.FlushCacheResponse:
        if self.flushable:
            return pb.FlushCacheResponse(success=True, message="flushed 1")
        return pb.FlushCacheResponse(success=False, message="s1: requests are running")

    async def _text(self, req: pb.TextGenerateRequest) -> AsyncIterator[pb.TextGenerateResponse]:
        completed = False
        try:
            if req.text == "early":
                raise MeshError(grpc.StatusCode.INVALID_ARGUMENT, "text: not today")
            if not req.stream:
                yield pb.TextGenerateResponse(
                    text="Hello!", meta_info=FINAL_TEXT_META, finished=True
                )
            else:
                for i, piece in enumerate(["Hel", "lo"], start=1):
                    meta = {
                        "id": "r1",
                        "prompt_tokens": "3",
                        "completion_tokens": str(i),
                        "cached_tokens": "1",
                    }
                    yield pb.TextGenerateResponse(text=piece, meta_info=meta)
                    if req.text == "late":
                        raise MeshError(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of KV cache")
                    if req.text == "hang":
                        await asyncio.Event().wait()
                    if req.text == "many":
                        for _ in range(100):
                            yield pb.TextGenerateResponse(text=".", meta_info=meta)
                yield pb.TextGenerateResponse(text="!", meta_info=FINAL_TEXT_META, finished=True)
            if req.text == "hang":
                await asyncio.Event().wait()
            completed = True
        finally:
            self.ended.append((req.text, completed))

    async def Generate(
        self, req: pb.GenerateRequest, ctx: CallContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        length = req.input_ids[0] == 9
        final = {
            "id": "r2",
            "prompt_tokens": str(len(req.input_ids)),
            "completion_tokens": "3",
            "cached_tokens": "0",
            "finish_reason": "length" if length else "stop",
        }
        if not length:
            final |= {"matched_stop": "7", "matched_stop_type": "token"}
        if not req.stream:
            yield pb.GenerateResponse(output_ids=[5, 6, 7], meta_info=final, finished=True)
            return
        yield pb.GenerateResponse(output_ids=[5], meta_info={"id": "r2"})
        yield pb.GenerateResponse(output_ids=[6, 7], meta_info=final, finished=True)

    def is_healthy(self) -> bool:
        return self.healthy

    def model_cards(self) -> list[pb.ModelCard]:
        return [pb.ModelCard(id="tiny", root="/models/tiny", max_model_len=64)]


@contextlib.asynccontextmanager
async def http_client(api: FakeApi) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the HTTP app over `api`, calling from 10.0.0.7:4242."""
    transport = httpx.ASGITransport(app=build_http_app(FlatApi(api)),
                                    client=("10.0.0.7", 4242))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c
