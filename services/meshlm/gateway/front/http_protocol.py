"""uvicorn's HTTP/1.1 protocol (httptools) with a deadline on each request's head.

uvicorn times a connection out only between two requests (its keep-alive timer, armed once a
response is complete): a client that connects and sends nothing, or sends a request's head a
byte at a time, holds its connection for ever, and a few thousand of them take every file
descriptor the gateway has (slowloris). Here a request's head, from the connection's start or
from its first byte, must be complete within `--http-read-timeout`, or the connection closes;
the body's pieces are held to the same time apart (`front/body_limit.py`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from meshlm.common.logs import get_logger

log = get_logger(__name__)


def timed_http(timeout: float) -> type[asyncio.Protocol]:
    """The protocol class for uvicorn.Config(http=...); `timeout` <= 0: uvicorn's own."""
    if timeout <= 0:
        return HttpToolsProtocol

    class TimedHead(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._head_timer is None:  # the connection's first request keeps its start
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            log.info("http_head_timeout", client=f"{self.client[0]}:{self.client[1]}"
                     if self.client else "", timeout=timeout)
            self.transport.close()

    return TimedHead
