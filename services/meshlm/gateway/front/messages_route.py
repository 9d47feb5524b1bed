"""Anthropic's Messages API over HTTP: POST /v1/messages, served as the chat completion it
asks for (`protocol/anthropic.py`) by the chat's own implementation (`api/openai.py`), its
answer reshaped (`protocol/anthropic_output.py`): one message, or (stream) Anthropic's SSE
events. Failures are Anthropic's error object: the answer before the first event, an
`error` event after it."""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.front.reshaped_chat import reshaped
from meshlm.gateway.protocol.anthropic import parse_messages
from meshlm.gateway.protocol.anthropic_output import MessageShape


def messages_routes(api: Any) -> list[BaseRoute]:
    return [Route("/v1/messages", partial(_messages, api), methods=["POST"])]


async def _messages(api: Any, request: Request) -> Response:
    call_context(request)  # the deadline of a grpc-timeout header
    req = parse_messages(await request.body())
    return await reshaped(api, req.chat, lambda model: MessageShape(req.model or model),
                          request)
