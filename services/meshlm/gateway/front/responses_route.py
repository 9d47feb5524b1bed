"""OpenAI's Responses API over HTTP: POST /v1/responses, served as the chat completion it asks
for (`protocol/responses.py`) by the chat's own implementation (`api/openai.py`), its answer
reshaped (`protocol/responses_output.py`): one Response object, or (stream) the API's SSE
events. POST /v1/responses/input_tokens counts a request's input tokens; nothing is stored,
so the routes of a stored response are 404s. Failures before the first event are OpenAI's
error JSON, later ones an `error` event and `response.failed`."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from meshlm.common.errors import MeshError
from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.front.openai_routes import JSON
from meshlm.gateway.front.reshaped_chat import input_tokens, reshaped
from meshlm.gateway.protocol.openai_logprobs import dumps
from meshlm.gateway.protocol.responses import parse_responses
from meshlm.gateway.protocol.responses_output import ResponseShape


def responses_routes(api: Any) -> list[BaseRoute]:
    return [Route("/v1/responses", partial(_responses, api), methods=["POST"]),
            Route("/v1/responses/input_tokens", partial(_input_tokens, api), methods=["POST"]),
            Route("/v1/responses/{rest:path}", _not_stored, methods=["GET", "POST", "DELETE"])]


async def _input_tokens(api: Any, request: Request) -> Response:
    """How many tokens a Responses request's input comes to, rendered as it would be."""
    call_context(request)
    count = await input_tokens(api, parse_responses(await request.body()).chat, request)
    return Response(dumps({"object": "response.input_tokens", "input_tokens": count}),
                    media_type=JSON)


async def _not_stored(request: Request) -> Response:
    """Retrieving, cancelling or deleting a response, or listing its input: nothing is kept."""
    raise MeshError(grpc.StatusCode.NOT_FOUND, "response_id: responses are not stored by this "
                                               "server; each answer is returned only to the "
                                               "request that asked for it")


async def _responses(api: Any, request: Request) -> Response:
    call_context(request)  # the deadline of a grpc-timeout header
    req = parse_responses(await request.body())
    created = int(time.time())
    return await reshaped(api, req.chat, lambda model: ResponseShape(req.echo, created),
                          request)
