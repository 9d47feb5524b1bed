"""The HTTP load generator of `make bench`: POST a JSON body, read the Server-Sent Events of the
reply, over kept-alive HTTP/1.1 connections, and nothing more.

It shares a CPU with the mesh's gateway, tokenizer and detokenizer when the bench pins, so
what it costs is taken from the mesh being measured: httpx spent about 66 µs of CPU per streamed
token there (more than the gateway), this about a third of it (see `make bench`'s load
generator line). It reads the chunked reply, splits events at blank lines and leaves their JSON
to the caller.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator


class HttpError(RuntimeError):
    """The server answered with a status other than 200, or broke HTTP/1.1's framing."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class SsePool:
    """Kept-alive connections to `host:port`, one per request in flight."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        # as curl and browsers do: otherwise Nagle + delayed ACK hold small writes ~40 ms
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(reader, writer)

    async def events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST `body` (JSON) to `path`; yield each event of the streamed reply (its lines,
        without the blank line that ends it). The connection is kept when the reply ends."""
        conn = self._idle.pop() if self._idle else await self._connect()
        try:
            conn.writer.write(
                b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s"
                % (path.encode(), self.host.encode(), self.port, len(body), body))
            head = await conn.reader.readuntil(b"\r\n\r\n")
            status = head[9:12]
            headers = head.lower()
            if status != b"200" or b"transfer-encoding: chunked" not in headers:
                raise HttpError(f"{path}: {head.splitlines()[0].decode(errors='replace')}")
            pending = b""
            while True:
                size = int(await conn.reader.readuntil(b"\r\n"), 16)
                chunk = await conn.reader.readexactly(size + 2)  # the data and its CRLF
                if size == 0:
                    break
                pending += chunk[:-2]
                while (end := pending.find(b"\n\n")) >= 0:
                    yield pending[:end]
                    pending = pending[end + 2:]
        except BaseException:
            conn.close()
            raise
        if b"connection: close" in headers:
            conn.close()
        else:
            self._idle.append(conn)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
