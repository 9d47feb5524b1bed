"""The gateway's HTTP front (Starlette): every SglangService RPC transcoded from its
google.api.http annotation, SGLang-native POST /generate, /encode and /flush_cache, GET /health,
OpenAI GET /v1/models and Prometheus GET /metrics; with API keys, one middleware checks them
for every route (`front/auth.py`).

All routes call the same api methods as the gRPC servicer (`api/gateway.py`): `await
method(req, ctx)` for unary RPCs, `method(req, ctx)` -> async iterator for server streams. They
raise, and one middleware answers each failure in the shape of the route's family
(`front/errors.py`). A stream's first message is fetched before the response starts, so an
early error is a plain HTTP error; later errors are the stream's last line or event. When the
client goes away the api iterator is closed, which aborts the request.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import grpc
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Scope

from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.common.metrics import ServiceMetrics
from meshlm.common.packed import Plain
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.direct import Express
from meshlm.gateway.api.generation import Generated
from meshlm.gateway.front.auth import ApiKeyMiddleware, ApiKeys
from meshlm.gateway.front.body_limit import BodyLimit
from meshlm.gateway.front.disconnect import unless_disconnected
from meshlm.gateway.front.errors import HttpErrors, Shape, error_response
from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.front.http_streams import (
    BodySendApp,
    DirectBody,
    StreamResponse,
    Streams,
    drain,
    first,
    first_of_each,
    ndjson,
    sse,
)
from meshlm.gateway.front.messages_route import messages_routes
from meshlm.gateway.front.native_routes import NATIVE_OWN_SHAPES, native_routes
from meshlm.gateway.front.openai_routes import OPENAI_OWN_SHAPES, openai_routes
from meshlm.gateway.front.reclaim import Reclaimer
from meshlm.gateway.front.responses_route import responses_routes
from meshlm.gateway.front.sse import NativeChoices, native_embedding
from meshlm.gateway.front.token_routes import token_routes
from meshlm.gateway.protocol import native, transcode
from meshlm.gateway.protocol.bounds import Bounds
from meshlm.gateway.protocol.meta_info import running_meta
from meshlm.gateway.protocol.validation import DEFAULT_MAX_NEW_TOKENS, check_batch
from sglang.runtime.v1 import sglang_pb2

log = get_logger(__name__)

JSON = "application/json"


def build_http_app(api: Any, metrics: ServiceMetrics | None = None,
                   keys: ApiKeys | None = None, bounds: Bounds | None = None,
                   reclaim: Reclaimer | None = None) -> Starlette:
    """The ASGI app serving `api` over HTTP (uvicorn runs it in the gateway process), with
    `metrics` at /metrics and, when `keys` holds any, every other route behind them; bodies
    and batches within `bounds` (`protocol/bounds.py`)."""
    bounds = bounds or Bounds()
    h = _Handlers(api, bounds)
    native: list[BaseRoute] = [
        Route("/generate", h.generate, methods=["POST"]),
        Route("/encode", h.encode, methods=["POST"]),
        Route("/flush_cache", h.flush_cache, methods=["GET", "POST"]),
        Route("/health", h.health, methods=["GET"]),
        *native_routes(api),
        *token_routes(api, ""),
    ]
    openai = openai_routes(api) + responses_routes(api) + token_routes(api, "/v1")
    transcoded = [_TranscodedRoute(b, partial(h.transcoded, b)) for b in transcode.routes()]
    routes = native + openai + transcoded
    if metrics is not None:
        routes.append(Route("/metrics", partial(_metrics, metrics), methods=["GET"]))
    # Each route family's error shape; the rest (transcoded RPCs, no route) Status JSON.
    anthropic = messages_routes(api)
    routes += anthropic
    shapes = {**{r.path: Shape.NATIVE for r in native if isinstance(r, Route)},
              **{r.path: Shape.OPENAI for r in openai if isinstance(r, Route)},
              **{r.path: Shape.ANTHROPIC for r in anthropic if isinstance(r, Route)},
              **NATIVE_OWN_SHAPES, **OPENAI_OWN_SHAPES}
    middleware = [Middleware(ApiKeyMiddleware, keys=keys)] if keys else []
    middleware += [Middleware(BodyLimit, limit=bounds.max_body_bytes, reclaim=reclaim,
                              read_timeout=bounds.read_timeout),
                   Middleware(HttpErrors, shapes=shapes)]
    return BodySendApp(
        routes=routes, exception_handlers={404: _not_found, 405: _method_not_allowed},
        middleware=middleware,
    )


async def _metrics(metrics: ServiceMetrics, request: Request) -> Response:
    """Prometheus exposition (text, or OpenMetrics when the scraper asks for it)."""
    body, content_type = await metrics.scrape(request.headers.get("accept"))
    return Response(body, media_type=content_type)


class _Handlers:
    def __init__(self, api: Any, bounds: Bounds) -> None:
        self.api = api
        self.bounds = bounds

    async def _invoke(self, rpc: str, req: Any, ctx: CallContext) -> Any:
        """The reply of the unary RPC named `rpc`, or the async iterator of a server-streaming
        one."""
        method = self.api.handler(rpc)
        if method is None:
            raise MeshError(grpc.StatusCode.UNIMPLEMENTED, f"{rpc} is not implemented yet")
        result = method(req, ctx)
        return await result if inspect.isawaitable(result) else result

    async def transcoded(self, binding: transcode.HttpBinding, request: Request) -> Response:
        req = transcode.bind_request(
            binding, request.path_params, request.query_params.multi_items(),
            await request.body(),
        )
        ctx = call_context(request)
        result = await self._invoke(binding.rpc, req, ctx)
        if not binding.server_streaming:
            return Response(transcode.message_json(result), headers=ctx.trailers,
                            media_type=JSON)
        head = await first(result)
        return StreamResponse(ndjson(head, result, request.url.path), result,
                              "application/x-ndjson")

    async def generate(self, request: Request) -> Response:
        """SGLang-native /generate: JSON reply, or SSE with cumulative text when streaming;
        with n > 1 samples or a batch of prompts, a JSON list of replies, or events carrying
        an "index"."""
        started = time.monotonic()
        parts: list[tuple[NativeChoices, AsyncIterator[Any]]] = []
        streams = Streams([])
        try:
            reqs, batch = native.native_generate_requests(await request.body(),
                                                             self.bounds.batch)
            if batch:  # prompts x n, all refused at once if they could never be admitted
                check_batch(sum(_samples(r) for r in reqs), self.bounds.batch,
                            "text" if isinstance(reqs[0], sglang_pb2.TextGenerateRequest)
                            else "input_ids")
            ctx = call_context(request)
            for req in reqs:
                sampling = req.sampling_params
                n = sampling.n if sampling.HasField("n") and sampling.n > 1 else 1
                is_text = isinstance(req, sglang_pb2.TextGenerateRequest)
                out = NativeChoices(
                    n, return_text=is_text, started=started, indexed=batch,
                    offset=sum(len(o.outputs) for o, _ in parts),
                    max_new_tokens=sampling.max_new_tokens
                    if sampling.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
                )
                direct = DirectBody() if req.stream and len(reqs) == 1 and n == 1 else None
                stream = self.api.generation.generated(req, ctx, _express(out, direct))
                parts.append((out, stream))
                streams.streams.append(stream)
            if reqs[0].stream:
                heads = await first_of_each(streams.streams)
                return StreamResponse(sse([(o, h, s) for (o, s), h in zip(parts, heads,
                                                                          strict=True)]),
                                      streams, "text/event-stream", direct)
            await unless_disconnected(drain(parts), request.receive)
        except BaseException:
            await streams.aclose()
            raise
        await streams.aclose()
        body = [d for out, _ in parts for d in out.dicts()] if batch else parts[0][0].to_json()
        return Response(orjson.dumps(body), media_type=JSON)

    async def encode(self, request: Request) -> Response:
        """SGLang-native /encode: {"text"} or {"input_ids"} -> {"embedding", "meta_info"};
        a batch of prompts -> a list of them, in order."""
        started = time.monotonic()
        reqs, batch = native.native_embed_requests(await request.body(), self.bounds.batch)
        ctx = call_context(request)
        generation = self.api.generation
        replies = await asyncio.gather(*(
            (generation.TextEmbed if isinstance(req, sglang_pb2.TextEmbedRequest)
             else generation.Embed)(req, ctx) for req in reqs))
        body = [native_embedding(reply, started) for reply in replies]
        return Response(orjson.dumps(body if batch else body[0]), media_type=JSON)

    async def flush_cache(self, request: Request) -> Response:
        """SGLang-native /flush_cache: plain text; 200 when flushed, 400 when refused."""
        reply = await self.api.admin.FlushCache(sglang_pb2.FlushCacheRequest(),
                                                call_context(request))
        if reply.success:
            return Response(f"Cache flushed.\n{reply.message}\n", media_type="text/plain")
        return Response(f"Cache not flushed: {reply.message}\n", status_code=400,
                        media_type="text/plain")

    async def health(self, request: Request) -> Response:
        try:
            healthy = bool(self.api.core.is_healthy())
        except Exception:
            log.exception("health_check_failed")
            healthy = False
        return Response(b"", status_code=200 if healthy else 503)


def _express(out: NativeChoices, direct: DirectBody | None) -> Express | None:
    """A lone streamed prompt's running messages as its SSE events, written straight to the
    client while the connection takes them at once (`api/direct.py`); otherwise (False)
    folded in later, by the response's task, as every other message."""
    if direct is None:
        return None

    first = out.outputs[0]  # one sample: its running messages carry no index

    def express(item: Plain) -> bool:
        if not direct.writable():
            return False  # before folding it in: the handler will
        event = first.running_event(item)
        if event is None:  # not the plain event: folded in as the handler would
            rid, ids, prompt, completion, cached, text = item
            meta = running_meta(rid, prompt, completion, cached)
            event = out.add(Generated(text, list(ids), meta, False)).event()
        direct.write(event)
        return True
    return express


def _samples(req: native.NativeRequest) -> int:
    """The requests one prompt puts into the mesh (its n samples)."""
    sampling = req.sampling_params
    return sampling.n if sampling.HasField("n") and sampling.n > 1 else 1


# ---- routing and errors ----------------------------------------------------------------------


class _TranscodedRoute(Route):
    """A route whose path is a google.api.http template; variables bind request fields
    (path_params maps field path -> value)."""

    def __init__(self, binding: transcode.HttpBinding, endpoint: Callable[..., Any]) -> None:
        super().__init__(
            binding.path.template, endpoint, methods=[binding.http_method], name=binding.rpc
        )
        self.binding = binding

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http":
            return Match.NONE, {}
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        params = self.binding.path.match(path)
        if params is None:
            return Match.NONE, {}
        child = {"endpoint": self.endpoint, "path_params": params}
        return (Match.FULL if scope["method"] in (self.methods or ()) else Match.PARTIAL), child


async def _not_found(request: Request, exc: Exception) -> Response:
    err = MeshError(grpc.StatusCode.NOT_FOUND, f"no route for {request.method} {request.url.path}")
    return error_response(Shape.STATUS, err)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    err = MeshError(
        grpc.StatusCode.UNIMPLEMENTED, f"{request.method} is not allowed on {request.url.path}"
    )
    headers = exc.headers if isinstance(exc, HTTPException) else None
    return error_response(Shape.STATUS, err, status=405, headers=headers)
