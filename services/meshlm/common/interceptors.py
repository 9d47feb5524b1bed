"""The two server interceptors every service installs: errors -> statuses, and tracing
(common/parsing.py adds a third, innermost, that parses requests).

Both wrap the method handler's behaviour. Handlers are coroutines (unary responses) or async
generators (streamed responses), as in grpc's own aio examples.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace

from meshlm.common.errors import MeshError, cancelled_under
from meshlm.common.logs import get_logger
from meshlm.common.tracing import carried, context_of, recording, tracer

log = get_logger(__name__)

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]
UnaryWrapper = Callable[[str, Behavior, Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamWrapper = Callable[[str, Behavior, Any, grpc.aio.ServicerContext], AsyncIterator[Any]]

FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def behavior_of(handler: grpc.RpcMethodHandler) -> Behavior:
    """The servicer function a method handler calls, whichever of the four kinds it is."""
    return {
        (False, False): handler.unary_unary,
        (False, True): handler.unary_stream,
        (True, False): handler.stream_unary,
        (True, True): handler.stream_stream,
    }[(handler.request_streaming, handler.response_streaming)]


def _wrap(handler: grpc.RpcMethodHandler, method: str, unary: UnaryWrapper,
          stream: StreamWrapper) -> grpc.RpcMethodHandler:
    req_stream, resp_stream = handler.request_streaming, handler.response_streaming
    behavior = behavior_of(handler)

    # Streams written as async generators are wrapped item by item: the wrapper's own
    # generator is the new handler (a partial of it, which grpc and inspect still take for an
    # async generator function; not a generator around it: one less per message). Those
    # written with context.write (e.g. grpc's own health Watch) are coroutines and wrap like
    # unary calls.
    if resp_stream and inspect.isasyncgenfunction(behavior):
        new_behavior: Any = functools.partial(stream, method, behavior)
    else:
        async def wrapped_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await unary(method, behavior, request, context)
        new_behavior = wrapped_unary
    return FACTORIES[(req_stream, resp_stream)](
        new_behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class HandlerInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor that hands every method's handler to `rewrap` (None: no such method).
    What `rewrap` makes of a handler depends on the handler and the method alone, so it is
    kept per method and made again only for another handler (about 10 µs a call otherwise)."""

    _wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]]

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        try:
            kept = self._wrapped
        except AttributeError:
            kept = self._wrapped = {}
        known = kept.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self.rewrap(handler, method)
        kept[method] = (handler, wrapped)
        return wrapped

    def rewrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        raise NotImplementedError


class _WrappingInterceptor(HandlerInterceptor):
    def rewrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return _wrap(handler, method, self.unary, self.stream)

    async def unary(self, method: str, behavior: Behavior, request: Any,
                    context: grpc.aio.ServicerContext) -> Any:
        raise NotImplementedError

    def stream(self, method: str, behavior: Behavior, request: Any,
               context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        raise NotImplementedError


class ErrorInterceptor(_WrappingInterceptor):
    """MeshError -> its status code; anything unexpected -> INTERNAL (logged once); a call
    cancelled under the handler -> UNAVAILABLE (`cancelled_under`)."""

    async def _abort(self, method: str, exc: Exception, context: grpc.aio.ServicerContext) -> None:
        if isinstance(exc, MeshError):
            await context.abort(exc.code, exc.message)
        log.exception("handler_failed", method=method, error=repr(exc))
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")

    async def _abort_cancelled(self, exc: asyncio.CancelledError,
                               context: grpc.aio.ServicerContext) -> None:
        err = cancelled_under(exc)
        if err is None:
            raise exc
        await context.abort(err.code, err.message)

    async def unary(self, method: str, behavior: Behavior, request: Any,
                    context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError as exc:
            await self._abort_cancelled(exc, context)
        except Exception as exc:  # noqa: BLE001 - this is the one place errors become statuses
            await self._abort(method, exc, context)

    async def stream(self, method: str, behavior: Behavior, request: Any,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError as exc:
            await self._abort_cancelled(exc, context)
        except Exception as exc:  # noqa: BLE001
            await self._abort(method, exc, context)


class TracingInterceptor(_WrappingInterceptor):
    """One SERVER span per call, parented by the caller's traceparent metadata if any."""

    def __init__(self, skip_prefixes: tuple[str, ...] = ("/grpc.health", "/grpc.reflection")):
        self._tracer = tracer("meshlm.rpc")
        self._skip = skip_prefixes

    def _span(self, method: str, context: grpc.aio.ServicerContext) -> Any:
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        return self._tracer.start_as_current_span(
            method.rsplit("/", 1)[-1], context=context_of(metadata),
            kind=trace.SpanKind.SERVER, attributes={"rpc.system": "grpc", "rpc.method": method},
        )

    def _traced(self, method: str, context: grpc.aio.ServicerContext) -> bool:
        """Whether the call has a span: not health or reflection, and spans are recorded or
        the caller sent trace context to pass on (a span recording nothing cost a call about
        10 µs)."""
        return not method.startswith(self._skip) and (
            recording() or carried(context.invocation_metadata() or ()))

    async def unary(self, method: str, behavior: Behavior, request: Any,
                    context: grpc.aio.ServicerContext) -> Any:
        if not self._traced(method, context):
            return await behavior(request, context)
        with self._span(method, context):
            return await behavior(request, context)

    async def stream(self, method: str, behavior: Behavior, request: Any,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if not self._traced(method, context):
            async for item in behavior(request, context):
                yield item
            return
        with self._span(method, context):
            async for item in behavior(request, context):
                yield item
