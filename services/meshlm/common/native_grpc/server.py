"""A gRPC server in asyncio: grpc.aio's server interface (generated `add_*Servicer_to_server`,
grpc.aio interceptors, health and reflection register on it as on grpc.aio's), served by the
HTTP/2 connections of `connection.py` on the event loop itself. It serves the gateway's public
port and every service's mesh port.

Why: grpc.aio hands every message from the event loop to grpc core's threads and back
(measured on 2 CPUs: 53-69 µs of CPU per message for a bare grpc.aio server streaming to 64
clients, against 12-15 for this one, which writes a turn's messages to a connection's streams in
one socket write). On the mesh ports, where one batch a step crosses each hop, the hand-off is
latency: each hop took 0.4-0.6 ms at concurrency 1 on grpc.aio's server, 0.25 ms on this one.

What it leaves out: per-message compression of answers (requests compressed with gzip or
deflate are read), and channelz.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc

from meshlm.common.logs import get_logger
from meshlm.common.native_grpc.call import CallDetails, Context, encoded_metadata, run_handler
from meshlm.common.native_grpc.connection import Connection
from meshlm.common.native_grpc.stream import Sink, Stream, StreamError

log = get_logger(__name__)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class NativeServer(grpc.aio.Server):
    """grpc.aio.Server's interface over `Connection`s: one listening socket (insecure, or TLS
    from an `ssl.SSLContext`), the registered handlers, the interceptors in their order."""

    def __init__(self, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 max_receive_bytes: int = 4 * 1024 * 1024,
                 max_header_bytes: int = 16 * 1024, stream_window: int = 4 * 1024 * 1024,
                 keepalive: tuple[float, float] | None = (30.0, 10.0)) -> None:
        self._interceptors = tuple(interceptors)
        self.stream_window = stream_window  # each call's receive window (bytes)
        self.keepalive = keepalive  # (idle seconds before a PING, seconds for its answer)
        self._generic: list[grpc.GenericRpcHandler] = []
        self._methods: dict[str, grpc.RpcMethodHandler] = {}
        self.max_receive_bytes = max_receive_bytes
        self.max_header_bytes = max_header_bytes
        self.connections: set[Connection] = set()
        self._binds: list[tuple[str, int, ssl.SSLContext | None]] = []
        self._listeners: list[asyncio.Server] = []
        self._calls: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()
        self.sinks: dict[str, Sink] = {}  # method -> what takes its request messages
        self._server = None  # grpc.aio's core server, which accept-ahead looks for: none here

    # -- registration (as grpc.aio.Server) -------------------------------------------------
    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]
                                 ) -> None:
        self._generic.extend(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: Mapping[str, grpc.RpcMethodHandler]
                                       ) -> None:
        for name, handler in method_handlers.items():
            self._methods[f"/{service_name}/{name}"] = handler

    def add_sink(self, method: str, sink: Sink) -> None:
        """Hand each request message of `method` (/package.Service/Method, a streamed request)
        to `sink` where its bytes arrive, on the connection's read: no task switch and no loop
        turn before it is taken, where the handler would wake for each. The handler still runs
        and answers the call, and reads only the end of its requests. A sink that raises ends
        the call: a MeshError with its status, anything else INTERNAL."""
        self.sinks[method] = sink

    def add_insecure_port(self, address: str) -> int:
        return self._bind(address, None)

    def add_secure_port(self, address: str, server_credentials: Any) -> int:
        if not isinstance(server_credentials, ssl.SSLContext):
            raise TypeError("the native server takes TLS as an ssl.SSLContext "
                            "(tls_context()), not grpc's credentials")
        return self._bind(address, server_credentials)

    def _bind(self, address: str, context: ssl.SSLContext | None) -> int:
        host, _, port = address.rpartition(":")
        self._binds.append((host.strip("[]"), int(port), context))
        return -1  # the port is known once bound: `start` returns them

    # -- running ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.bind()

    async def bind(self) -> list[int]:
        """Listen on every added address; returns the bound ports in order."""
        loop = asyncio.get_running_loop()
        ports = []
        for host, port, context in self._binds:
            listener = await loop.create_server(lambda: Connection(self), host or None, port,
                                                ssl=context, backlog=1024, reuse_address=True)
            self._listeners.append(listener)
            ports.append(listener.sockets[0].getsockname()[1])
        self._binds.clear()
        return ports

    async def stop(self, grace: float | None) -> None:
        """GOAWAY to every connection, no new connections; calls in flight get `grace`
        seconds to end, then are cancelled (RST_STREAM) and the connections closed."""
        for listener in self._listeners:
            listener.close()
        for conn in list(self.connections):
            conn.goaway()
        loop = asyncio.get_running_loop()
        end = loop.time() + (grace or 0.0)
        while (remaining := end - loop.time()) > 0:
            waiting: set[asyncio.Future[Any]] = {*self._calls, *(
                c.drained for c in self.connections if not c.drained.done())}
            if not waiting:
                break
            await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=1.0)
        for conn in list(self.connections):
            for stream in list(conn.streams.values()):
                stream.reset(8)  # CANCEL
            conn.goaway()
        self._stopped.set()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._stopped.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # -- calls -----------------------------------------------------------------------------
    def _handler(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._methods.get(details.method)
        if handler is not None:
            return handler
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    async def _lookup(self, details: grpc.HandlerCallDetails, at: int = 0
                      ) -> grpc.RpcMethodHandler | None:
        if at == len(self._interceptors):
            return self._handler(details)

        async def continuation(d: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            return await self._lookup(d, at + 1)
        return await self._interceptors[at].intercept_service(continuation, details)

    async def run_call(self, stream: Stream, details: CallDetails, peer: str,
                       deadline: float | None) -> None:
        """One call, from its method's lookup to its status."""
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        context = Context(stream, details.method, details.invocation_metadata, peer, deadline)
        code, message = grpc.StatusCode.OK, ""
        cancelled = False
        try:
            if deadline is None:  # most calls: no timeout to enter and leave (a few µs)
                code, message = await self._answer(stream, details, context)
            else:
                try:
                    async with asyncio.timeout_at(deadline) as limit:
                        code, message = await self._answer(stream, details, context)
                except TimeoutError:
                    if not limit.expired():
                        raise
                    code, message = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except grpc.aio.AbortError:
            code, message = context.code or grpc.StatusCode.UNKNOWN, context.details_text
        except StreamError as exc:
            code, message = exc.code, exc.message
        except asyncio.CancelledError:
            cancelled = True
        except Exception as exc:  # noqa: BLE001 - a handler's failure is its call's status
            if context.code is not None:  # as generated servicers' unimplemented methods do
                code, message = context.code, context.details_text
            else:
                log.exception("handler_failed", method=details.method, error=repr(exc))
                code, message = grpc.StatusCode.UNKNOWN, f"Unexpected error: {exc!r}"
        finally:
            self._calls.discard(task)
        if not cancelled and code == grpc.StatusCode.OK and context.code is not None:
            code, message = context.code, context.details_text
        if not cancelled:
            stream.finish(code, message, encoded_metadata(context.trailing))
        elif not stream.closed:
            stream.reset(8)  # CANCEL: the server gave the call up (shutdown)
        context.finish(cancelled or code == grpc.StatusCode.DEADLINE_EXCEEDED)

    async def _answer(self, stream: Stream, details: CallDetails, context: Context
                      ) -> tuple[grpc.StatusCode, str]:
        """Find the call's handler and run it; the status, unless the handler raised."""
        handler = await self._lookup(details)
        if handler is None:
            return grpc.StatusCode.UNIMPLEMENTED, "Method not found!"
        await run_handler(handler, context, await stream.request(handler.request_streaming))
        return grpc.StatusCode.OK, ""

    def log_protocol_error(self, peer: str, reason: str) -> None:
        log.warning("http2_protocol_error", peer=peer, reason=reason)

