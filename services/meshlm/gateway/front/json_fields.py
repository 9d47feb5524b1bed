"""The JSON side of the hand-written HTTP routes: an endpoint that answers its handler's reply
as JSON, and the body's fields read with errors that name them."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from meshlm.common.errors import invalid
from meshlm.gateway.protocol import transcode

Handler = Callable[[Request], Awaitable[Any]]


def json_endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint: the handler's reply as JSON (a Response as it is)."""
    @wraps(handler)
    async def endpoint(request: Request) -> Response:
        reply = await handler(request)
        if isinstance(reply, Response):
            return reply
        return Response(orjson.dumps(reply), media_type="application/json")
    return endpoint


async def body_of(request: Request, known: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object body ({} when empty), nulls dropped; unknown keys are refused."""
    doc = transcode.parse_json_body(await request.body())
    if not isinstance(doc, dict):
        raise invalid("body", "must be a JSON object")
    for key in doc:
        if key not in known:
            takes = ", ".join(known) if known else "no fields"
            raise invalid(key, f"unknown field; {request.url.path} takes {takes}")
    return {k: v for k, v in doc.items() if v is not None}


def string_field(doc: dict[str, Any], key: str, default: str) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str):
        raise invalid(key, f"must be a string, got {json.dumps(value)}")
    return value


def bool_field(doc: dict[str, Any], key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise invalid(key, f"must be true or false, got {json.dumps(value)}")
    return value
