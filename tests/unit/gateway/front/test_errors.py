"""The one HTTP error path over a tiny Starlette app: each shape's body and status, Status JSON
for a path the mapping does not name, 499 for a client that left, a logged 500 for a bug, and
nothing more to say once the response began."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from meshlm.common.errors import MeshError
from meshlm.gateway.front.disconnect import ClientGone
from meshlm.gateway.front.errors import CLIENT_GONE, HttpErrors, Shape, error_response

KV_FULL = MeshError(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of KV cache")
BAD_TOP_P = MeshError(grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1]")
PAUSED = MeshError(grpc.StatusCode.FAILED_PRECONDITION, "the scheduler is paused")


def _raising(exc: BaseException) -> Any:
    async def route(request: Request) -> NoReturn:
        raise exc
    return route


async def _replica_left(request: Request) -> NoReturn:
    """A call the route awaits is cancelled under it (its channel closed: the replica left)."""
    call = asyncio.ensure_future(asyncio.Event().wait())
    await asyncio.sleep(0)
    call.cancel()
    await call
    raise AssertionError("not reached")


ENTERED = asyncio.Event()


async def _raising_never(request: Request) -> NoReturn:
    ENTERED.set()
    await asyncio.Event().wait()
    raise AssertionError("not reached")


def _failing_after_first_chunk(exc: BaseException) -> Any:
    async def route(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"first"
            raise exc
        return StreamingResponse(body(), media_type="text/plain")
    return route


# "/unmapped", "/crash_unmapped" and the late routes have no shape of their own
SHAPES = {"/status": Shape.STATUS, "/native": Shape.NATIVE, "/openai": Shape.OPENAI,
          "/weights": Shape.WEIGHTS, "/gone": Shape.NATIVE, "/crash": Shape.NATIVE,
          "/left": Shape.NATIVE}
APP = Starlette(
    routes=[
        Route("/status", _raising(KV_FULL)),
        Route("/unmapped", _raising(KV_FULL)),
        Route("/native", _raising(KV_FULL)),
        Route("/openai", _raising(BAD_TOP_P)),
        Route("/weights", _raising(PAUSED)),
        Route("/gone", _raising(ClientGone())),
        Route("/left", _replica_left),
        Route("/forever", _raising_never),
        Route("/crash", _raising(RuntimeError("bug"))),
        Route("/crash_unmapped", _raising(RuntimeError("bug"))),
        Route("/late_bug", _failing_after_first_chunk(RuntimeError("bug"))),
        Route("/late_error", _failing_after_first_chunk(KV_FULL)),
    ],
    middleware=[Middleware(HttpErrors, shapes=SHAPES)],
)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=APP)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


def _failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == "http_request_failed"]


@pytest.mark.parametrize(
    ("path", "status", "body"),
    [
        ("/status", 429, {"code": 8, "message": "out of KV cache", "details": []}),
        ("/unmapped", 429, {"code": 8, "message": "out of KV cache", "details": []}),
        ("/native", 429, {"error": {"message": "out of KV cache", "code": 429,
                                    "type": "RESOURCE_EXHAUSTED"}}),
        ("/openai", 400, {"error": {"message": "top_p: must be in (0, 1]",
                                    "type": "invalid_request_error", "param": "top_p",
                                    "code": "invalid_argument"}}),
        ("/weights", 400, {"success": False, "message": "the scheduler is paused",
                           "num_paused_requests": 0}),
    ],
)
async def test_mesh_error_in_the_routes_shape(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, path: str, status: int,
    body: dict[str, Any]
) -> None:
    with caplog.at_level(logging.ERROR):
        r = await client.get(path)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert r.json() == body
    assert _failures(caplog) == []  # a MeshError is an answer, not a bug


async def test_client_gone_is_499_whatever_the_shape(client: httpx.AsyncClient) -> None:
    r = await client.get("/gone")
    assert r.status_code == CLIENT_GONE == 499
    assert r.content == b""


async def test_a_call_cancelled_under_the_route_is_a_503(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        r = await client.get("/left")
    assert r.status_code == 503
    assert r.json() == {"error": {"message": (
        "a call inside the mesh was cancelled: the replica it went to left the mesh; "
        "calling again is safe"), "code": 503, "type": "UNAVAILABLE"}}
    assert _failures(caplog) == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/crash", {"error": {"message": "internal error", "code": 500, "type": "INTERNAL"}}),
        ("/crash_unmapped", {"code": 13, "message": "internal error", "details": []}),
    ],
)
async def test_unexpected_exception_is_a_logged_500(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, path: str,
    body: dict[str, Any]
) -> None:
    with caplog.at_level(logging.ERROR):
        r = await client.get(path)
    assert r.status_code == 500
    assert r.json() == body
    [line] = _failures(caplog)
    assert line.levelno == logging.ERROR and line.fields == {"path": path}  # type: ignore[attr-defined]
    assert line.exc_info is not None and line.exc_info[0] is RuntimeError


async def test_a_route_whose_own_task_is_cancelled_is_not_answered() -> None:
    sent: list[Any] = []
    call = asyncio.ensure_future(_raw_get("/forever", sent))
    await asyncio.wait_for(ENTERED.wait(), timeout=5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert sent == []


async def _raw_get(path: str, sent: list[Any] | None = None) -> list[Any]:
    """The messages the app sends for GET `path`, over raw ASGI (httpx refuses a response that
    never ends, which is what a route that fails mid-stream leaves: the server closes it)."""
    sent = [] if sent is None else sent
    inbox = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> Any:
        if inbox:
            return inbox.pop()
        await asyncio.Event().wait()  # the client stays: only the app ends the exchange

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [], "client": ("127.0.0.1", 5000),
             "server": ("gw", 80)}
    await asyncio.wait_for(APP(scope, receive, send), timeout=5)
    return sent


@pytest.mark.parametrize(("path", "logged"), [("/late_bug", 1), ("/late_error", 0)])
async def test_failure_after_the_response_began_adds_nothing(
    caplog: pytest.LogCaptureFixture, path: str, logged: int
) -> None:
    with caplog.at_level(logging.ERROR):
        sent = await _raw_get(path)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"first" and sent[1]["more_body"]
    failures = _failures(caplog)
    assert len(failures) == logged  # a bug is logged; a MeshError is the stream's to report
    assert all(r.fields == {"path": path} for r in failures)  # type: ignore[attr-defined]


async def test_other_scopes_pass_through_untouched() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])
        raise RuntimeError("not http")

    async def receive() -> Any:
        raise AssertionError("not called")

    async def send(message: Any) -> None:
        raise AssertionError("nothing is answered")

    with pytest.raises(RuntimeError, match="not http"):
        await HttpErrors(app, {})({"type": "websocket", "path": "/ws"}, receive, send)
    assert seen == ["websocket"]


def test_error_response_with_an_explicit_status() -> None:
    err = MeshError(grpc.StatusCode.INVALID_ARGUMENT, "body: larger than 1024 bytes")
    r = error_response(Shape.NATIVE, err, status=413, headers={"connection": "close"})
    assert r.status_code == 413
    assert r.headers["connection"] == "close"
    assert r.media_type == "application/json"
    assert orjson.loads(r.body) == {"error": {
        "message": "body: larger than 1024 bytes", "code": 413, "type": "INVALID_ARGUMENT"}}
    default = error_response(Shape.NATIVE, err)
    assert default.status_code == 400 and orjson.loads(default.body)["error"]["code"] == 400
