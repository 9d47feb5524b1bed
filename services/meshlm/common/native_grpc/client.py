"""The client side of the mesh's batched streams, in asyncio: one HTTP/2 connection per peer,
read in an asyncio Protocol where its bytes arrive and written once per loop turn, as the
native server does (`connection.py`).

Why: a grpc.aio call hands each message from the event loop to grpc core's threads, and each
reply back; on the mesh's hops, where one batch a step goes out, that hand-off was most of a
hop's latency. The generated stubs work unchanged: `NativeChannel` answers `stream_stream` and
`stream_unary` (the batched streams' two kinds), and its calls do what `BatchedStream` asks of
a grpc.aio call: `write`, iterate the replies, await the end, `cancel`; a failed call raises
`grpc.aio.AioRpcError` with its status. Unary calls stay on grpc.aio's channels.

Keepalive as the mesh's grpc channels have it (common/channels.py): a connection silent for
KEEPALIVE_TIME_MS is PINGed, and closed when the answer takes longer than PING_TIMEOUT_MS,
which fails every call on it UNAVAILABLE (a hung peer is down within DOWN_BOUND).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any, cast

import grpc
from hpack import Decoder, HPACKError

from meshlm.common.channels import (
    KEEPALIVE_TIME_MS,
    MESH_MESSAGE_BYTES,
    PING_TIMEOUT_MS,
    MessageTooLarge,
)
from meshlm.common.logs import get_logger
from meshlm.common.native_grpc import frames as h2
from meshlm.common.native_grpc.flow import Keepalive, Writer

log = get_logger(__name__)

RECV_WINDOW = 4 * 1024 * 1024  # each call's and the connection's, as this client grants it
SEND_BUFFER = 256 * 1024  # a call's unsent bytes past which `write` waits
CONNECT_TIMEOUT_S = 5.0
BACKOFF_S = (0.1, 1.0)  # reconnect backoff: first, longest (as the grpc channels')
_NO_METADATA = grpc.aio.Metadata()


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, _NO_METADATA, _NO_METADATA, details)


class _Call:
    """One call's stream: what it sends waits here for the windows; replies queue here."""

    def __init__(self, conn: ClientConnection, stream_id: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.send_window = conn.peer_stream_window
        self.pending = bytearray()  # framed messages waiting for a window
        self.replies: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.status: grpc.aio.AioRpcError | None = None  # the end, once known (OK included)
        self.ended = conn.loop.create_future()  # done with the status
        self.sent_end = False
        self.recv_unacked = 0
        self._partial = h2.Partial()
        self._writable: asyncio.Future[None] | None = None

    def end(self, status: grpc.aio.AioRpcError) -> None:
        if self.status is None:
            self.status = status
            self.replies.put_nowait(None)
            self.ended.set_result(None)
            self.wake()
        self.conn.calls.pop(self.id, None)
        self.conn.out.blocked.pop(self.id, None)

    def on_data(self, data: bytes) -> None:
        buf = self._partial.join(data)
        if buf is None:
            return
        at = 0
        while len(buf) - at >= 5:
            size = int.from_bytes(buf[at + 1:at + 5], "big")
            if len(buf) - at - 5 < size:
                break
            if buf[at]:
                self.conn.reset(self, h2.PROTOCOL_ERROR, grpc.StatusCode.INTERNAL,
                                "a compressed reply (this client asks for none)")
                return
            self.replies.put_nowait(buf[at + 5:at + 5 + size])
            at += 5 + size
        self._partial.keep(buf, at)

    def wake(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    async def wait_writable(self) -> None:
        while len(self.pending) > 0 and self.status is None:
            self._writable = self.conn.loop.create_future()
            await self._writable


class NativeCall:
    """A streamed-request call (bidi or client-streaming), as BatchedStream uses grpc.aio's."""

    def __init__(self, call: _Call, serialize: Callable[[Any], bytes],
                 deserialize: Callable[[bytes], Any]) -> None:
        self._call = call
        self._serialize = serialize
        self._deserialize = deserialize

    async def write(self, message: Any) -> None:
        """Send one message; waits while the peer's windows hold it back. One over the mesh's
        limit raises MessageTooLarge, with nothing sent."""
        call = self._call
        if call.status is not None:
            if call.status.code() == grpc.StatusCode.OK:
                raise asyncio.InvalidStateError("the call has already ended")
            raise call.status
        if call.sent_end:
            raise asyncio.InvalidStateError("the call's requests were already ended")
        data = self._serialize(message)
        if len(data) > MESH_MESSAGE_BYTES:
            raise MessageTooLarge(len(data))  # the peer would fail the call for it
        call.conn.send_message(call, b"\x00" + len(data).to_bytes(4, "big") + data)
        call.conn.out.flush()  # a batch is already one message a turn: no turn's wait for it
        if call.pending:
            await call.wait_writable()
            if call.status is not None and call.status.code() != grpc.StatusCode.OK:
                raise call.status

    def write_nowait(self, message: Any) -> bool:
        """Send one message at once if nothing of the call's waits to be sent before it; False,
        with nothing sent, otherwise (or once the call has ended). What the peer's windows do
        not take at once goes when they open, in order."""
        call = self._call
        if call.status is not None or call.sent_end or call.pending:
            return False
        data = self._serialize(message)
        if len(data) > MESH_MESSAGE_BYTES:
            return False  # `write` says why
        call.conn.send_message(call, b"\x00" + len(data).to_bytes(4, "big") + data)
        call.conn.out.flush()
        return True

    async def done_writing(self) -> None:
        call = self._call
        if call.status is None and not call.sent_end:
            call.sent_end = True
            call.conn.send_end(call)

    def cancel(self) -> bool:
        call = self._call
        if call.status is not None:
            return False
        call.conn.reset(call, h2.CANCEL, grpc.StatusCode.CANCELLED, "Locally cancelled")
        return True

    def done(self) -> bool:
        return self._call.status is not None

    async def code(self) -> grpc.StatusCode:
        await asyncio.shield(self._call.ended)
        assert self._call.status is not None
        return self._call.status.code()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._replies()

    async def _replies(self) -> AsyncIterator[Any]:
        call = self._call
        while (raw := await call.replies.get()) is not None:
            call.conn.consumed(call, len(raw) + 5)
            yield self._deserialize(raw)
        assert call.status is not None
        if call.status.code() != grpc.StatusCode.OK:
            raise call.status

    def __await__(self) -> Generator[Any, None, Any]:
        return self._response().__await__()

    async def _response(self) -> Any:
        """The call's one reply (client-streaming calls), or its error."""
        last = None
        async for reply in self:
            last = reply
        return last


class ClientConnection(asyncio.Protocol):
    """One HTTP/2 connection to a peer, carrying any number of calls."""

    def __init__(self, authority: str, scheme: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.authority = authority.encode()
        self.scheme = scheme.encode()
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, _Call] = {}
        self.next_id = 1
        self.out = Writer(self.loop)  # the connection's send window, frames to send
        self.queue = self.out.queue
        self.peer_stream_window = h2.DEFAULT_WINDOW
        self.closed = False
        self.going_away = False
        self.settled = self.loop.create_future()  # done at the server's first SETTINGS
        self._decoder = Decoder()
        self._buf = b""
        self._block: tuple[int, int, bytearray] | None = None
        self._recv_unacked = 0
        self.keepalive: Keepalive | None = None

    # -- asyncio's callbacks --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = self.out.transport = tcp = transport  # type: ignore[assignment]
        sock = tcp.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ours = {h2.ENABLE_PUSH: 0, h2.INITIAL_WINDOW_SIZE: RECV_WINDOW}
        self.queue(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, h2.settings(ours)) + h2.frame(
            h2.WINDOW_UPDATE, 0, 0, (RECV_WINDOW - h2.DEFAULT_WINDOW).to_bytes(4, "big")))
        self.keepalive = Keepalive(self.loop, KEEPALIVE_TIME_MS / 1000, PING_TIMEOUT_MS / 1000,
                                   self.out, self._silent)

    def data_received(self, data: bytes) -> None:
        if self.keepalive is not None:
            self.keepalive.heard()
        try:
            self._read(data)
        except (ValueError, IndexError, HPACKError) as exc:  # a malformed frame
            self._fail_all(grpc.StatusCode.INTERNAL, f"the peer broke HTTP/2: {exc}")
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.keepalive is not None:
            self.keepalive.stop()
        if not self.settled.done():
            self.settled.set_exception(ConnectionError(f"connection lost: {exc}"))
        self._fail_all(grpc.StatusCode.UNAVAILABLE,
                       f"connection to {self.authority.decode()} lost"
                       + (f": {exc}" if exc else ""))

    def pause_writing(self) -> None:
        pass  # calls wait on the HTTP/2 windows, which bound what the socket buffers

    def resume_writing(self) -> None:
        pass

    # -- calls -----------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return not self.closed and not self.going_away and self.next_id < h2.MAX_WINDOW

    def open(self, path: str) -> _Call:
        if not self.usable:
            raise _error(grpc.StatusCode.UNAVAILABLE, "the connection is closing")
        call = _Call(self, self.next_id)
        self.next_id += 2
        self.calls[call.id] = call
        block = b"".join(h2.literal(k, v) for k, v in (
            (b":method", b"POST"), (b":scheme", self.scheme), (b":path", path.encode()),
            (b":authority", self.authority), (b"content-type", b"application/grpc"),
            (b"te", b"trailers")))
        self.queue(h2.frame(h2.HEADERS, h2.END_HEADERS, call.id, block))
        return call

    def send_message(self, call: _Call, framed: bytes) -> None:
        size = len(framed)
        out = self.out
        if (not call.pending and size <= call.send_window and size <= out.send_window
                and size <= out.max_frame):
            call.send_window -= size
            out.send_window -= size
            self.queue(h2.frame(h2.DATA, 0, call.id, framed))
        else:
            call.pending += framed
            self.pump(call)

    def send_end(self, call: _Call) -> None:
        if call.pending:
            return  # pump sends END_STREAM after the rest
        self.queue(h2.frame(h2.DATA, h2.END_STREAM, call.id))

    def pump(self, call: _Call) -> None:
        if not self.out.pump(call):
            return
        call.wake()
        if call.sent_end:
            self.queue(h2.frame(h2.DATA, h2.END_STREAM, call.id))

    def consumed(self, call: _Call, size: int) -> None:
        """The caller read `size` bytes of replies: give them back to the server."""
        call.recv_unacked += size
        if call.recv_unacked >= RECV_WINDOW // 2 and call.status is None:
            self.queue(h2.frame(h2.WINDOW_UPDATE, 0, call.id,
                                call.recv_unacked.to_bytes(4, "big")))
            call.recv_unacked = 0

    def reset(self, call: _Call, code: int, status: grpc.StatusCode, details: str) -> None:
        if call.id in self.calls:
            self.queue(h2.frame(h2.RST_STREAM, 0, call.id, code.to_bytes(4, "big")))
        call.end(_error(status, details))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.out.flush()
            self.transport.close()

    # -- reading ---------------------------------------------------------------------------
    def _read(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        self._buf = buf[h2.split(buf, 0, self._on_frame):]

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == h2.DATA:
            self._on_data(stream_id, flags, payload)
        elif kind in (h2.HEADERS, h2.CONTINUATION):
            self._on_headers(kind, stream_id, flags, payload)
        else:
            self._on_control(kind, flags, stream_id, payload)

    def _on_data(self, stream_id: int, flags: int, payload: bytes) -> None:
        self._recv_unacked += len(payload)
        if self._recv_unacked >= RECV_WINDOW // 2:
            self.queue(h2.frame(h2.WINDOW_UPDATE, 0, 0, self._recv_unacked.to_bytes(4, "big")))
            self._recv_unacked = 0
        call = self.calls.get(stream_id)
        if call is None:
            return
        if flags & h2.PADDED:
            if not payload or payload[0] >= len(payload):
                raise ValueError("padding past the frame")
            payload = payload[1:len(payload) - payload[0]]
        call.on_data(payload)
        if flags & h2.END_STREAM and call.status is None:  # no trailers: a broken answer
            call.end(_error(grpc.StatusCode.INTERNAL, "the stream ended without a status"))

    def _on_headers(self, kind: int, stream_id: int, flags: int, payload: bytes) -> None:
        if kind == h2.HEADERS:
            if flags & h2.PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & h2.PRIORITY_FLAG:
                payload = payload[5:]
            self._block = (stream_id, flags, bytearray(payload))
        elif self._block is None or self._block[0] != stream_id:
            raise ValueError("a CONTINUATION out of place")
        else:
            self._block[2].extend(payload)
        if not flags & h2.END_HEADERS:
            return
        sid, first_flags, block = self._block
        self._block = None
        fields = dict(self._decoder.decode(bytes(block), raw=True))  # keep the table in step
        call = self.calls.get(sid)
        if call is None:
            return
        status = fields.get(b"grpc-status")
        if status is None:
            if fields.get(b":status", b"200") != b"200":
                call.end(_error(grpc.StatusCode.UNAVAILABLE,
                                f"HTTP status {fields[b':status'].decode()}"))
            return  # the answer's headers
        message = urllib.parse.unquote(fields.get(b"grpc-message", b"").decode("latin-1"))
        try:
            code = _CODES[int(status)]
        except (ValueError, KeyError):
            code = grpc.StatusCode.UNKNOWN
        call.end(_error(code, message))
        if not call.sent_end:  # the server ended the call: stop its stream both ways
            self.queue(h2.frame(h2.RST_STREAM, 0, sid, h2.NO_ERROR.to_bytes(4, "big")))

    def _on_control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == h2.SETTINGS:
            if not flags & h2.ACK:
                self._apply_settings(payload)
                self.queue(h2.frame(h2.SETTINGS, h2.ACK, 0))
                if not self.settled.done():
                    self.settled.set_result(None)
        elif kind == h2.PING:
            if not flags & h2.ACK:
                self.queue(h2.frame(h2.PING, h2.ACK, 0, payload))
        elif kind == h2.WINDOW_UPDATE:
            increment = int.from_bytes(payload, "big") & h2.MAX_WINDOW
            if stream_id == 0:
                self.out.send_window += increment
                for blocked in list(self.out.blocked.values()):
                    if self.out.send_window <= 0:
                        break
                    self.pump(cast(_Call, blocked))
            elif (call := self.calls.get(stream_id)) is not None:
                call.send_window += increment
                self.pump(call)
        elif kind == h2.RST_STREAM:
            if (call := self.calls.get(stream_id)) is not None:
                reason = int.from_bytes(payload[:4], "big")
                code = (grpc.StatusCode.UNAVAILABLE if reason == h2.REFUSED_STREAM
                        else grpc.StatusCode.CANCELLED if reason == h2.CANCEL
                        else grpc.StatusCode.INTERNAL)
                call.end(_error(code, f"the server reset the stream (HTTP/2 error {reason})"))
        elif kind == h2.GOAWAY:
            self.going_away = True
            last = int.from_bytes(payload[:4], "big") & h2.MAX_WINDOW
            for sid in [s for s in self.calls if s > last]:  # never taken: safe to retry
                self.calls[sid].end(_error(grpc.StatusCode.UNAVAILABLE, "the server is going away"))

    def _apply_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == h2.INITIAL_WINDOW_SIZE:
                delta, self.peer_stream_window = value - self.peer_stream_window, value
                for call in self.calls.values():
                    call.send_window += delta
                    if delta > 0:
                        self.pump(call)
            elif key == h2.MAX_FRAME_SIZE:
                self.out.max_frame = value

    def _fail_all(self, code: grpc.StatusCode, details: str) -> None:
        for call in list(self.calls.values()):
            call.end(_error(code, details))

    def _silent(self, seconds: float) -> None:
        """The server answered no keepalive PING: it hangs; every call here fails."""
        self._fail_all(grpc.StatusCode.UNAVAILABLE,
                       f"keepalive: {self.authority.decode()} did not answer a ping within "
                       f"{PING_TIMEOUT_MS / 1000:g} s")
        if self.transport is not None:
            self.transport.abort()


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class NativeChannel:
    """The streams' channel to one peer: a generated stub built on it opens its streamed-
    request methods on one HTTP/2 connection, made (and made again after it is lost) by
    `channel_ready`, with backoff while the peer is down."""

    def __init__(self, address: str, tls: ssl.SSLContext | None,
                 server_hostname: str | None = None) -> None:
        host, _, port = address.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._tls = tls
        self._server_hostname = server_hostname or self._host
        self._address = address
        self._conn: ClientConnection | None = None
        self._backoff = BACKOFF_S[0]
        self._failure = ""  # the last connection failure logged
        self._closed = False

    # -- what a generated stub asks of a channel ------------------------------------------
    def stream_stream(self, method: str, request_serializer: Callable[[Any], bytes] | None = None,
                      response_deserializer: Callable[[bytes], Any] | None = None,
                      **_: Any) -> Callable[[], NativeCall]:
        serialize = request_serializer or (lambda m: m)
        deserialize = response_deserializer or (lambda b: b)

        def open_call() -> NativeCall:
            conn = self._conn
            if conn is None or not conn.usable:
                raise _error(grpc.StatusCode.UNAVAILABLE, f"not connected to {self._address}")
            return NativeCall(conn.open(method), serialize, deserialize)
        return open_call

    stream_unary = stream_stream

    def unary_unary(self, method: str, *_: Any, **__: Any) -> Callable[..., Any]:
        def unsupported(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"{method}: unary calls go on grpc.aio's channel")
        return unsupported

    unary_stream = unary_unary

    # -- the connection --------------------------------------------------------------------
    async def channel_ready(self) -> None:
        """Return once a connection is up (the server's SETTINGS read), connecting as needed
        and retrying with backoff (0.1 s doubling to 1 s) while the peer cannot be reached."""
        while not self._closed:
            conn = self._conn
            if conn is not None and conn.usable:
                return
            if conn is not None:
                conn.close()
            try:
                self._conn = await asyncio.wait_for(self._connect(), CONNECT_TIMEOUT_S)
                self._backoff, self._failure = BACKOFF_S[0], ""
                return
            except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
                failure = f"{type(exc).__name__}: {exc}"
                if failure != self._failure:  # once per reason, not once per retry
                    log.warning("stream_connect_failed", peer=self._address, error=failure)
                    self._failure = failure
                await asyncio.sleep(self._backoff)  # reconnect backoff, not synchronisation
                self._backoff = min(self._backoff * 2, BACKOFF_S[1])
        raise _error(grpc.StatusCode.CANCELLED, "the channel is closed")

    async def _connect(self) -> ClientConnection:
        loop = asyncio.get_running_loop()
        scheme = "https" if self._tls is not None else "http"
        _, conn = await loop.create_connection(
            lambda: ClientConnection(self._address, scheme), self._host, self._port,
            ssl=self._tls, server_hostname=self._server_hostname if self._tls else None)
        try:
            await conn.settled
        except BaseException:
            conn.close()
            raise
        return conn

    async def close(self, grace: float | None = None) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn._fail_all(grpc.StatusCode.CANCELLED, "the channel was closed")
            self._conn.close()
            self._conn = None
