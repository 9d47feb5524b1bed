"""One call on the native server: its servicer context (the part of grpc.aio's ServicerContext
that servicers and interceptors use) and the task that runs the method handler.

A handler is what grpc.aio would run: a coroutine for a unary response, an async generator or
a coroutine writing with `context.write` for a streamed one; requests arrive as bytes through
the handler's `request_deserializer` (or as bytes, where it has none). Statuses follow grpc.aio:
`abort` ends the call with its code; an exception no interceptor turned into a status ends it
UNKNOWN; a deadline past ends it DEADLINE_EXCEEDED; a cancelled call (RST_STREAM, connection
lost) sends nothing more.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

if TYPE_CHECKING:
    from meshlm.common.native_grpc.stream import Stream

Metadata = tuple[tuple[str, str | bytes], ...]


class CallDetails(NamedTuple):
    """grpc.HandlerCallDetails' fields, as interceptors read them."""

    method: str
    invocation_metadata: Metadata


grpc.HandlerCallDetails.register(CallDetails)


def binary_value(key: str, value: bytes) -> str | bytes:
    """A metadata value as grpc hands it to servicers: `-bin` keys base64-decoded to bytes."""
    if key.endswith("-bin"):
        return base64.b64decode(value + b"=" * (-len(value) % 4))
    return value.decode("latin-1")


def encoded_metadata(metadata: Sequence[tuple[str, str | bytes]]) -> list[tuple[bytes, bytes]]:
    """Metadata as header fields: `-bin` values base64 without padding, names lower-cased."""
    out = []
    for key, value in metadata:
        name = key.lower()
        if name.endswith("-bin"):
            raw = value if isinstance(value, bytes) else value.encode()
            out.append((name.encode(), base64.b64encode(raw).rstrip(b"=")))
        else:
            out.append((name.encode(), value.encode() if isinstance(value, str) else value))
    return out


class Context:
    """The servicer context of one call."""

    def __init__(self, stream: Stream, method: str, metadata: Metadata, peer: str,
                 deadline: float | None) -> None:
        self._stream = stream
        self.method = method
        self._metadata = metadata
        self._peer = peer
        self._deadline = deadline  # the event loop's time, or None
        self.code: grpc.StatusCode | None = None
        self.details_text = ""
        self.trailing: Sequence[tuple[str, str | bytes]] = ()
        self._callbacks: list[Callable[[Any], None]] = []
        self._cancelled = False
        self._done = False

    # -- what servicers and interceptors call --------------------------------------------
    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Sequence[tuple[str, str | bytes]] = ()) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort with OK: a call ends OK by returning")
        self.code, self.details_text = code, details
        if trailing_metadata:
            self.trailing = trailing_metadata
        raise grpc.aio.AbortError(f"aborted with {code.name}")

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details_text = details

    def details(self) -> str:
        return self.details_text

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailing = metadata

    def trailing_metadata(self) -> Sequence[tuple[str, str | bytes]]:
        return self.trailing

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self._stream.send_headers(encoded_metadata(metadata))

    async def write(self, message: Any) -> None:
        await self._stream.send_message(self._serialize(message))

    def write_now(self, message: Any) -> bool:
        """Send a streamed answer's next message (or its bytes, serialized already) at once,
        from outside the handler's task, when the stream can take it without waiting; False,
        with nothing sent, otherwise (the handler then sends it). Only while the handler is
        not itself sending."""
        return self._stream.send_now(message if isinstance(message, bytes)
                                     else self._serialize(message))

    async def read(self) -> Any:
        raise NotImplementedError("requests reach handlers as their argument")

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._callbacks.append(callback)

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer_identities(self) -> None:
        return None

    def set_compression(self, compression: Any) -> None:
        pass

    def disable_next_message_compression(self) -> None:
        pass

    # -- the call's own -------------------------------------------------------------------
    _serialize: Callable[[Any], bytes] = staticmethod(lambda m: m)  # type: ignore[assignment]

    def finish(self, cancelled: bool) -> None:
        self._cancelled = cancelled
        self._done = True
        for callback in self._callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001, S110 - a callback's failure ends nothing else
                pass
        self._callbacks.clear()


async def run_handler(handler: grpc.RpcMethodHandler, context: Context,
                      request: Any) -> None:
    """Run `handler` with `request` (bytes, or an async iterator of bytes for a streamed
    request), sending what it answers through the context's stream."""
    deserialize = handler.request_deserializer
    if deserialize is not None:
        request = (_parsed(request, deserialize) if handler.request_streaming
                   else deserialize(request))
    serialize = handler.response_serializer or (lambda m: m)
    context._serialize = serialize  # type: ignore[method-assign]
    behavior = {
        (False, False): handler.unary_unary, (False, True): handler.unary_stream,
        (True, False): handler.stream_unary, (True, True): handler.stream_stream,
    }[(handler.request_streaming, handler.response_streaming)]
    stream = context._stream
    result = behavior(request, context)
    if inspect.isasyncgen(result):
        async for message in result:
            await stream.send_message(serialize(message))
        return
    response = await result if inspect.isawaitable(result) else result
    if not handler.response_streaming and response is not None:
        await stream.send_message(serialize(response))


async def _parsed(raws: AsyncIterator[bytes], deserialize: Callable[[bytes], Any]
                  ) -> AsyncIterator[Any]:
    async for raw in raws:
        yield deserialize(raw)
