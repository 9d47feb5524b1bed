"""Anthropic's Messages API over HTTP: POST /v1/messages, served as the chat completion it
asks for (`protocol/anthropic.py`) by the chat's own implementation (`api/openai.py`), its
answer reshaped (`protocol/anthropic_output.py`): one message, or (stream) Anthropic's SSE
events; POST /v1/messages/count_tokens counts a request's input tokens. Failures are
Anthropic's error object: the answer before the first event, an `error` event after it."""

from __future__ import annotations

from functools import partial
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.front.openai_routes import JSON
from meshlm.gateway.front.reshaped_chat import input_tokens, reshaped
from meshlm.gateway.protocol.anthropic import parse_messages
from meshlm.gateway.protocol.anthropic_output import MessageShape
from meshlm.gateway.protocol.openai_logprobs import dumps
from meshlm.gateway.protocol.transcode import parse_json_body


def messages_routes(api: Any) -> list[BaseRoute]:
    return [Route("/v1/messages", partial(_messages, api), methods=["POST"]),
            Route("/v1/messages/count_tokens", partial(_count_tokens, api), methods=["POST"])]


async def _count_tokens(api: Any, request: Request) -> Response:
    """How many tokens a Messages request's input comes to, rendered as it would be
    (`max_tokens` is not needed here)."""
    call_context(request)
    doc = parse_json_body(await request.body())
    if isinstance(doc, dict) and doc.get("max_tokens") is None:
        doc = {**doc, "max_tokens": 1}
    chat = parse_messages(orjson.dumps(doc)).chat
    count = await input_tokens(api, chat, request)
    return Response(dumps({"input_tokens": count}), media_type=JSON)


async def _messages(api: Any, request: Request) -> Response:
    call_context(request)  # the deadline of a grpc-timeout header
    req = parse_messages(await request.body())
    return await reshaped(api, req.chat, lambda model: MessageShape(req.model or model),
                          request)
