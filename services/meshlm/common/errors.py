"""The one error type handlers raise, and its mapping to gRPC and HTTP.

Handlers never format statuses by hand: they raise MeshError and the error interceptor (gRPC)
or the HTTP layer turns it into a status. Codes follow google.rpc.Code.
"""

from __future__ import annotations

import asyncio

import grpc

# google.rpc.Code -> HTTP status, as in google/rpc/code.proto.
_HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}

_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


class MeshError(Exception):
    """A request failed with a status the client should see."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return http_status(self.code)

    @property
    def code_number(self) -> int:
        return int(self.code.value[0])

    @classmethod
    def from_number(cls, number: int, message: str) -> MeshError:
        return cls(_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message)

    def __repr__(self) -> str:
        return f"MeshError({self.code.name}, {self.message!r})"


def http_status(code: grpc.StatusCode) -> int:
    return _HTTP_STATUS.get(code, 500)


def invalid(field: str, problem: str) -> MeshError:
    """INVALID_ARGUMENT naming the field: invalid("sampling_params.top_p", "must be in (0, 1]")."""
    return MeshError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def cancelled_under(exc: BaseException) -> MeshError | None:
    """What a handler's CancelledError means when nobody cancelled the handler: a call it
    awaited was cancelled under it, because the channel to that replica closed (the replica
    left the mesh). The client is told UNAVAILABLE and may retry, instead of waiting out its
    deadline for an answer that never comes. None: the handler itself is being cancelled (its
    client went away), and the cancellation must go on."""
    task = asyncio.current_task()
    if not isinstance(exc, asyncio.CancelledError) or task is None or task.cancelling():
        return None
    return MeshError(grpc.StatusCode.UNAVAILABLE, (
        "a call inside the mesh was cancelled: the replica it went to left the mesh; "
        "calling again is safe"))
