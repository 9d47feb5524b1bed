"""OpenAI's Responses API over HTTP: POST /v1/responses, served as the chat completion it asks
for (`protocol/responses.py`) by the chat's own implementation (`api/openai.py`), its answer
reshaped (`protocol/responses_output.py`): one Response object, or (stream) the API's SSE
events. POST /v1/responses/input_tokens counts a request's input tokens; nothing is stored,
so the routes of a stored response are 404s. Failures before the first event are OpenAI's
error JSON, later ones an `error` event and `response.failed`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import grpc
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from meshlm.common.errors import MeshError
from meshlm.gateway.api.openai import Chunks
from meshlm.gateway.front.disconnect import unless_disconnected
from meshlm.gateway.front.errors import Shape, error_body, failure
from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.front.http_streams import StreamResponse
from meshlm.gateway.front.openai_routes import JSON, first_chunk, last_chunk
from meshlm.gateway.protocol.openai_logprobs import dumps
from meshlm.gateway.protocol.responses import parse_responses
from meshlm.gateway.protocol.responses_output import ResponseShape
from sglang.runtime.v1 import sglang_pb2 as pb


def responses_routes(api: Any) -> list[BaseRoute]:
    return [Route("/v1/responses", partial(_responses, api), methods=["POST"]),
            Route("/v1/responses/input_tokens", partial(_input_tokens, api), methods=["POST"]),
            Route("/v1/responses/{rest:path}", _not_stored, methods=["GET", "POST", "DELETE"])]


async def _input_tokens(api: Any, request: Request) -> Response:
    """How many tokens a Responses request's input comes to, rendered as it would be."""
    call_context(request)
    chat = parse_responses(await request.body()).chat
    tokens = await unless_disconnected(api.tokens.chat_tokens(
        chat.messages, chat.add_generation_prompt, chat.continue_final_message,
        chat.template_kwargs, chat.add_special_tokens, chat.tools), request.receive)
    return Response(dumps({"object": "response.input_tokens", "input_tokens": len(tokens)}),
                    media_type=JSON)


async def _not_stored(request: Request) -> Response:
    """Retrieving, cancelling or deleting a response, or listing its input: nothing is kept."""
    raise MeshError(grpc.StatusCode.NOT_FOUND, "response_id: responses are not stored by this "
                                               "server; each answer is returned only to the "
                                               "request that asked for it")


async def _responses(api: Any, request: Request) -> Response:
    call_context(request)  # the deadline of a grpc-timeout header
    req = parse_responses(await request.body())
    chunks = api.openai.chat_chunks(req.chat)
    shape = ResponseShape(req.echo, int(time.time()))
    if not req.chat.stream:
        last = await unless_disconnected(last_chunk(chunks), request.receive)
        return Response(dumps(shape.whole(orjson.loads(last.json_chunk))), media_type=JSON)
    head = await first_chunk(chunks, request)
    return StreamResponse(_events(shape, head, chunks, request.url.path), chunks,
                          "text/event-stream")


async def _events(shape: ResponseShape, head: pb.OpenAIStreamChunk, chunks: Chunks,
                  path: str) -> AsyncIterator[bytes]:
    for event in shape.start() + shape.chunk(orjson.loads(head.json_chunk)):
        yield shape.sse(event)
    try:
        async for chunk in chunks:
            for event in shape.chunk(orjson.loads(chunk.json_chunk)):
                yield shape.sse(event)
    except Exception as e:  # noqa: BLE001 - the stream's error event says it
        for event in shape.failed(error_body(Shape.OPENAI, failure(e, path))):
            yield shape.sse(event)
        return
    for event in shape.end():
        yield shape.sse(event)
