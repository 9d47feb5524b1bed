"""The HTTP body bound (`--http-max-body-bytes`): an ASGI middleware in front of every route.

A body over the limit is answered 413 before it is read: at once when its Content-Length says
so, else as soon as the chunks received (a chunked upload) pass the limit; what was received is
dropped. A body within it is read here and handed to the app in one piece, so no route ever
holds more than the limit. After a 413 the server reads and discards the rest of the upload
(uvicorn does), so a client that sends its whole body first still gets the answer. Once a big
body's request is over, its memory is reclaimed (`front/reclaim.py`).

A body whose pieces come more than `read_timeout` apart is answered 408 (a client trickling
its upload would hold the request, and its memory, for ever); the request's head is held to
the same time by the protocol (`front/http_protocol.py`).
"""

from __future__ import annotations

import asyncio

import grpc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.gateway.front.errors import Shape, error_response
from meshlm.gateway.front.reclaim import Reclaimer

log = get_logger(__name__)

FLAG = "--http-max-body-bytes"
ENV = "MESHLM_HTTP_MAX_BODY_BYTES"


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int, reclaim: Reclaimer | None = None,
                 read_timeout: float = 0.0) -> None:
        self.app = app
        self.limit = limit  # bytes; 0 or less: no limit
        self.reclaim = reclaim or Reclaimer()
        self.read_timeout = read_timeout if read_timeout > 0 else None  # seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.limit <= 0 and self.read_timeout is None):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and 0 < self.limit < declared:
            await self._refuse(scope, send, declared, "content-length")
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            try:
                async with asyncio.timeout(self.read_timeout):
                    message = await receive()
            except TimeoutError:
                await self._too_slow(scope, send, size)
                return
            if message["type"] != "http.request":  # the client left: the app sees it
                await self.app(scope, _replay(message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if 0 < self.limit < size:
                chunks.clear()
                await self._refuse(scope, send, size, "received")
                self.reclaim.after(size)
                return
            if chunk:
                chunks.append(chunk)
            more = message.get("more_body", False)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        chunks.clear()
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.reclaim.after(size)

    async def _refuse(self, scope: Scope, send: Send, size: int, how: str) -> None:
        """413 naming the limit and how to raise it."""
        log.info("http_body_too_large", path=scope.get("path", ""), limit=self.limit,
                 bytes=size, by=how)
        await _answer(scope, send, 413, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"request body: {'declared ' if how == 'content-length' else 'over '}"
                      f"{size} bytes, more than this gateway's limit of {self.limit} bytes "
                      f"(raise it with {FLAG} or {ENV})")

    async def _too_slow(self, scope: Scope, send: Send, size: int) -> None:
        """408: the body's next piece did not come within read_timeout."""
        log.info("http_body_timeout", path=scope.get("path", ""), bytes=size,
                 timeout=self.read_timeout)
        await _answer(scope, send, 408, grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"request body: nothing more came for {self.read_timeout:g} s after "
                      f"{size} bytes (raise the limit with --http-read-timeout or "
                      f"MESHLM_HTTP_READ_TIMEOUT)")


async def _answer(scope: Scope, send: Send, status: int, code: grpc.StatusCode,
                  message: str) -> None:
    """The request's answer, a native error body, before its body was read (whole)."""
    await error_response(Shape.NATIVE, MeshError(code, message), status=status)(
        scope, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's parser refuses it; count what arrives instead
    return None


def _replay(first: Message, receive: Receive) -> Receive:
    """A receive that gives `first`, then what the server gives (a disconnect, later)."""
    pending: list[Message] = [first]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
