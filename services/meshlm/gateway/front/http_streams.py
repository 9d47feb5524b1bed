"""The HTTP front's streamed answers: NDJSON of a transcoded server stream, SGLang's SSE of
/generate (several prompts' streams merged), and the response that closes the api iterator
however the stream ends (which aborts an unfinished request)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from meshlm.gateway.front.disconnect import ClientGone, unless_disconnected
from meshlm.gateway.front.errors import Shape, error_body, failure
from meshlm.gateway.front.sse import SSE_DONE, NativeChoices, sse_event
from meshlm.gateway.protocol import transcode

EMPTY = object()  # what `first` gives for a stream that ended without a message


async def first(stream: AsyncIterator[Any]) -> Any:
    """The stream's first message (EMPTY if none); closes the stream when that fails."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return EMPTY
    except BaseException:
        await aclose(stream)
        raise


async def aclose(stream: Any) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


class Streams:
    """The api streams of one /generate call (one per prompt), closed together."""

    def __init__(self, streams: list[AsyncIterator[Any]]) -> None:
        self.streams = streams

    async def aclose(self) -> None:
        for stream in self.streams:
            await aclose(stream)


async def first_of_each(streams: list[AsyncIterator[Any]]) -> list[Any]:
    """Each stream's first message, fetched concurrently; the first failure is raised (the
    caller closes the streams)."""
    firsts = await asyncio.gather(*(first(s) for s in streams), return_exceptions=True)
    for got in firsts:
        if isinstance(got, BaseException):
            raise got
    return firsts


async def drain(parts: list[tuple[NativeChoices, AsyncIterator[Any]]]) -> None:
    """Fold every stream into its choices, concurrently; the first failure cancels the rest."""
    async def one(out: NativeChoices, stream: AsyncIterator[Any]) -> None:
        async for message in stream:
            out.add(message)

    tasks = [asyncio.ensure_future(one(out, stream)) for out, stream in parts]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def ndjson(head: Any, stream: AsyncIterator[Any], path: str) -> AsyncIterator[bytes]:
    """A server stream whose first message was `head` as NDJSON: {"result": message} lines;
    after a failure, one {"error": Status JSON} line."""
    if head is EMPTY:
        return
    yield transcode.result_line(head)
    try:
        async for message in stream:
            yield transcode.result_line(message)
    except Exception as e:  # noqa: BLE001 - the stream's last line says it
        yield transcode.error_line(failure(e, path))


async def sse(parts: list[tuple[NativeChoices, Any, AsyncIterator[Any]]]
              ) -> AsyncIterator[bytes]:
    """SSE events of every prompt's stream, in arrival order, then [DONE]; a failed stream
    ends with an error event (the others go on). The queue is bounded, so a client that
    stops reading stops the streams too (backpressure, no buffering without limit)."""
    if len(parts) == 1:  # one prompt: its events as they come, without a queue or a task
        async with aclosing(_events(*parts[0])) as events:
            async for chunk in events:
                yield chunk
        yield SSE_DONE
        return
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=2 * len(parts))

    async def pump(out: NativeChoices, head: Any, stream: AsyncIterator[Any]) -> None:
        async with aclosing(_events(out, head, stream)) as events:
            async for chunk in events:
                await queue.put(chunk)
        await queue.put(None)  # not when cancelled: then nobody reads the queue any more

    tasks = [asyncio.ensure_future(pump(*part)) for part in parts]
    try:
        running = len(tasks)
        while running:
            event = await queue.get()
            if event is None:
                running -= 1
            else:
                yield event
        yield SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _events(out: NativeChoices, head: Any, stream: AsyncIterator[Any]
                  ) -> AsyncGenerator[bytes, None]:
    """One prompt's SSE events (its first message `head`); a failure is its last event."""
    try:
        if head is not EMPTY:
            yield out.add(head).event()
            async for message in stream:
                yield out.add(message).event()
    except Exception as e:  # noqa: BLE001 - the stream's error event says it
        yield sse_event(error_body(Shape.NATIVE, failure(e, "/generate")))


BODY_SEND = "meshlm.body_send"  # the scope's key for the server's own `send`


class BodySendApp(Starlette):
    """Starlette, keeping the server's own `send` in the scope for a streamed response's body.
    The middleware (Starlette's error and exception handling, the API-key check, the body
    limit, the error answers, the route's wrapper) each wrap `send` only to see whether the
    response has started, so the chunks after the start need not pass through them: six calls
    fewer per streamed token. A middleware that must see body chunks cannot be added here."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[BODY_SEND] = send
        await super().__call__(scope, receive, send)


def body_send(scope: Scope, send: Send) -> Send:
    """Where a streamed response writes its body after the start went through `send`."""
    return scope.get(BODY_SEND, send)  # type: ignore[no-any-return]


class DirectBody:
    """A streamed response's chunks written straight to its connection from outside the
    response's task (the gateway's direct writes, `api/direct.py`), while the connection can
    take them at once: uvicorn's httptools connection (the object whose method the server's
    `send` is: its transport, flow control and response state), its response started and
    chunked, not complete, the client there and the socket not paused. Where `send` is
    anything else (h11's connection writes through its own state machine), nothing is
    written this way and the response's task writes every chunk."""

    def __init__(self, frame: Callable[[bytes], bytes] | None = None) -> None:
        self._cycle: Any = None
        self._frame = frame  # what a written piece becomes on the wire (an SSE event)

    def attach(self, body: Send) -> None:
        """`body`: the server's own send, once the response has started."""
        cycle = getattr(body, "__self__", None)
        if all(hasattr(cycle, a) for a in _CYCLE_FIELDS):
            self._cycle = cycle

    def detach(self) -> None:
        self._cycle = None

    def writable(self) -> bool:
        cycle = self._cycle
        return (cycle is not None and cycle.chunked_encoding and not cycle.disconnected
                and not cycle.response_complete and not cycle.flow.write_paused)

    def write(self, chunk: bytes) -> None:
        """Write `chunk` (framed) as the server would: one HTTP/1.1 chunk; only when
        `writable()`."""
        if self._frame is not None:
            chunk = self._frame(chunk)
        self._cycle.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))


_CYCLE_FIELDS = ("transport", "flow", "chunked_encoding", "disconnected", "response_complete")


class StreamResponse(Response):
    """Streams `chunks`. Whether the stream ends, fails or the client leaves, closes `chunks`
    and then the api iterator `source` (which aborts the request if it is not finished).
    `direct`: where chunks may also be written from outside, once the response has started."""

    def __init__(self, chunks: AsyncIterator[bytes], source: Any, media_type: str,
                 direct: DirectBody | None = None) -> None:
        self.chunks = chunks
        self.source = source
        self.direct = direct
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(self._pump(send, body_send(scope, send)), receive)
        except (ClientGone, OSError):
            pass  # the client went away: nobody to tell
        finally:
            if self.direct is not None:
                self.direct.detach()
            await aclose(self.chunks)
            await aclose(self.source)

    async def _pump(self, send: Send, body: Send) -> None:
        corked = _cork(body)  # the head and the first chunk in one segment: one wake-up
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            if self.direct is not None:
                self.direct.attach(body)
            async for chunk in self.chunks:
                await body({"type": "http.response.body", "body": chunk, "more_body": True})
                if corked is not None:
                    _uncork(corked)
                    corked = None
            if self.direct is not None:
                self.direct.detach()
            await body({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if corked is not None:
                _uncork(corked)


def _cork(body: Send) -> Any:
    """The TCP socket under uvicorn's httptools connection (the object whose method `body`
    is), corked: the server writes a response's head and its first chunk separately, and
    each write went out as a segment of its own, waking the client for the head alone. None
    where there is no such socket (another server, a Unix socket, no TCP_CORK)."""
    transport = getattr(getattr(body, "__self__", None), "transport", None)
    extra = getattr(transport, "get_extra_info", None)
    sock: Any = extra("socket") if callable(extra) else None
    if (not hasattr(socket, "TCP_CORK") or not hasattr(sock, "setsockopt")
            or getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6)):
        return None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
    except OSError:
        return None
    return sock


def _uncork(sock: Any) -> None:
    """Send what the cork held (at once: the connection is TCP_NODELAY)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
