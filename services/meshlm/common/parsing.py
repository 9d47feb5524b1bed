"""Request messages parsed inside the interceptor chain, so a malformed one is INVALID_ARGUMENT.

grpc.aio parses a request with the method handler's `request_deserializer` before (unary) or
while (streamed requests) the handler runs, and a parse failure ends the call UNKNOWN (or, met
mid-stream by a handler, INTERNAL through the error interceptor) with the exception's class
in the status message. ParseInterceptor, installed innermost, takes parsing over: grpc hands
the handler raw bytes, and the wrapped handler parses each request itself, raising
MeshError(INVALID_ARGUMENT, "could not parse <message>: <reason>") for the error interceptor to
turn into the status, like any other refusal. Each refused message logs one line (no payload).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from meshlm.common.errors import MeshError
from meshlm.common.interceptors import FACTORIES, HandlerInterceptor, behavior_of
from meshlm.common.logs import get_logger

log = get_logger(__name__)

Deserializer = Callable[[bytes], Any]


def message_name(deserializer: Deserializer, method: str) -> str:
    """The full protobuf name of what `deserializer` parses (generated handlers pass
    `Message.FromString`), or a description by method for any other deserializer."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", None)
    return name if isinstance(name, str) else f"the request of {method}"


def reason_of(exc: Exception) -> str:
    """What was wrong, without Python's words: protobuf says "Error parsing message with type
    'X': <reason>"; anything else is reported as a malformed message."""
    _, sep, tail = str(exc).rpartition("': ")
    tail = tail.strip()
    if not sep or not tail:
        return "malformed message"
    return (tail[0].lower() + tail[1:])[:200]


class Parser:
    """Parses one method's requests: `parse(raw, context)` returns the message or raises
    MeshError(INVALID_ARGUMENT) naming the message type."""

    def __init__(self, deserializer: Deserializer, method: str) -> None:
        self._deserialize = deserializer
        self.method = method
        self.name = message_name(deserializer, method)

    def parse(self, raw: bytes, context: grpc.aio.ServicerContext | None) -> Any:
        try:
            return self._deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's message
            reason = reason_of(exc)
            log.warning("malformed_message", method=self.method, message=self.name,
                        reason=reason, size=len(raw),
                        peer=context.peer() if context is not None else "")
            raise MeshError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"could not parse {self.name}: {reason}") from None

    async def parse_stream(self, raws: AsyncIterator[bytes],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for raw in raws:
            yield self.parse(raw, context)


def parsing_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with grpc's parsing replaced by the Parser's, inside the handler."""
    deserializer = handler.request_deserializer
    if deserializer is None:
        return handler
    parser = Parser(deserializer, method)
    behavior = behavior_of(handler)
    req_stream, resp_stream = handler.request_streaming, handler.response_streaming

    def parsed(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if req_stream:
            return parser.parse_stream(request, context)
        return parser.parse(request, context)

    # As in interceptors._wrap: async generators stay generators, the rest are coroutines.
    new_behavior: Callable[[Any, grpc.aio.ServicerContext], Any]
    if resp_stream and inspect.isasyncgenfunction(behavior):
        async def parse_then_stream(request: Any,
                                    context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in behavior(parsed(request, context), context):
                yield item
        new_behavior = parse_then_stream
    else:
        async def parse_then_call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(parsed(request, context), context)
        new_behavior = parse_then_call
    return FACTORIES[(req_stream, resp_stream)](
        new_behavior, request_deserializer=None,
        response_serializer=handler.response_serializer,
    )


class ParseInterceptor(HandlerInterceptor):
    """Install last (innermost), after the ErrorInterceptor that maps its MeshError."""

    def rewrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return parsing_handler(handler, method)
