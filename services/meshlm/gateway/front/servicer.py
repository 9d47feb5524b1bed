"""The public gRPC face: sglang.runtime.v1.SglangService, one method per RPC, each handing the
request and the call's facts (metadata, peer, deadline) to its family's method in the api
layer (`api/gateway.py`).

Errors are not handled here: the api raises MeshError and the server's error interceptor turns
it into the status (`common/interceptors.py`). A call with a big request has its memory
reclaimed soon after it ends (`front/reclaim.py`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc

from meshlm.common.deadline import set_deadline
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.gateway import GatewayAPI
from meshlm.gateway.front.reclaim import Reclaimer
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

Context: TypeAlias = grpc.aio.ServicerContext
R = TypeVar("R")


def call_context(context: Context) -> CallContext:
    """The call's facts; its deadline also becomes the current one (`common/deadline.py`)."""
    metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())
                if isinstance(v, str)}
    remaining = context.time_remaining()
    deadline = time.time() + remaining if remaining is not None else None
    set_deadline(deadline)
    return CallContext(metadata=metadata, peer=context.peer() or "", deadline=deadline,
                       write_now=getattr(context, "write_now", None))  # the native server's


class SglangServicer(sglang_pb2_grpc.SglangServiceServicer):
    def __init__(self, api: GatewayAPI, reclaim: Reclaimer | None = None) -> None:
        self.api = api
        self.reclaim = reclaim or Reclaimer()

    async def TextGenerate(self, req: pb.TextGenerateRequest,
                           ctx: Context) -> AsyncIterator[pb.TextGenerateResponse]:
        async for item in self._stream(self.api.generation.TextGenerate, req, ctx):
            yield item

    async def Generate(self, req: pb.GenerateRequest,
                       ctx: Context) -> AsyncIterator[pb.GenerateResponse]:
        async for item in self._stream(self.api.generation.Generate, req, ctx):
            yield item

    async def TextEmbed(self, req: pb.TextEmbedRequest, ctx: Context) -> pb.TextEmbedResponse:
        return await self._unary(self.api.generation.TextEmbed, req, ctx)

    async def Embed(self, req: pb.EmbedRequest, ctx: Context) -> pb.EmbedResponse:
        return await self._unary(self.api.generation.Embed, req, ctx)

    async def Classify(self, req: pb.ClassifyRequest, ctx: Context) -> pb.ClassifyResponse:
        return await self._unary(self.api.scoring.Classify, req, ctx)

    async def Tokenize(self, req: pb.TokenizeRequest, ctx: Context) -> pb.TokenizeResponse:
        return await self._unary(self.api.tokens.Tokenize, req, ctx)

    async def Detokenize(self, req: pb.DetokenizeRequest, ctx: Context) -> pb.DetokenizeResponse:
        return await self._unary(self.api.tokens.Detokenize, req, ctx)

    async def HealthCheck(self, req: pb.HealthCheckRequest, ctx: Context) -> pb.HealthCheckResponse:
        return await self._unary(self.api.info.HealthCheck, req, ctx)

    async def GetModelInfo(self, req: pb.GetModelInfoRequest,
                           ctx: Context) -> pb.GetModelInfoResponse:
        return await self._unary(self.api.info.GetModelInfo, req, ctx)

    async def GetServerInfo(self, req: pb.GetServerInfoRequest,
                            ctx: Context) -> pb.GetServerInfoResponse:
        return await self._unary(self.api.info.GetServerInfo, req, ctx)

    async def ListModels(self, req: pb.ListModelsRequest, ctx: Context) -> pb.ListModelsResponse:
        return await self._unary(self.api.info.ListModels, req, ctx)

    async def GetLoad(self, req: pb.GetLoadRequest, ctx: Context) -> pb.GetLoadResponse:
        return await self._unary(self.api.info.GetLoad, req, ctx)

    async def Abort(self, req: pb.AbortRequest, ctx: Context) -> pb.AbortResponse:
        return await self._unary(self.api.admin.Abort, req, ctx)

    async def FlushCache(self, req: pb.FlushCacheRequest, ctx: Context) -> pb.FlushCacheResponse:
        return await self._unary(self.api.admin.FlushCache, req, ctx)

    async def PauseGeneration(self, req: pb.PauseGenerationRequest,
                              ctx: Context) -> pb.PauseGenerationResponse:
        return await self._unary(self.api.pause.PauseGeneration, req, ctx)

    async def ContinueGeneration(self, req: pb.ContinueGenerationRequest,
                                 ctx: Context) -> pb.ContinueGenerationResponse:
        return await self._unary(self.api.pause.ContinueGeneration, req, ctx)

    async def ChatComplete(self, req: pb.OpenAIRequest,
                           ctx: Context) -> AsyncIterator[pb.OpenAIStreamChunk]:
        async for item in self._stream(self.api.openai.ChatComplete, req, ctx):
            yield item

    async def Complete(self, req: pb.OpenAIRequest,
                       ctx: Context) -> AsyncIterator[pb.OpenAIStreamChunk]:
        async for item in self._stream(self.api.openai.Complete, req, ctx):
            yield item

    async def OpenAIEmbed(self, req: pb.OpenAIRequest, ctx: Context) -> pb.OpenAIResponse:
        return await self._unary(self.api.openai.OpenAIEmbed, req, ctx)

    async def OpenAIClassify(self, req: pb.OpenAIRequest, ctx: Context) -> pb.OpenAIResponse:
        return await self._unary(self.api.scoring.OpenAIClassify, req, ctx)

    async def Score(self, req: pb.OpenAIRequest, ctx: Context) -> pb.OpenAIResponse:
        return await self._unary(self.api.scoring.Score, req, ctx)

    async def Rerank(self, req: pb.OpenAIRequest, ctx: Context) -> pb.OpenAIResponse:
        return await self._unary(self.api.scoring.Rerank, req, ctx)

    async def StartProfile(self, req: pb.StartProfileRequest,
                           ctx: Context) -> pb.StartProfileResponse:
        return await self._unary(self.api.profile.StartProfile, req, ctx)

    async def StopProfile(self, req: pb.StopProfileRequest, ctx: Context) -> pb.StopProfileResponse:
        return await self._unary(self.api.profile.StopProfile, req, ctx)

    async def UpdateWeightsFromDisk(self, req: pb.UpdateWeightsRequest,
                                    ctx: Context) -> pb.UpdateWeightsResponse:
        return await self._unary(self.api.weights.UpdateWeightsFromDisk, req, ctx)

    async def _unary(self, rpc: Callable[[Any, CallContext], Awaitable[R]], req: Any,
                     ctx: Context) -> R:
        call = call_context(ctx)
        try:
            reply = await rpc(req, call)
        finally:
            self.reclaim.after(req.ByteSize())
        if call.trailers:
            ctx.set_trailing_metadata(tuple(call.trailers.items()))
        return reply

    async def _stream(self, rpc: Callable[[Any, CallContext], AsyncIterator[R]], req: Any,
                      ctx: Context) -> AsyncIterator[R]:
        try:
            async for item in rpc(req, call_context(ctx)):
                yield item
        finally:
            self.reclaim.after(req.ByteSize())
