"""The gRPC load generator of `make bench`: server-streaming calls over one cleartext HTTP/2
connection (prior knowledge, as grpc's insecure channel), read in an asyncio Protocol's
callback, and nothing more.

It shares a CPU with the mesh's gateway, tokenizer and detokenizer when the bench pins, so what
it costs is taken from the mesh being measured: grpc.aio's client spent 60-85 µs of CPU per
streamed message there (more than half the gateway's figure), as every message wakes its
channel's threads and then the call's coroutine. Here a message is parsed and handed to the
call's callback where its bytes arrive: no thread, no task per message (see `make bench`'s load
generator line).

What it leaves out, being a benchmark's client: header decoding (HPACK). A call counts as
answered when its callback has seen the last message it expects (the caller decides, e.g.
`finished`); a stream that ends (trailers, RST_STREAM, GOAWAY, a lost connection) before that
fails the call with the status grpc's trailers would say only as "ended early".
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import cast

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
_END_STREAM, _ACK, _END_HEADERS, _PADDED = 0x1, 0x1, 0x4, 0x8
_MAX_WINDOW = 2**31 - 1
_DEFAULT_WINDOW = 65_535
_SETTING_INITIAL_WINDOW = 0x4


class CallError(RuntimeError):
    """A call's stream ended before its last message, or the connection was lost."""


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream.to_bytes(4, "big") + payload)


def _literal(name: bytes, value: bytes) -> bytes:
    """One HPACK header field, literal without indexing, new name, no Huffman coding."""
    return b"\x00" + _hpack_int(len(name)) + name + _hpack_int(len(value)) + value


def _hpack_int(n: int) -> bytes:
    """A string length with HPACK's 7-bit prefix (H bit clear)."""
    if n < 127:
        return bytes((n,))
    out = bytearray((127,))
    n -= 127
    while n >= 128:
        out.append(n % 128 + 128)
        n //= 128
    out.append(n)
    return bytes(out)


class _Call:
    __slots__ = ("on_message", "done", "pending")

    def __init__(self, on_message: Callable[[bytes], bool], done: asyncio.Future[None]) -> None:
        self.on_message = on_message  # returns True at the call's last message
        self.done = done
        self.pending = b""  # a message split across DATA frames


class GrpcConnection(asyncio.Protocol):
    """One HTTP/2 connection carrying any number of concurrent server-streaming calls."""

    def __init__(self, authority: str) -> None:
        self._authority = authority.encode()
        self._transport: asyncio.Transport | None = None
        self._buf = b""
        self._calls: dict[int, _Call] = {}
        self._next_stream = 1
        self._send_window = _DEFAULT_WINDOW  # the connection's, granted by the server
        self._stream_window = _DEFAULT_WINDOW  # each new stream's (the server's setting)
        self._blocked: list[tuple[int, bytes]] = []  # (stream, DATA frame's payload) to send
        self._received = 0  # DATA bytes since this connection's window was last topped up
        self._closed: BaseException | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> GrpcConnection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: cls(f"{host}:{port}"), host, port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = tcp = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        tcp.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        settings = _SETTING_INITIAL_WINDOW.to_bytes(2, "big") + _MAX_WINDOW.to_bytes(4, "big")
        tcp.write(_PREFACE + _frame(_SETTINGS, 0, 0, settings) + _frame(
            _WINDOW_UPDATE, 0, 0, (_MAX_WINDOW - _DEFAULT_WINDOW).to_bytes(4, "big")))

    def call(self, path: str, request: bytes, on_message: Callable[[bytes], bool]
             ) -> asyncio.Future[None]:
        """Start a call of method `path` (/package.Service/Method) with the serialized
        `request`; `on_message(bytes)` gets each reply message as it arrives and returns True
        at the last one. The future is done when it did, or fails (CallError)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._closed is not None or self._transport is None:
            done.set_exception(CallError(f"connection lost: {self._closed}"))
            return done
        stream = self._next_stream
        self._next_stream += 2
        self._calls[stream] = _Call(on_message, done)
        headers = b"".join((
            _literal(b":method", b"POST"), _literal(b":scheme", b"http"),
            _literal(b":path", path.encode()), _literal(b":authority", self._authority),
            _literal(b"content-type", b"application/grpc"), _literal(b"te", b"trailers")))
        self._transport.write(_frame(_HEADERS, _END_HEADERS, stream, headers))
        body = b"\x00" + len(request).to_bytes(4, "big") + request
        if len(body) > self._stream_window:
            self._fail(stream, CallError(f"request of {len(body)} bytes over the stream's "
                                         f"window ({self._stream_window})"))
        else:
            self._blocked.append((stream, body))
            self._send_blocked()
        return done

    def _send_blocked(self) -> None:
        assert self._transport is not None
        while self._blocked and len(self._blocked[0][1]) <= self._send_window:
            stream, body = self._blocked.pop(0)
            self._send_window -= len(body)
            self._transport.write(_frame(_DATA, _END_STREAM, stream, body))

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        at, end = 0, len(buf)
        while end - at >= 9:
            length = int.from_bytes(buf[at:at + 3], "big")
            if end - at - 9 < length:
                break
            kind, flags = buf[at + 3], buf[at + 4]
            stream = int.from_bytes(buf[at + 5:at + 9], "big") & _MAX_WINDOW
            payload = buf[at + 9:at + 9 + length]
            at += 9 + length
            if kind == _DATA:
                self._on_data(stream, flags, payload)
            elif kind == _HEADERS:
                if flags & _END_STREAM:
                    self._fail(stream, CallError("the stream ended before its last message"))
            else:
                self._on_control(kind, flags, stream, payload)
        self._buf = buf[at:]

    def _on_data(self, stream: int, flags: int, payload: bytes) -> None:
        self._received += len(payload)
        if self._received > 2**30:  # keep the connection's window open
            assert self._transport is not None
            self._transport.write(_frame(_WINDOW_UPDATE, 0, 0, self._received.to_bytes(4, "big")))
            self._received = 0
        call = self._calls.get(stream)
        if call is None:
            return
        if flags & _PADDED:
            payload = payload[1:len(payload) - payload[0]]
        data = call.pending + payload if call.pending else payload
        at, end = 0, len(data)
        while end - at >= 5:
            size = int.from_bytes(data[at + 1:at + 5], "big")
            if end - at - 5 < size:
                break
            message = data[at + 5:at + 5 + size]
            at += 5 + size
            try:
                last = call.on_message(message)
            except Exception as exc:  # the caller's own check failed: the call fails
                self._fail(stream, exc)
                return
            if last:
                del self._calls[stream]
                if not call.done.done():
                    call.done.set_result(None)
                return
        call.pending = data[at:]
        if flags & _END_STREAM:
            self._fail(stream, CallError("the stream ended before its last message"))

    def _on_control(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        assert self._transport is not None
        if kind == _SETTINGS and not flags & _ACK:
            for i in range(0, len(payload) - 5, 6):
                if int.from_bytes(payload[i:i + 2], "big") == _SETTING_INITIAL_WINDOW:
                    self._stream_window = int.from_bytes(payload[i + 2:i + 6], "big")
            self._transport.write(_frame(_SETTINGS, _ACK, 0))
        elif kind == _PING and not flags & _ACK:
            self._transport.write(_frame(_PING, _ACK, 0, payload))
        elif kind == _WINDOW_UPDATE and stream == 0:
            self._send_window += int.from_bytes(payload[:4], "big") & _MAX_WINDOW
            self._send_blocked()
        elif kind == _RST_STREAM:
            code = int.from_bytes(payload[:4], "big")
            self._fail(stream, CallError(f"the server reset the stream (HTTP/2 error {code})"))
        elif kind == _GOAWAY:  # no new calls; those the server will not answer fail
            self._closed = CallError("the server is going away")
            last = int.from_bytes(payload[:4], "big") & _MAX_WINDOW
            for s in [s for s in self._calls if s > last]:
                self._fail(s, CallError("the server is going away"))

    def _fail(self, stream: int, error: BaseException) -> None:
        call = self._calls.pop(stream, None)
        if call is not None and not call.done.done():
            call.done.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = exc or ConnectionError("closed")
        for stream in list(self._calls):
            self._fail(stream, CallError(f"connection lost: {self._closed}"))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
