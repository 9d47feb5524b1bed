"""One HTTP/2 connection of the native gRPC server: an asyncio Protocol that reads frames where
their bytes arrive, keeps both directions' flow control, and writes everything its streams send
in one loop turn as one socket write (a step's messages to every stream of a connection leave
together, which is most of what this server saves over grpc.aio's per-message path).

Streams are gRPC calls: a HEADERS block opens one (the server looks its method up and runs it,
`server.py`), DATA frames carry its length-prefixed request messages, and the answer is a
HEADERS block, DATA frames and a trailing HEADERS block with the status (`stream.py`). Protocol
errors close the connection with GOAWAY; a stream's own errors end that stream only. A client
silent past the server's keepalive idle time is PINGed, and its connection closed if nothing
comes back within the timeout.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Any, cast

from hpack import Decoder, HPACKError

from meshlm.common.logs import get_logger
from meshlm.common.native_grpc import frames as h2
from meshlm.common.native_grpc.call import CallDetails, Metadata, binary_value
from meshlm.common.native_grpc.flow import Keepalive, Writer
from meshlm.common.native_grpc.stream import SEND_BUFFER, Stream, StreamError

if TYPE_CHECKING:
    from meshlm.common.native_grpc.server import NativeServer

log = get_logger(__name__)

RECV_WINDOW = 4 * 1024 * 1024  # the connection's, as this server grants it
MAX_STREAMS = 1024  # concurrent calls on one connection
DRAIN_WAIT_S = 1.0  # the longest wait for a client's answer to the shutdown's PING
_DRAIN_PING = b"draining"
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3
UNACKED_LIMIT_MS = 40_000  # sent data unacknowledged this long: the peer is gone
# Rapid reset (CVE-2023-44487): a client that opens calls and resets them at once makes the
# server start and cancel a handler for each, without ever waiting for one to finish (one
# connection held a gateway's loop for 8 s, 30,000 calls a second). Each call the client resets
# while it runs costs 2 of this budget and each call it opens gives 1 back, so a client that
# cancels under a third of its calls never spends it; past it, GOAWAY ENHANCE_YOUR_CALM.
RESET_BUDGET = 1000
_RESERVED = frozenset((b"content-type", b"te", b"grpc-timeout", b"grpc-encoding",
                       b"grpc-accept-encoding", b"content-length", b"connection"))
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


class ConnectionError_(Exception):
    """The peer broke HTTP/2: GOAWAY with `code`, then close."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code

class Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection."""

    def __init__(self, server: NativeServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.streams: dict[int, Stream] = {}
        self.stream_window = h2.DEFAULT_WINDOW  # new streams' send window (peer's setting)
        self.paused = False
        self.going_away = False  # no new streams: the final GOAWAY is sent (or received)
        self._draining = False  # the first GOAWAY is sent
        self.drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.last_stream = 0
        self.reset_debt = 0  # see RESET_BUDGET
        self._decoder = Decoder()
        self._decoder.max_header_list_size = server.max_header_bytes
        self._buf = b""
        self._preface = False
        self._block: tuple[int, int, bytearray] | None = None  # (stream, flags, fragments)
        self._recv_unacked = 0
        self._loop = asyncio.get_running_loop()
        self.out = Writer(self._loop)  # the connection's send window, frames to send
        self.queue = self.out.queue
        self.keepalive: Keepalive | None = None

    # -- asyncio's callbacks --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = self.out.transport = tcp = cast(asyncio.Transport, transport)
        sock = tcp.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
        self.peer = _peer_name(tcp.get_extra_info("peername"))
        self.server.connections.add(self)
        ours = {h2.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                h2.INITIAL_WINDOW_SIZE: self.server.stream_window,
                h2.MAX_HEADER_LIST_SIZE: self.server.max_header_bytes, h2.ENABLE_PUSH: 0}
        self.queue(h2.frame(h2.SETTINGS, 0, 0, h2.settings(ours)) + h2.frame(
            h2.WINDOW_UPDATE, 0, 0, (RECV_WINDOW - h2.DEFAULT_WINDOW).to_bytes(4, "big")))
        if self.server.keepalive is not None:
            idle, timeout = self.server.keepalive
            self.keepalive = Keepalive(self._loop, idle, timeout, self.out, self._silent)

    def data_received(self, data: bytes) -> None:
        if self.keepalive is not None:
            self.keepalive.heard()
        try:
            self._read(data)
        except ConnectionError_ as exc:
            self.server.log_protocol_error(self.peer, str(exc))
            self._goaway(exc.code, str(exc))
            self.out.flush()
            if self.transport is not None:
                self.transport.close()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        for stream in list(self.streams.values()):
            stream.wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.keepalive is not None:
            self.keepalive.stop()
        if not self.drained.done():
            self.drained.set_result(None)
        for stream in list(self.streams.values()):
            self.close_stream(stream)
            if stream.task is not None:
                stream.task.cancel()

    def _silent(self, seconds: float) -> None:
        """The client answered no keepalive PING: it hangs, and its calls end (cancelled)."""
        log.warning("keepalive_timeout", peer=self.peer, silent_s=round(seconds, 1),
                    streams=len(self.streams))
        if self.transport is not None:
            self.transport.abort()

    # -- reading ---------------------------------------------------------------------------
    def _read(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        at = 0
        if not self._preface:
            if len(buf) < len(h2.PREFACE):
                self._buf = buf
                return
            if not buf.startswith(h2.PREFACE):
                raise ConnectionError_(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._preface, at = True, len(h2.PREFACE)
        try:
            self._buf = buf[h2.split(buf, at, self._on_frame):]
        except h2.FrameSizeError as exc:
            raise ConnectionError_(h2.FRAME_SIZE_ERROR, str(exc)) from None

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is not None and (kind != h2.CONTINUATION or stream_id != self._block[0]):
            raise ConnectionError_(h2.PROTOCOL_ERROR, "a header block was interrupted")
        if kind == h2.DATA:
            self._on_data(stream_id, flags, payload)
        elif kind == h2.HEADERS:
            self._on_headers(stream_id, flags, payload)
        elif kind == h2.CONTINUATION:
            self._on_continuation(stream_id, flags, payload)
        else:
            self._on_control(kind, flags, stream_id, payload)

    def _on_data(self, stream_id: int, flags: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(h2.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_unacked += size
        if self._recv_unacked >= RECV_WINDOW // 2:
            self.queue(h2.frame(h2.WINDOW_UPDATE, 0, 0, self._recv_unacked.to_bytes(4, "big")))
            self._recv_unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_ended:
            if stream_id > self.last_stream:
                raise ConnectionError_(h2.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream this side has closed: its late data is dropped
        if flags & h2.PADDED:
            payload = _unpadded(payload)
        end = bool(flags & h2.END_STREAM)
        try:
            stream.on_data(payload, end)
        except StreamError as exc:
            stream.finish(exc.code, exc.message, [])
            if stream.task is not None:
                stream.task.cancel()
            return
        stream.received(size)

    def _on_headers(self, stream_id: int, flags: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(h2.PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & h2.PADDED:
            payload = _unpadded(payload)
        if flags & h2.PRIORITY_FLAG:
            payload = payload[5:]
        self._block = (stream_id, flags, bytearray(payload))
        if flags & h2.END_HEADERS:
            self._end_block()

    def _on_continuation(self, stream_id: int, flags: int, payload: bytes) -> None:
        if self._block is None:
            raise ConnectionError_(h2.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        self._block[2].extend(payload)
        if len(self._block[2]) > 4 * self.server.max_header_bytes:
            raise ConnectionError_(h2.ENHANCE_YOUR_CALM, "a header block too large")
        if flags & h2.END_HEADERS:
            self._end_block()

    def _end_block(self) -> None:
        assert self._block is not None
        stream_id, flags, block = self._block
        self._block = None
        try:
            fields = [(bytes(n), bytes(v)) for n, v in self._decoder.decode(bytes(block), raw=True)]
        except HPACKError as exc:
            raise ConnectionError_(h2.COMPRESSION_ERROR, f"a header block: {exc}") from None
        end = bool(flags & h2.END_STREAM)
        stream = self.streams.get(stream_id)
        if stream is not None:  # the request's trailers
            if not end:
                raise ConnectionError_(h2.PROTOCOL_ERROR, "trailers without END_STREAM")
            stream.on_data(b"", True)
            return
        if stream_id % 2 == 0 or stream_id <= self.last_stream:
            raise ConnectionError_(h2.PROTOCOL_ERROR, f"a new stream with id {stream_id}")
        self.last_stream = stream_id
        if self.reset_debt:
            self.reset_debt -= 1
        stream = Stream(stream_id, self, self.stream_window)
        if self.going_away or len(self.streams) >= MAX_STREAMS:
            self.queue(h2.frame(h2.RST_STREAM, 0, stream_id,
                                h2.REFUSED_STREAM.to_bytes(4, "big")))
            return
        self.streams[stream_id] = stream
        self._open(stream, fields, end)

    def _open(self, stream: Stream, fields: list[tuple[bytes, bytes]], end: bool) -> None:
        pseudo: dict[bytes, bytes] = {}
        metadata: list[tuple[str, str | bytes]] = []
        timeout: float | None = None
        content_type = b""
        for name, value in fields:
            if name.startswith(b":"):
                pseudo[name] = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = _timeout(value)
            elif name == b"grpc-encoding":
                stream.encoding = value
            elif name not in _RESERVED:
                key = name.decode("latin-1")
                metadata.append((key, binary_value(key, value)))
        if pseudo.get(b":method") != b"POST":
            return self._http_error(stream, b"405")
        if not content_type.startswith(b"application/grpc"):
            return self._http_error(stream, b"415")
        path = pseudo.get(b":path", b"").decode("latin-1")
        stream.sink = self.server.sinks.get(path)
        if end:
            stream.on_data(b"", True)
        deadline = None if timeout is None else self._loop.time() + timeout
        stream.task = self._loop.create_task(self.server.run_call(
            stream, CallDetails(path, tuple(metadata)), self.peer, deadline))

    def _http_error(self, stream: Stream, status: bytes) -> None:
        """Not a gRPC request: an HTTP status, and the stream ends."""
        self.queue(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, stream.id,
                            h2.literal(b":status", status)))
        self.close_stream(stream)
        if not stream.remote_ended:
            self.queue(h2.frame(h2.RST_STREAM, 0, stream.id, h2.NO_ERROR.to_bytes(4, "big")))

    def _on_control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == h2.SETTINGS:
            if stream_id != 0 or len(payload) % 6:
                raise ConnectionError_(h2.PROTOCOL_ERROR, "a malformed SETTINGS frame")
            if not flags & h2.ACK:
                self._apply_settings(payload)
                self.queue(h2.frame(h2.SETTINGS, h2.ACK, 0))
        elif kind == h2.PING:
            if len(payload) != 8:
                raise ConnectionError_(h2.FRAME_SIZE_ERROR, "a PING frame not of 8 bytes")
            if not flags & h2.ACK:
                self.queue(h2.frame(h2.PING, h2.ACK, 0, payload))
            elif payload == _DRAIN_PING:
                self._final_goaway()
        elif kind == h2.WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == h2.RST_STREAM:
            stream = self.streams.get(stream_id)
            if stream is not None:
                self.close_stream(stream)
                if stream.task is not None:
                    stream.task.cancel()
                self.reset_debt += 2
                if self.reset_debt > RESET_BUDGET:
                    raise ConnectionError_(h2.ENHANCE_YOUR_CALM, "the client reset far more "
                                           "calls than it let finish (rapid reset)")
        elif kind == h2.GOAWAY:
            self.going_away = True
        elif kind == h2.PUSH_PROMISE:
            raise ConnectionError_(h2.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown types: ignored, as HTTP/2 asks

    def _apply_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == h2.INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise ConnectionError_(h2.FLOW_CONTROL_ERROR, "a window over 2^31-1")
                delta, self.stream_window = value - self.stream_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
                if delta > 0:
                    self._pump_blocked()
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise ConnectionError_(h2.PROTOCOL_ERROR, f"a frame size of {value}")
                self.out.max_frame = value

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(h2.FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        increment = int.from_bytes(payload, "big") & h2.MAX_WINDOW
        if stream_id == 0:
            if increment == 0 or self.out.send_window + increment > h2.MAX_WINDOW:
                raise ConnectionError_(h2.FLOW_CONTROL_ERROR, "a bad connection window update")
            self.out.send_window += increment
            self._pump_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            self.pump(stream)

    # -- writing ---------------------------------------------------------------------------
    def pump(self, stream: Stream) -> None:
        """Send as much of `stream`'s waiting data as the windows allow, then its trailers."""
        if not self.out.pump(stream):
            if len(stream.pending) <= SEND_BUFFER:
                stream.wake()
            return
        stream.wake()
        if stream.trailers is not None:
            self.queue(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, stream.id,
                                stream.trailers))
            remote_open = not stream.remote_ended
            self.close_stream(stream)
            if remote_open:  # the call is over: the client need not send the rest
                self.queue(h2.frame(h2.RST_STREAM, 0, stream.id, h2.NO_ERROR.to_bytes(4, "big")))

    def _pump_blocked(self) -> None:
        for stream in list(self.out.blocked.values()):
            if self.out.send_window <= 0:
                return
            self.pump(cast(Stream, stream))

    def close_stream(self, stream: Stream) -> None:
        stream.closed = True
        stream.wake()
        self.streams.pop(stream.id, None)
        self.out.blocked.pop(stream.id, None)
        if self.going_away and not self.streams and self.transport is not None:
            self._loop.call_soon(self._close_after_flush)

    def _close_after_flush(self) -> None:
        self.out.flush()
        if self.transport is not None and not self.streams:
            self.transport.close()

    def goaway(self) -> None:
        """No new calls on this connection; it closes once its calls have ended. Graceful, as
        HTTP/2 asks: a first GOAWAY (last stream 2^31-1) with a PING; calls the client sent
        before it read that are still taken, until its answer to the PING (or DRAIN_WAIT_S);
        then the final GOAWAY names the last call taken (`drained` is done)."""
        if self.going_away or self._draining:
            return
        self._draining = True
        self.queue(h2.frame(h2.GOAWAY, 0, 0, h2.MAX_WINDOW.to_bytes(4, "big")
                            + h2.NO_ERROR.to_bytes(4, "big"))
                   + h2.frame(h2.PING, 0, 0, _DRAIN_PING))
        self._loop.call_later(DRAIN_WAIT_S, self._final_goaway)

    def _final_goaway(self) -> None:
        if self.going_away:
            return
        self._goaway(h2.NO_ERROR, "")
        if not self.streams and self.transport is not None:
            self._loop.call_soon(self._close_after_flush)

    def _goaway(self, code: int, message: str) -> None:
        self.going_away = True
        if not self.drained.done():
            self.drained.set_result(None)
        self.queue(h2.frame(h2.GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big")
                            + code.to_bytes(4, "big") + message.encode()[:200]))


def _keepalive(sock: socket.socket) -> None:
    """A peer that vanished (no FIN, no RST) is found by TCP's probes: after KEEPALIVE_IDLE_S
    of silence, KEEPALIVE_PROBES unanswered probes KEEPALIVE_INTERVAL_S apart close the
    connection, as grpc's pings do on the grpc.aio port (PUBLIC_KEEPALIVE); data left
    unacknowledged for UNACKED_LIMIT_MS does too."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                          ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                          ("TCP_USER_TIMEOUT", UNACKED_LIMIT_MS)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _unpadded(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise ConnectionError_(h2.PROTOCOL_ERROR, "padding past the frame")
    return payload[1:len(payload) - payload[0]]


def _timeout(value: bytes) -> float | None:
    """grpc-timeout ("100m", "5S", ...) in seconds; None where it does not parse."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def _peer_name(peername: Any) -> str:
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
    return f"unix:{peername}" if peername else "unknown"


__all__ = ["Connection", "Metadata", "Stream", "StreamError"]
