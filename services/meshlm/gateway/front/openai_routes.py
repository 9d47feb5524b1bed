"""OpenAI-compatible HTTP routes: GET /v1/models, POST /v1/chat/completions, /v1/completions,
/v1/embeddings, and SGLang's /v1/classify, /v1/score and /v1/rerank (one JSON reply each).

Thin adapters over the implementation the RPCs use (`api/openai.py`): the body is parsed once
and the chunks come back as OpenAIStreamChunk. Not streaming, the one chunk is the JSON reply;
streaming, each chunk is a Server-Sent Event and `data: [DONE]` ends the stream. Failures before
the first chunk (bad field, unknown model, context too long) are raised, and answered with
OpenAI's error JSON (`front/errors.py`); a later one is an `{"error": ...}` event before [DONE].

A streamed request's chunks are written as they come (`front/http_streams.StreamResponse`, as
/generate's events are); when the client goes away the chunk stream is closed, which aborts
the request in the mesh.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.gateway.api.openai import Chunks
from meshlm.gateway.front.disconnect import unless_disconnected
from meshlm.gateway.front.errors import Shape, error_body, failure
from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.front.http_streams import EMPTY, DirectBody, StreamResponse, aclose, first
from meshlm.gateway.protocol.openai import (
    GenerationRequest,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from meshlm.gateway.protocol.openai_errors import model_not_found
from meshlm.gateway.protocol.openai_logprobs import dumps
from meshlm.gateway.protocol.scoring import parse_classify, parse_rerank, parse_score
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

JSON = "application/json"
SSE_DONE = b"data: [DONE]\n\n"
OPENAI_OWN_SHAPES = {"/v1/score": Shape.ERROR_RESPONSE}  # not the family's error shape


def openai_routes(api: Any) -> list[BaseRoute]:
    """The routes over `api` (a GatewayAPI)."""
    created = int(time.time())
    return [
        Route("/v1/models", partial(_models, api, created), methods=["GET"]),
        Route("/v1/models/{model:path}", partial(_model, api, created), methods=["GET"]),
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


async def _models(api: Any, created: int, request: Request) -> Response:
    """OpenAI's model list: the served model."""
    data = [_card(card, created) for card in api.info.model_cards()]
    return Response(dumps({"object": "list", "data": data}), media_type=JSON)


async def _model(api: Any, created: int, request: Request) -> Response:
    """One model by its id; NOT_FOUND (OpenAI's model_not_found) for any other."""
    model = request.path_params["model"]
    for card in api.info.model_cards():
        if card.id == model:
            return Response(dumps(_card(card, created)), media_type=JSON)
    served = ", ".join(card.id for card in api.info.model_cards()) or "none yet"
    raise model_not_found(model, served)


def _card(card: pb.ModelCard, created: int) -> dict[str, Any]:
    return {
        "id": card.id,
        "object": "model",
        "created": created,
        "owned_by": "meshlm",
        "root": card.root or card.id,
        "parent": card.parent if card.HasField("parent") else None,
        "max_model_len": card.max_model_len if card.HasField("max_model_len") else None,
    }


async def _generation(parse: Callable[[bytes], GenerationRequest],
                      run: Callable[[Any, Any], Chunks], request: Request) -> Response:
    call_context(request)  # the deadline of a grpc-timeout header
    req = parse(await request.body())
    direct = DirectBody(frame=_event) if req.stream else None  # api/direct.py
    chunks = run(req, direct)
    if not req.stream:
        last = await unless_disconnected(last_chunk(chunks), request.receive)
        return Response(last.json_chunk, media_type=JSON)
    head = await first_chunk(chunks, request)
    return StreamResponse(_events(head, chunks, request.url.path), chunks, "text/event-stream",
                          direct)


async def first_chunk(chunks: Chunks, request: Request) -> pb.OpenAIStreamChunk:
    """A streamed answer's first chunk (its failure raised as it is, the stream closed), read
    unless the client goes away first."""
    try:
        head = await unless_disconnected(first(chunks), request.receive)
    except BaseException:
        await aclose(chunks)
        raise
    if head is EMPTY:  # cannot happen: a stream ends with its finish chunk
        raise MeshError(grpc.StatusCode.INTERNAL, "the stream ended without a chunk")
    return head


async def _reply(parse: Callable[[bytes], Any], run: Callable[[Any], Awaitable[bytes]],
                 request: Request) -> Response:
    """A route answered with one JSON body: parse it, run it (cancelled if the client goes)."""
    call_context(request)  # the deadline of a grpc-timeout header
    req = parse(await request.body())
    body = await unless_disconnected(run(req), request.receive)
    return Response(body, media_type=JSON)


async def last_chunk(chunks: Chunks) -> pb.OpenAIStreamChunk:
    """The stream's last chunk (not streaming, its only one), read to the end."""
    last = None
    async with aclosing(chunks):
        async for chunk in chunks:
            last = chunk
    if last is None:
        raise MeshError(grpc.StatusCode.INTERNAL, "the request ended without a response")
    return last


# ---- streaming -------------------------------------------------------------------------------


async def _events(head: pb.OpenAIStreamChunk, chunks: Chunks, path: str) -> AsyncIterator[bytes]:
    """The SSE events of a chunk stream whose first chunk was `head`, then [DONE]; a failure
    is an error event before it."""
    yield _event(head.json_chunk)
    try:
        async for chunk in chunks:
            yield _event(chunk.json_chunk)
    except Exception as e:  # noqa: BLE001 - the stream's error event says it
        yield _event(dumps(error_body(Shape.OPENAI, failure(e, path))))
    yield SSE_DONE


def _event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
