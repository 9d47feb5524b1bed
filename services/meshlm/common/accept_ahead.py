"""More than one call request outstanding per method on a grpc.aio server.

grpc.aio's server asks grpc core for the next call of a method only after the previous one has
started: core's answer reaches the event loop from the poller thread, the serving task wakes,
schedules the call's task and asks again, about five loop turns per call. On an idle loop that
is a fraction of a millisecond; on a gateway at saturation, where a turn takes milliseconds, new
calls wait in core and enter one every few tens of milliseconds, and the engine runs fewer
requests than clients keep in flight. Measured (a loop whose turns take 5 ms, 20 calls arriving
together): 28 ms between entries and 530 ms for all of them; with seven more requests
outstanding, 1.7 ms and 32 ms.

`AcceptAhead` keeps `depth` more requests outstanding for each registered method and runs every
call they get exactly as grpc's serving task would: through grpc's handler lookup with the
server's interceptors (API keys, tracing, errors, parsing), its cancellation handling and its
status on errors. It reaches into grpc.aio's internals (cygrpc's `_MethodResolver`,
`_handle_rpc` and `_schedule_rpc_coro`, the server's `_make_request_call_future`), so it checks
that they are there with the arguments it passes; where they are not (another grpc release), it
logs `accept_ahead_unavailable` once and the server takes calls as grpc does on its own.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from typing import Any

import grpc
from grpc._cython import cygrpc

from meshlm.common.logs import get_logger

log = get_logger(__name__)

# The internals used, with the parameters each must take (checked once, before any call).
_INTERNALS = {
    "_handle_rpc": ("method_name", "method_resolver", "interceptors", "rpc_state", "loop",
                    "concurrency_exceeded"),
    "_schedule_rpc_coro": ("rpc_coro", "rpc_state", "loop", "method_name"),
}


def _missing_internals(core: Any) -> str | None:
    """What of grpc.aio's internals this grpc lacks, or None when all are there."""
    if not hasattr(cygrpc, "_MethodResolver") or not hasattr(core, "_make_request_call_future"):
        return "no _MethodResolver or _make_request_call_future"
    for name, params in _INTERNALS.items():
        fn = getattr(cygrpc, name, None)
        try:
            found = tuple(inspect.signature(fn).parameters) if fn is not None else None
        except (TypeError, ValueError):
            found = None
        if found != params:
            return f"{name} takes {found}, not {params}"
    return None


class RecordingServer:
    """Stands in for a grpc.aio server while generated `add_*Servicer_to_server` functions run:
    forwards the registrations and keeps each registered method's handler by its full name."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server
        self.methods: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str,
                                       handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        self.server.add_registered_method_handlers(service, handlers)
        self.methods.update({f"/{service}/{name}": h for name, h in handlers.items()})


class AcceptAhead:
    """`depth` more outstanding call requests for each of `methods` (full name -> handler, as
    registered on `server`), run through `interceptors` (the server's, in its order). Start
    after the server has started, and after gc.freeze where the process freezes its start-up
    objects: a frozen call state is never collected, and the first call it gets, if it fails,
    leaves its error there, whose traceback keeps the call's request. Stop by stopping the
    server (core then fails the requests)."""

    def __init__(self, server: grpc.aio.Server, methods: Mapping[str, grpc.RpcMethodHandler],
                 interceptors: tuple[grpc.aio.ServerInterceptor, ...], depth: int) -> None:
        self.methods = dict(methods)
        self.interceptors = interceptors
        self.depth = depth
        self._core: Any = server._server  # type: ignore[attr-defined]
        self._tasks: set[asyncio.Task[Any]] = set()
        self._acceptors: list[asyncio.Task[None]] = []
        self.accepted = 0

    def start(self) -> bool:
        """Start the acceptors; False (logged) when there is nothing to do or grpc's internals
        are not the ones this knows."""
        if self.depth <= 0 or not self.methods:
            return False
        missing = _missing_internals(self._core)
        if missing is not None:
            log.warning("accept_ahead_unavailable", grpc=grpc.__version__, reason=missing)
            return False
        resolver = cygrpc._MethodResolver([], self.methods)
        self._acceptors = [
            asyncio.create_task(self._accept(method, resolver), name=f"accept-ahead {method}")
            for method in self.methods for _ in range(self.depth)]
        return True

    async def _accept(self, method: str, resolver: Any) -> None:
        loop = asyncio.get_running_loop()
        method_bytes = method.encode()
        while True:
            try:
                state = await self._core._make_request_call_future(method_bytes)
            except Exception:  # noqa: BLE001 - core fails outstanding requests at shutdown
                return
            self.accepted += 1
            self._run(method, resolver, state, loop)
            # Not kept while waiting for the next call, which may never come: a failed call's
            # state holds its error, whose traceback holds the call's frames and request.
            del state

    def _run(self, method: str, resolver: Any, state: Any, loop: asyncio.AbstractEventLoop
             ) -> None:
        rpc = cygrpc._handle_rpc(method, resolver, self.interceptors, state, loop, False)
        task = loop.create_task(cygrpc._schedule_rpc_coro(rpc, state, loop, method),
                                name="rpc_task")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """After the server has stopped: end any acceptor still waiting."""
        for task in self._acceptors:
            task.cancel()
