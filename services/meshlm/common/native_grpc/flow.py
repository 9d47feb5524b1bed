"""What both ends of a native HTTP/2 connection do alike (the server's `connection.py`, the
client's `client.py`): write a loop turn's frames in one socket write, send a stream's waiting
data as the peer's windows allow, and keep a silent peer in check with PINGs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from meshlm.common.native_grpc import frames as h2


class Writer:
    """Frames queued during a loop turn leave together, in one write at its end."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.send_window = h2.DEFAULT_WINDOW  # the connection's, as the peer grants it
        self.max_frame = h2.DEFAULT_FRAME_SIZE
        self.blocked: dict[int, Sending] = {}  # streams waiting for a window

    def queue(self, data: bytes) -> None:
        """Send `data` at the end of this loop turn, with whatever else is sent in it."""
        if not self._out:
            self._loop.call_soon(self.flush)
        self._out.append(data)

    def flush(self) -> None:
        if self._out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def pump(self, stream: Sending) -> bool:
        """Send as much of `stream.pending` as the windows allow; whether all of it went (if
        not, the stream waits in `blocked` for a WINDOW_UPDATE)."""
        pending = stream.pending
        while pending:
            size = min(len(pending), stream.send_window, self.send_window, self.max_frame)
            if size <= 0:
                self.blocked[stream.id] = stream
                return False
            self.queue(h2.frame(h2.DATA, 0, stream.id, bytes(pending[:size])))
            del pending[:size]
            stream.send_window -= size
            self.send_window -= size
        self.blocked.pop(stream.id, None)
        return True


class Sending(Protocol):
    id: int
    send_window: int
    pending: bytearray


class Keepalive:
    """PING a peer silent for `idle` seconds; `expire()` when nothing at all arrived within
    `timeout` after the PING (a hung peer's sockets stay open: its calls would wait for ever).
    The connection calls `heard()` whenever bytes arrive.

    Whether anything came after the PING is a flag, not a comparison of times: a loop's clock
    may not move between the PING and its answer (uvloop's is read once a loop turn, to the
    millisecond), and the answer then looked as old as the PING."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: float, timeout: float,
                 writer: Writer, expire: Callable[[float], None]) -> None:
        self._loop = loop
        self._idle, self._timeout = idle, timeout
        self._writer = writer
        self._expire = expire
        self.last_read = loop.time()
        self.answered = True  # something arrived since the last PING
        self._ping_sent: float | None = None
        self._timer = loop.call_later(idle, self._check)

    def heard(self) -> None:
        """Bytes arrived from the peer."""
        self.last_read = self._loop.time()
        self.answered = True

    def stop(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        if self._ping_sent is not None and not self.answered:
            if now - self._ping_sent >= self._timeout:
                self._expire(now - self.last_read)
                return
            delay = self._ping_sent + self._timeout - now
        elif (silent := now - self.last_read) >= self._idle:
            self._ping_sent = now
            self.answered = False
            self._writer.queue(h2.frame(h2.PING, 0, 0, b"liveness"))
            delay = self._timeout
        else:
            self._ping_sent = None
            delay = self._idle - silent
        self._timer = self._loop.call_later(delay, self._check)
