"""A streamed response's body skips the app's middleware (BodySendApp); its start does not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshlm.gateway.front.http_streams import BodySendApp, StreamResponse

SEEN: list[str] = []


class Watching:
    """A middleware that records each message it is given to send."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watched(message: Message) -> None:
            SEEN.append(message["type"])
            await send(message)
        await self.app(scope, receive, watched)


async def _chunks() -> AsyncIterator[bytes]:
    for i in range(3):
        yield b"data: %d\n\n" % i


async def _ours(request: Request) -> StreamResponse:
    return StreamResponse(_chunks(), None, "text/event-stream")


def _app(keep: bool) -> Starlette:
    app = BodySendApp if keep else Starlette
    return app(routes=[Route("/ours", _ours)], middleware=[Middleware(Watching)])


@pytest.mark.parametrize("keep", [True, False])
async def test_the_body_skips_the_middleware_of_a_body_send_app(keep: bool) -> None:
    SEEN.clear()
    transport = httpx.ASGITransport(app=_app(keep))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        reply = await client.get("/ours")
    assert reply.status_code == 200
    assert reply.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    bodies: Any = SEEN.count("http.response.body")
    assert SEEN[0] == "http.response.start"
    assert bodies == (0 if keep else 4)  # three chunks and the end
