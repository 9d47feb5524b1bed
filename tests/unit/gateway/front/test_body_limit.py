"""The HTTP body bound: 413 before an oversized body is read (by its Content-Length, or as a
chunked upload passes the limit), bodies within it reach the route whole; and /generate and
/encode batches that could never be admitted are refused before the api sees any prompt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from flat_api import FlatApi
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from meshlm.gateway.front.body_limit import BodyLimit
from meshlm.gateway.front.http_app import build_http_app
from meshlm.gateway.protocol.bounds import Bounds

LIMIT = 1000


async def _echo(request: Request) -> Response:
    body = await request.body()
    return Response(orjson.dumps({"bytes": len(body)}), media_type="application/json")


def _client(limit: int = LIMIT) -> httpx.AsyncClient:
    app = BodyLimit(Starlette(routes=[Route("/echo", _echo, methods=["POST"])]), limit)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def _chunks(n: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(n):
        yield b"x" * size


def _refusal(r: httpx.Response) -> str:
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == 413 and error["type"] == "RESOURCE_EXHAUSTED"
    assert f"limit of {LIMIT} bytes" in error["message"]
    assert "--http-max-body-bytes" in error["message"]
    assert "MESHLM_HTTP_MAX_BODY_BYTES" in error["message"]
    return str(error["message"])


async def test_bodies_within_the_limit_reach_the_route_whole() -> None:
    async with _client() as c:
        assert (await c.post("/echo", content=b"x" * LIMIT)).json() == {"bytes": LIMIT}
        r = await c.post("/echo", content=_chunks(10, 100))  # chunked, exactly the limit
        assert r.json() == {"bytes": LIMIT}
        assert (await c.post("/echo")).json() == {"bytes": 0}


async def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    received: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("the app must not run")

    async def receive() -> Message:
        received.append({})
        return {"type": "http.request", "body": b"", "more_body": True}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/generate",
             "headers": [(b"content-length", str(LIMIT + 1).encode())]}
    await BodyLimit(app, LIMIT)(scope, receive, send)
    assert not received  # not a byte read
    assert sent[0]["status"] == 413
    error = orjson.loads(sent[1]["body"])["error"]
    assert error["message"].startswith(f"request body: declared {LIMIT + 1} bytes")


async def test_a_chunked_body_is_refused_once_it_passes_the_limit() -> None:
    async with _client() as c:
        message = _refusal(await c.post("/echo", content=_chunks(11, 100)))
        assert message.startswith("request body: over 1100 bytes")
        _refusal(await c.post("/echo", content=b"x" * (LIMIT + 1)))


async def test_no_limit_when_zero() -> None:
    async with _client(limit=0) as c:
        r = await c.post("/echo", content=b"x" * (LIMIT * 10))
        assert r.json() == {"bytes": LIMIT * 10}


class _CountingApi:
    """Counts every prompt the HTTP layer hands it."""

    def __init__(self) -> None:
        self.calls = 0

    def TextGenerate(self, req: Any, ctx: Any) -> Any:
        self.calls += 1
        raise AssertionError("no prompt of a refused batch may reach the api")

    async def TextEmbed(self, req: Any, ctx: Any) -> Any:
        self.calls += 1
        raise AssertionError("no prompt of a refused batch may reach the api")


@pytest.mark.parametrize(("path", "body", "count"), [
    ("/generate", {"text": ["hi"] * 10_000}, 10_000),
    ("/generate", {"text": ["hi"] * 5, "sampling_params": {"n": 4}}, 20),  # prompts x n
    ("/generate", {"text": ["hi"] * 5, "sampling_params": [{"n": 1}] * 4 + [{"n": 16}]}, 20),
    ("/encode", {"text": ["hi"] * 17}, 17),
])
async def test_batches_that_could_never_be_admitted_are_refused_at_once(
        path: str, body: dict[str, Any], count: int) -> None:
    api = _CountingApi()
    app = build_http_app(FlatApi(api), bounds=Bounds(max_batch=16))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as c:
        r = await c.post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"text: the call asks for {count} requests")
    assert "at most 16" in message
    assert api.calls == 0


async def test_the_app_refuses_bodies_over_its_bound() -> None:
    app = build_http_app(FlatApi(_CountingApi()), bounds=Bounds(max_body_bytes=LIMIT))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as c:
        for path in ("/generate", "/v1/chat/completions", "/v1/runtime/text_generate"):
            _refusal(await c.post(path, content=b"{" + b" " * LIMIT + b"}"))


async def test_a_body_whose_next_piece_does_not_come_in_time_is_answered_408() -> None:
    """A piece, then nothing: 408 naming the time and its flag, after `read_timeout`; with no
    size limit the time still holds."""
    stalled = asyncio.Event()

    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"text": '
        await stalled.wait()  # never set: the client stops sending
        yield b""

    for limit in (LIMIT, 0):
        app = BodyLimit(Starlette(routes=[Route("/echo", _echo, methods=["POST"])]), limit,
                        read_timeout=0.2)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as c:
            r = await asyncio.wait_for(c.post("/echo", content=trickle()), 5)
        assert r.status_code == 408, r.text
        error = r.json()["error"]
        assert error["type"] == "DEADLINE_EXCEEDED"
        assert "nothing more came for 0.2 s after 9 bytes" in error["message"]
        assert "--http-read-timeout" in error["message"]
        # In time, the same body reaches the route whole.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as c:
            assert (await c.post("/echo", content=_chunks(3, 100))).json() == {"bytes": 300}
