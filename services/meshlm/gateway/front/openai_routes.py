"""OpenAI-compatible HTTP routes: POST /v1/chat/completions, /v1/completions, /v1/embeddings,
and SGLang's /v1/classify, /v1/score and /v1/rerank (one JSON reply each).

Thin adapters over the implementation the RPCs use (`api/openai.py`): the body is parsed once
and the chunks come back as OpenAIStreamChunk. Not streaming, the one chunk is the JSON reply;
streaming, each chunk is a Server-Sent Event and `data: [DONE]` ends the stream. Failures before
the first chunk (bad field, unknown model, context too long) are HTTP errors with OpenAI's error
JSON; a later one is an `{"error": ...}` event before [DONE].

A request's chunk stream runs from start to end in one task (its tracing span opens and closes
in one context), handing chunks over through a short queue; when the client goes away that
task is cancelled, which aborts the request in the mesh.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.gateway.api.openai import Chunks
from meshlm.gateway.front.disconnect import ClientGone, unless_disconnected
from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.protocol.openai import (
    GenerationRequest,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from meshlm.gateway.protocol.openai_errors import error_body
from meshlm.gateway.protocol.openai_logprobs import dumps
from meshlm.gateway.protocol.scoring import parse_classify, parse_rerank, parse_score
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

JSON = "application/json"
SSE_DONE = b"data: [DONE]\n\n"


def openai_routes(api: Any) -> list[BaseRoute]:
    """/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/classify, /v1/score,
    /v1/rerank (/v1/models is http_app's)."""
    return [
        Route("/v1/chat/completions", partial(_generation, parse_chat, api.openai.chat_chunks),
              methods=["POST"]),
        Route("/v1/completions", partial(_generation, parse_completion,
                                         api.openai.completion_chunks), methods=["POST"]),
        Route("/v1/embeddings", partial(_reply, parse_embedding, api.openai.embedding_response),
              methods=["POST"]),
        Route("/v1/classify", partial(_reply, parse_classify, api.scoring.classify_response),
              methods=["POST"]),
        Route("/v1/score", partial(_reply, parse_score, api.scoring.score_response),
              methods=["POST"]),
        Route("/v1/rerank", partial(_reply, parse_rerank, api.scoring.rerank_response),
              methods=["POST"]),
    ]


async def _generation(parse: Callable[[bytes], GenerationRequest],
                      run: Callable[[Any], Chunks], request: Request) -> Response:
    try:
        call_context(request)  # the deadline of a grpc-timeout header
        req = parse(await request.body())
        chunks = run(req)
        if not req.stream:
            last = await unless_disconnected(_last(chunks), request.receive)
            return Response(last.json_chunk, media_type=JSON)
        producer = _Producer(chunks)
        try:
            first = await unless_disconnected(producer.next(), request.receive)
        except BaseException:
            await producer.close()
            raise
        if first is None:  # cannot happen: a stream ends with its finish chunk
            raise MeshError(grpc.StatusCode.INTERNAL, "the stream ended without a chunk")
        return _EventStream(producer, first)
    except Exception as e:  # noqa: BLE001 - every failure becomes an answer
        return _failure(e, request)


async def _reply(parse: Callable[[bytes], Any], run: Callable[[Any], Awaitable[bytes]],
                 request: Request) -> Response:
    """A route answered with one JSON body: parse it, run it (cancelled if the client goes)."""
    try:
        call_context(request)  # the deadline of a grpc-timeout header
        req = parse(await request.body())
        body = await unless_disconnected(run(req), request.receive)
        return Response(body, media_type=JSON)
    except Exception as e:  # noqa: BLE001 - every failure becomes an answer
        return _failure(e, request)


def _failure(exc: Exception, request: Request) -> Response:
    """The answer to a route that raised (inside its `except`): 499 when the client went
    away, a MeshError's status, else a logged 500."""
    if isinstance(exc, ClientGone):
        return Response(status_code=499)
    if isinstance(exc, MeshError):
        return _error(exc)
    log.exception("http_request_failed", path=request.url.path)
    return _error(_internal())


def _error(err: MeshError) -> Response:
    return Response(dumps(error_body(err)), status_code=err.http_status, media_type=JSON)


def _internal() -> MeshError:
    return MeshError(grpc.StatusCode.INTERNAL, "internal error")


async def _last(chunks: Chunks) -> pb.OpenAIStreamChunk:
    """The stream's last chunk (not streaming, its only one), read to the end."""
    last = None
    async with aclosing(chunks):
        async for chunk in chunks:
            last = chunk
    if last is None:
        raise MeshError(grpc.StatusCode.INTERNAL, "the request ended without a response")
    return last


# ---- streaming -------------------------------------------------------------------------------


class _Producer:
    """Runs a chunk stream in its own task; `next()` gives its chunks, then None at the end,
    or raises its failure."""

    def __init__(self, chunks: Chunks) -> None:
        self._queue: asyncio.Queue[pb.OpenAIStreamChunk | Exception | None] = asyncio.Queue(4)
        self._task = asyncio.ensure_future(self._run(chunks))

    async def _run(self, chunks: Chunks) -> None:
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    await self._queue.put(chunk)
        except Exception as e:
            await self._queue.put(e)
        else:
            await self._queue.put(None)

    async def next(self) -> pb.OpenAIStreamChunk | None:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def close(self) -> None:
        """Cancel the stream (a no-op when it has ended) and wait until it has."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


class _EventStream(StreamingResponse):
    """The SSE response of a streaming request; however it ends, the producer is closed."""

    def __init__(self, producer: _Producer, first: pb.OpenAIStreamChunk) -> None:
        super().__init__(self._events(producer, first), media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.producer = producer

    @staticmethod
    async def _events(producer: _Producer, first: pb.OpenAIStreamChunk) -> AsyncIterator[bytes]:
        yield _event(first.json_chunk)
        try:
            while (chunk := await producer.next()) is not None:
                yield _event(chunk.json_chunk)
        except MeshError as e:
            yield _event(dumps(error_body(e)))
        except Exception:
            log.exception("http_stream_failed")
            yield _event(dumps(error_body(_internal())))
        yield SSE_DONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.producer.close()


