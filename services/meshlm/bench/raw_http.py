"""The HTTP load generator of `make bench`: POST a JSON body, read the Server-Sent Events of the
reply, over kept-alive HTTP/1.1 connections, and nothing more.

It shares a CPU with the mesh's gateway, tokenizer and detokenizer when the bench pins, so
what it costs is taken from the mesh being measured: httpx spent about 66 µs of CPU per streamed
token there (more than the gateway), a StreamReader loop about a third of it, and this, which
reads the chunked reply in an asyncio Protocol's callback and hands each event (its lines,
without the blank line that ends it) to the caller's callback where its bytes arrive, less
again (see `make bench`'s load generator line). Their JSON is the caller's.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import cast


class HttpError(RuntimeError):
    """The server answered with a status other than 200, broke HTTP/1.1's framing, or went."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.keep = True  # the server did not say Connection: close
        self._buf = b""
        self._head: bytes | None = None  # the reply's status line and headers, once read
        self._events = b""  # the chunks' data not yet split into events
        self._on_event: Callable[[bytes], None] | None = None
        self._done: asyncio.Future[None] | None = None
        self._lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        # as curl and browsers do: otherwise Nagle + delayed ACK hold small writes ~40 ms
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, request: bytes, on_event: Callable[[bytes], None]) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._lost is not None or self.transport is None:
            done.set_exception(HttpError(f"connection lost: {self._lost}"))
            return done
        self._buf, self._head, self._events = b"", None, b""
        self._on_event, self._done = on_event, done
        self.transport.write(request)
        return done

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        try:
            buf = self._read(buf)
        except Exception as exc:  # bad framing, a bad status, or the caller's callback failed
            self._finish(exc if isinstance(exc, HttpError) else HttpError(f"the reply: {exc!r}"))
            assert self.transport is not None
            self.transport.close()
            return
        self._buf = buf

    def _read(self, buf: bytes) -> bytes:
        """Take the head, then whole chunks, from `buf`; return what is left of it."""
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return buf
            self._head, buf = buf[:end + 4], buf[end + 4:]
            headers = self._head.lower()
            if self._head[9:12] != b"200" or b"transfer-encoding: chunked" not in headers:
                line = self._head.split(b"\r\n", 1)[0].decode(errors="replace")
                raise HttpError(f"the reply: {line}")
            self.keep = b"connection: close" not in headers
        while (line_end := buf.find(b"\r\n")) >= 0:
            size = int(buf[:line_end], 16)
            chunk_end = line_end + 2 + size
            if len(buf) < chunk_end + 2:
                break
            chunk, buf = buf[line_end + 2:chunk_end], buf[chunk_end + 2:]
            if size == 0:
                self._finish(None)
                return buf
            events = self._events + chunk if self._events else chunk
            start = 0
            on_event = self._on_event
            assert on_event is not None
            while (end := events.find(b"\n\n", start)) >= 0:
                on_event(events[start:end])
                start = end + 2
            self._events = events[start:]
        return buf

    def _finish(self, error: BaseException | None) -> None:
        done, self._done, self._on_event = self._done, None, None
        if done is not None and not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionError("closed by the server")
        self._finish(HttpError(f"connection lost: {self._lost}"))


class SsePool:
    """Kept-alive connections to `host:port`, one per request in flight; with `keepalive`
    False, a connection per request (`Connection: close`)."""

    def __init__(self, host: str, port: int, keepalive: bool = True) -> None:
        self.host = host
        self.port = port
        self._idle: list[_Connection] = []
        self._close = b"" if keepalive else b"Connection: close\r\n"

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
        return conn

    async def stream(self, path: str, body: bytes, on_event: Callable[[bytes], None]) -> None:
        """POST `body` (JSON) to `path`; `on_event(bytes)` gets each event of the streamed
        reply as it arrives. Returns when the reply ended; the connection is kept."""
        conn = self._idle.pop() if self._idle else await self._connect()
        try:
            await conn.send(
                b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                b"%sContent-Length: %d\r\n\r\n%s"
                % (path.encode(), self.host.encode(), self.port, self._close, len(body), body),
                on_event)
        except BaseException:
            assert conn.transport is not None
            conn.transport.close()
            raise
        if conn.keep and not self._close:
            self._idle.append(conn)
        else:
            assert conn.transport is not None
            conn.transport.close()

    def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
