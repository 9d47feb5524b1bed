"""One call's HTTP/2 stream on the native gRPC server: its request messages in (read by the
handler, with the client's window given back as the handler reads them), its answer out
(written through the connection, within the windows the client grants)."""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.common.native_grpc import frames as h2

if TYPE_CHECKING:
    from meshlm.common.native_grpc.connection import Connection

log = get_logger(__name__)

Sink = Callable[[bytes], None]  # takes one request message of a call (`NativeServer.add_sink`)

# A DATA frame's header (length in 3 bytes, type DATA, no flags, stream id) and the gRPC
# message's (not compressed, length) in one pack.
_DATA_HEAD = struct.Struct(">HBxxIxI")
SEND_BUFFER = 256 * 1024  # a stream's unsent bytes past which its handler waits
MAX_QUEUED_REQUESTS = 1024  # a streamed call's request messages not yet read by its handler
RESPONSE_HEADERS = h2.literal(b":status", b"200") + h2.literal(b"content-type",
                                                               b"application/grpc")


class StreamError(Exception):
    """A call's request broke the protocol gRPC layers on HTTP/2: the call ends with `code`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Stream:
    """One call's HTTP/2 stream: its request messages in, its answer out."""

    __slots__ = ("id", "conn", "send_window", "recv_unacked", "unread", "pending", "trailers",
                 "headers_sent", "remote_ended", "closed", "task", "encoding", "_inbox",
                 "_partial", "_writable", "sink")

    def __init__(self, stream_id: int, conn: Connection, send_window: int) -> None:
        self.id = stream_id
        self.conn = conn
        self.send_window = send_window
        self.recv_unacked = 0  # DATA bytes received and not yet given back to the client
        self.unread = 0  # bytes of request messages queued for the handler, not yet read
        self.pending = bytearray()  # DATA payload waiting for a window
        self.trailers: bytes | None = None  # the last HEADERS block, once the call ended
        self.headers_sent = False
        self.remote_ended = False
        self.closed = False
        self.task: asyncio.Task[None] | None = None
        self.encoding = b"identity"
        self._inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._partial = h2.Partial()
        self._writable: asyncio.Future[None] | None = None
        # Takes each request message where its bytes arrive, instead of the handler
        # (`NativeServer.add_sink`); the handler then reads only the end of the requests.
        self.sink: Sink | None = None

    # -- requests -------------------------------------------------------------------------
    def on_data(self, data: bytes, end: bool) -> None:
        buf = self._partial.join(data) or b""
        at, size_limit = 0, self.conn.server.max_receive_bytes
        while len(buf) - at >= 5:
            size = int.from_bytes(buf[at + 1:at + 5], "big")
            if size > size_limit:
                self._inbox.put_nowait(None)
                raise StreamError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"Received message larger than max ({size} vs. {size_limit})")
            if len(buf) - at - 5 < size:
                break
            message = buf[at + 5:at + 5 + size]
            if buf[at]:
                message = self._decompressed(message)
            if self.sink is not None:
                at += 5 + size
                self._sink(message)
                continue
            if self._inbox.qsize() >= MAX_QUEUED_REQUESTS:
                raise StreamError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"more than {MAX_QUEUED_REQUESTS} request messages unread")
            self._inbox.put_nowait(message)
            self.unread += len(message) + 5
            at += 5 + size
        self._partial.keep(buf, at)
        if end:
            self.remote_ended = True
            self._inbox.put_nowait(None)

    def _sink(self, message: bytes) -> None:
        """Hand `message` to the sink; its failure ends the call (a MeshError with its status,
        anything else INTERNAL, logged)."""
        assert self.sink is not None
        try:
            self.sink(message)
        except MeshError as exc:
            self._inbox.put_nowait(None)
            raise StreamError(exc.code, exc.message) from None
        except Exception as exc:  # noqa: BLE001 - one call's failure, not the connection's
            log.exception("sink_failed", peer=self.conn.peer, stream=self.id, error=repr(exc))
            self._inbox.put_nowait(None)
            raise StreamError(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}") from None

    def _decompressed(self, message: bytes) -> bytes:
        if self.encoding not in (b"gzip", b"deflate"):
            raise StreamError(grpc.StatusCode.INTERNAL, "a compressed message without a "
                              f"grpc-encoding this server reads ({self.encoding.decode()})")
        limit = self.conn.server.max_receive_bytes
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if self.encoding == b"gzip" else 0)
        out = inflater.decompress(message, limit + 1)
        if len(out) > limit:
            raise StreamError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"Received message larger than max (over {limit} bytes inflated)")
        return out

    async def request(self, streaming: bool) -> Any:
        """The call's request: its one message, or (streaming) an iterator of them."""
        if streaming:
            return self._requests()
        first = await self._inbox.get()
        if first is None:
            raise StreamError(grpc.StatusCode.INTERNAL,
                              "the call ended before its request message")
        if await self._inbox.get() is not None:
            raise StreamError(grpc.StatusCode.INTERNAL,
                              "more than one request message for a unary call")
        return first

    async def _requests(self) -> AsyncIterator[bytes]:
        while (message := await self._inbox.get()) is not None:
            self.unread -= len(message) + 5
            self.grant()
            yield message

    def received(self, size: int) -> None:
        """`size` bytes of DATA arrived for this stream (its messages already queued)."""
        self.recv_unacked += size
        self.grant()

    def grant(self) -> None:
        """Give the client back the window its DATA used, unless the handler has a window's
        worth of messages (or half MAX_QUEUED_REQUESTS of them) unread: a client is held to
        what its handler keeps up with (the sender's own queue then merges what waits, as on
        the grpc.aio mesh ports)."""
        window = self.conn.server.stream_window
        if (self.recv_unacked >= window // 2 and self.unread < window and not self.remote_ended
                and self._inbox.qsize() < MAX_QUEUED_REQUESTS // 2):
            self.conn.queue(h2.frame(h2.WINDOW_UPDATE, 0, self.id,
                                     self.recv_unacked.to_bytes(4, "big")))
            self.recv_unacked = 0

    # -- the answer -----------------------------------------------------------------------
    def send_headers(self, extra: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
        if self.headers_sent or self.closed:
            return
        self.headers_sent = True
        block = RESPONSE_HEADERS + b"".join(h2.literal(k, v) for k, v in extra)
        self.conn.queue(h2.frame(h2.HEADERS, h2.END_HEADERS, self.id, block))

    async def send_message(self, data: bytes) -> None:
        if self.closed:
            raise asyncio.CancelledError("the call's stream is closed")
        if not self.headers_sent:
            self.send_headers()
        conn = self.conn
        if not self._framed(data):
            self.pending += b"\x00" + len(data).to_bytes(4, "big") + data
            conn.pump(self)
        if len(self.pending) > SEND_BUFFER or conn.paused:
            await self._wait_writable()

    def send_now(self, data: bytes) -> bool:
        """Queue a message at once if the call has begun answering and the message can go
        without waiting (nothing unsent before it, within the windows, the socket not
        paused); False, with nothing sent, otherwise."""
        if self.closed or not self.headers_sent or self.conn.paused:
            return False
        return self._framed(data)

    def _framed(self, data: bytes) -> bool:
        """Queue `data` as one DATA frame if nothing waits before it and the windows allow."""
        size = len(data) + 5
        out = self.conn.out
        if (self.pending or size > self.send_window or size > out.send_window
                or size > out.max_frame):
            return False
        self.send_window -= size
        out.send_window -= size
        out.queue(_DATA_HEAD.pack(size >> 8, size & 0xFF, self.id, len(data)) + data)
        return True

    async def _wait_writable(self) -> None:
        while (len(self.pending) > SEND_BUFFER or self.conn.paused) and not self.closed:
            self._writable = asyncio.get_running_loop().create_future()
            await self._writable
        if self.closed:
            raise asyncio.CancelledError("the call's stream is closed")

    def wake(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def finish(self, code: grpc.StatusCode, details: str,
               trailing: list[tuple[bytes, bytes]]) -> None:
        """End the call with its status (after what it sent)."""
        if self.closed:
            return
        block = (b"" if self.headers_sent else RESPONSE_HEADERS) + h2.literal(
            b"grpc-status", str(code.value[0]).encode())
        if details:
            block += h2.literal(b"grpc-message", h2.grpc_message(details))
        block += b"".join(h2.literal(k, v) for k, v in trailing)
        self.headers_sent = True
        self.trailers = block
        self.conn.pump(self)

    def reset(self, code: int) -> None:
        """End the stream with RST_STREAM (the call is not answered further)."""
        if not self.closed:
            self.conn.queue(h2.frame(h2.RST_STREAM, 0, self.id, code.to_bytes(4, "big")))
            self.conn.close_stream(self)
