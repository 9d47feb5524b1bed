"""A service's metrics on a port of its own (`--metrics-port`): GET /metrics, plain HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator

import uvicorn
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from meshlm.common.metrics import ServiceMetrics


class MetricsServer:
    """GET /metrics on a port of its own (plain HTTP), served on the service's event loop, so
    collectors read service state from the thread that owns it."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics
        self.address = ""  # host:port once started
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> str:
        """Bind and serve; returns the bound host:port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
        sock.setblocking(False)
        self._server = _Server(uvicorn.Config(
            self._app, log_config=None, access_log=False, lifespan="off", loop="none",
            interface="asgi3", proxy_headers=False))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="metrics")
        port = sock.getsockname()[1]
        bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.address = f"{bracketed}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._task, 2.0)

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            response = Response(b"not found: scrape /metrics\n", 404, media_type="text/plain")
        elif scope["method"] not in ("GET", "HEAD"):
            response = Response(b"", 405, headers={"allow": "GET, HEAD"})
        else:
            accept = dict(scope["headers"]).get(b"accept", b"").decode("latin-1")
            body, content_type = await self.metrics.scrape(accept)
            response = Response(body, media_type=content_type)
        await response(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the service's own shutdown stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
