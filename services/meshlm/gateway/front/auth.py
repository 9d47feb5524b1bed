"""API keys on the gateway's public ports: one key check, used by one gRPC server interceptor
and one ASGI middleware, so every RPC and every HTTP route (transcoded, native, OpenAI, and any
added later) is covered without a line in its handler.

With keys configured (`--api-key`, `MESHLM_API_KEY`), a call must carry
`authorization: Bearer <key>` (gRPC metadata or HTTP header; over HTTP Anthropic's
`x-api-key: <key>` too); otherwise it fails with
UNAUTHENTICATED / HTTP 401 before any handler runs. Health stays open for load balancers and
probes (grpc.health.v1, the HealthCheck RPC, /health, /health_generate), as do server
reflection (so grpcurl can discover the API) and /metrics (Prometheus scrapers).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

from meshlm.common.errors import MeshError
from meshlm.gateway.front.errors import Shape, error_response

HEADER = "authorization"
ANTHROPIC_HEADER = b"x-api-key"
SCHEME = "bearer"

# gRPC methods ("/package.Service/Method") that need no key; a trailing "/" opens a service.
OPEN_RPCS = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
    "/sglang.runtime.v1.SglangService/HealthCheck",
)
# HTTP paths that need no key: health (the transcoded HealthCheck too) and the scrape target.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/v1/runtime/health", "/metrics"})
# OpenAI clients read errors in OpenAI's shape; the transcoded RPCs (also under /v1/) do not.
OPENAI_PREFIX = "/v1/"
TRANSCODED_PREFIX = "/v1/runtime/"
ANTHROPIC_PREFIX = "/v1/messages"


class ApiKeys:
    """The configured keys and the one check both transports use."""

    def __init__(self, keys: Iterable[str]) -> None:
        # Digests, so every comparison takes the same time whatever the key's length.
        self._digests = [_digest(k) for k in keys if k]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """None if `authorization` (the header's value) carries a configured key, else what is
        wrong, worded for the client. Compares against every key in constant time."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != SCHEME or not token:
            return ("missing API key: send the header (gRPC: metadata) "
                    "'authorization: Bearer <key>'")
        digest = _digest(token)
        match = False
        for known in self._digests:
            match |= hmac.compare_digest(digest, known)
        return None if match else "invalid API key"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# ---- gRPC ------------------------------------------------------------------------------------


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid key with UNAUTHENTICATED before the handler runs."""

    def __init__(self, keys: ApiKeys, open_rpcs: tuple[str, ...] = OPEN_RPCS) -> None:
        self._keys = keys
        self._open = open_rpcs

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self._keys or _is_open(method, self._open):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        value = next((v for k, v in metadata if k.lower() == HEADER and isinstance(v, str)), None)
        problem = self._keys.check(value)
        return handler if problem is None else _refusal(handler, problem)


def _is_open(method: str, open_rpcs: tuple[str, ...]) -> bool:
    return any(method.startswith(m) if m.endswith("/") else method == m for m in open_rpcs)


def _refusal(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only answers UNAUTHENTICATED."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(refuse, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


# ---- HTTP ------------------------------------------------------------------------------------


class ApiKeyMiddleware:
    """ASGI middleware: HTTP 401 for requests without a valid key. OpenAI paths (/v1/..., but
    not the transcoded /v1/runtime/...) get OpenAI's error JSON, the rest the gateway's Status
    JSON, so each client reads the refusal the way it reads any other error."""

    def __init__(self, app: ASGIApp, keys: ApiKeys,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self._keys = keys
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._keys or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        value = next((v.decode("latin-1") for k, v in scope["headers"]
                      if k.lower() == HEADER.encode()), None)
        if value is None:  # Anthropic's clients send the key alone, as x-api-key
            value = next((f"Bearer {v.decode('latin-1')}" for k, v in scope["headers"]
                          if k.lower() == ANTHROPIC_HEADER), None)
        problem = self._keys.check(value)
        if problem is None:
            await self.app(scope, receive, send)
            return
        response = error_response(_shape(scope["path"]),
                                  MeshError(grpc.StatusCode.UNAUTHENTICATED, problem),
                                  headers={"www-authenticate": "Bearer"})
        await response(scope, receive, send)


def _shape(path: str) -> Shape:
    """Anthropic's error object on its route, OpenAI's on the other OpenAI-family routes,
    else Status JSON."""
    if path.startswith(ANTHROPIC_PREFIX):
        return Shape.ANTHROPIC
    openai = path.startswith(OPENAI_PREFIX) and not path.startswith(TRANSCODED_PREFIX)
    return Shape.OPENAI if openai else Shape.STATUS
