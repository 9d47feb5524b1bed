"""The HTTP error path. Routes raise (MeshError, or ClientGone when the client left); one
middleware turns what they raise into the answer, its body in the shape the route's family
reads errors in (`SHAPES`), any other exception into a logged 500, and a call cancelled
under the route (its replica left) into a 503 (`cancelled_under`). A stream that fails after
its first chunk ends with an error line or event of the same shape (`failure`, `error_body`).

Shapes: Status JSON ({"code", "message", "details"}: the transcoded RPCs, unknown routes),
SGLang's ({"error": {"message", "code": <HTTP>, "type": <gRPC code>}}: the native routes),
OpenAI's error object (the /v1/ OpenAI routes), SGLang's top-level ErrorResponse ({"object":
"error", "message", "type", "param", "code": <HTTP>}: /v1/score, as SGLang answers it),
SGLang's /update_weights_from_disk reply and Anthropic's ({"type": "error", "error": {"type",
"message"}}: /v1/messages).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

import grpc
import orjson
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshlm.common.errors import MeshError, cancelled_under
from meshlm.common.logs import get_logger
from meshlm.gateway.front.disconnect import ClientGone
from meshlm.gateway.protocol.anthropic_output import error_object as anthropic_error
from meshlm.gateway.protocol.openai_errors import error_body as openai_error
from meshlm.gateway.protocol.transcode import status_dict

log = get_logger(__name__)

CLIENT_GONE = 499  # nginx's "client closed request"; nobody reads it


class Shape(enum.Enum):
    STATUS = "status"
    NATIVE = "native"
    OPENAI = "openai"
    ERROR_RESPONSE = "error_response"
    WEIGHTS = "weights"
    ANTHROPIC = "anthropic"


def _native_error(err: MeshError, status: int) -> dict[str, Any]:
    return {"error": {"message": err.message, "code": status, "type": err.code.name}}


def _error_response(err: MeshError, status: int) -> dict[str, Any]:
    """SGLang's OpenAI-serving ErrorResponse: top-level, its type named after the status."""
    name = HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "")
    kind = name if name.endswith("Error") else f"{name}Error"
    return {"object": "error", "message": err.message, "type": kind, "param": None,
            "code": status}


def _weights_error(err: MeshError, status: int) -> dict[str, Any]:
    return {"success": False, "message": err.message, "num_paused_requests": 0}


# Each shape's body of an error answered with an HTTP status.
SHAPES: dict[Shape, Callable[[MeshError, int], dict[str, Any]]] = {
    Shape.STATUS: lambda err, status: status_dict(err),
    Shape.NATIVE: _native_error,
    Shape.OPENAI: lambda err, status: openai_error(err),
    Shape.ERROR_RESPONSE: _error_response,
    Shape.WEIGHTS: _weights_error,
    Shape.ANTHROPIC: anthropic_error,
}


def error_body(shape: Shape, err: MeshError, status: int | None = None) -> dict[str, Any]:
    """`err` in `shape`, answered with `status` (default: its own HTTP status)."""
    return SHAPES[shape](err, status or err.http_status)


def error_response(shape: Shape, err: MeshError, status: int | None = None,
                   headers: Mapping[str, str] | None = None) -> Response:
    status = status or err.http_status
    return Response(orjson.dumps(error_body(shape, err, status)), status_code=status,
                    headers=headers, media_type="application/json")


def failure(exc: BaseException, path: str) -> MeshError:
    """What the client is told of `exc` (call it in the `except` that caught it): a MeshError
    as it is; anything else is a bug, logged here (once, with its traceback) and answered
    INTERNAL."""
    if isinstance(exc, MeshError):
        return exc
    log.exception("http_request_failed", path=path)
    return MeshError(grpc.StatusCode.INTERNAL, "internal error")


class HttpErrors:
    """ASGI middleware: the answer to a route that raised before its response began, shaped
    by `shapes` (route path, as declared -> Shape; other paths: Status JSON)."""

    def __init__(self, app: ASGIApp, shapes: Mapping[str, Shape]) -> None:
        self.app = app
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError as exc:
            err = cancelled_under(exc)  # None: the client went away, and that ends it
            if err is None or started:
                raise
            await error_response(self._shape(scope), err)(scope, receive, send)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an answer
            if started:  # too late to answer: the stream already ended as it could
                failure(exc, scope["path"])
                return
            if isinstance(exc, ClientGone):
                response = Response(status_code=CLIENT_GONE)
            else:
                response = error_response(self._shape(scope), failure(exc, scope["path"]))
            await response(scope, receive, send)

    def _shape(self, scope: Scope) -> Shape:
        route = scope.get("route")  # the router's match (its path may be a template)
        return self.shapes.get(str(getattr(route, "path", scope["path"])), Shape.STATUS)
