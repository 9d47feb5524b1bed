"""The gateway's HTTP front (Starlette): every SglangService RPC transcoded from its
google.api.http annotation, SGLang-native POST /generate, /encode and /flush_cache, GET /health,
OpenAI GET /v1/models and Prometheus GET /metrics; with API keys, one middleware checks them
for every route (`front/auth.py`).

All routes call the same `api` object as the gRPC servicer: `await api.Rpc(req, ctx)` for unary
RPCs, `api.Rpc(req, ctx)` -> async iterator for server streams. A stream's first message is
fetched before the response starts, so an early error is a plain HTTP error; later errors are
the stream's last line or event. When the client goes away the api iterator is closed, which
aborts the request.
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
from starlette.types import Receive, Scope, Send

from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.common.metrics import ServiceMetrics
from meshlm.common.rpc import CallContext
from meshlm.gateway.front.auth import ApiKeyMiddleware, ApiKeys
from meshlm.gateway.front.body_limit import BodyLimit
from meshlm.gateway.front.disconnect import ClientGone, unless_disconnected
from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.front.native_routes import native_routes
from meshlm.gateway.front.openai_routes import openai_routes
from meshlm.gateway.front.reclaim import Reclaimer
from meshlm.gateway.front.sse import (
    SSE_DONE,
    NativeChoices,
    native_embedding,
    native_error,
    sse_event,
)
from meshlm.gateway.protocol import native, transcode
from meshlm.gateway.protocol.bounds import Bounds
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
    routes: list[BaseRoute] = [
        Route("/generate", h.generate, methods=["POST"]),
        Route("/encode", h.encode, methods=["POST"]),
        Route("/flush_cache", h.flush_cache, methods=["GET", "POST"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/v1/models", h.models, methods=["GET"]),
    ]
    routes += openai_routes(api) + native_routes(api)
    routes += [_TranscodedRoute(b, partial(h.transcoded, b)) for b in transcode.routes()]
    if metrics is not None:
        routes.append(Route("/metrics", partial(_metrics, metrics), methods=["GET"]))
    middleware = [Middleware(ApiKeyMiddleware, keys=keys)] if keys else []
    middleware.append(Middleware(BodyLimit, limit=bounds.max_body_bytes, reclaim=reclaim))
    return Starlette(
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
        self.created = int(time.time())

    async def _invoke(self, rpc: str, req: Any, ctx: CallContext) -> Any:
        """The reply of a unary RPC, or the async iterator of a server-streaming one."""
        method = self.api.handler(rpc)
        if method is None:
            raise MeshError(grpc.StatusCode.UNIMPLEMENTED, f"{rpc} is not implemented yet")
        result = method(req, ctx)
        return await result if inspect.isawaitable(result) else result

    async def transcoded(self, binding: transcode.HttpBinding, request: Request) -> Response:
        try:
            req = transcode.bind_request(
                binding, request.path_params, request.query_params.multi_items(),
                await request.body(),
            )
            result = await self._invoke(binding.rpc, req, call_context(request))
            if not binding.server_streaming:
                return Response(transcode.message_json(result), media_type=JSON)
            first = await _first(result)
            return _StreamResponse(_ndjson(first, result, binding.rpc), result,
                                   "application/x-ndjson")
        except MeshError as e:
            return _status_response(e)
        except Exception:
            log.exception("http_request_failed", rpc=binding.rpc, path=request.url.path)
            return _status_response(_internal())

    async def generate(self, request: Request) -> Response:
        """SGLang-native /generate: JSON reply, or SSE with cumulative text when streaming;
        with n > 1 samples or a batch of prompts, a JSON list of replies, or events carrying
        an "index"."""
        started = time.monotonic()
        parts: list[tuple[NativeChoices, AsyncIterator[Any]]] = []
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
                stream = await self._invoke("TextGenerate" if is_text else "Generate", req, ctx)
                parts.append((out, stream))
            streams = _Streams([stream for _, stream in parts])
            if reqs[0].stream:
                firsts = await _first_of_each(streams.streams)
                parts_firsts = [(o, f, s) for (o, s), f in zip(parts, firsts, strict=True)]
                return _StreamResponse(_sse(parts_firsts), streams, "text/event-stream")
            try:
                await unless_disconnected(_drain(parts), request.receive)
            except ClientGone:
                return Response(status_code=499)
            finally:
                await streams.aclose()
            body = [d for out, _ in parts for d in out.dicts()] if batch else parts[0][0].to_json()
            return Response(orjson.dumps(body), media_type=JSON)
        except MeshError as e:
            await _Streams([s for _, s in parts]).aclose()
            return _native_error_response(e)
        except Exception:
            await _Streams([s for _, s in parts]).aclose()
            log.exception("http_request_failed", path="/generate")
            return _native_error_response(_internal())

    async def encode(self, request: Request) -> Response:
        """SGLang-native /encode: {"text"} or {"input_ids"} -> {"embedding", "meta_info"};
        a batch of prompts -> a list of them, in order."""
        started = time.monotonic()
        try:
            reqs, batch = native.native_embed_requests(await request.body(),
                                                          self.bounds.batch)
            ctx = call_context(request)
            replies = await asyncio.gather(*(self._invoke(
                "TextEmbed" if isinstance(req, sglang_pb2.TextEmbedRequest) else "Embed",
                req, ctx) for req in reqs))
            body = [native_embedding(reply, started) for reply in replies]
            return Response(orjson.dumps(body if batch else body[0]), media_type=JSON)
        except MeshError as e:
            return _native_error_response(e)
        except Exception:
            log.exception("http_request_failed", path="/encode")
            return _native_error_response(_internal())

    async def flush_cache(self, request: Request) -> Response:
        """SGLang-native /flush_cache: plain text; 200 when flushed, 400 when refused."""
        try:
            reply = await self._invoke("FlushCache", sglang_pb2.FlushCacheRequest(),
                                       call_context(request))
        except MeshError as e:
            return _native_error_response(e)
        except Exception:
            log.exception("http_request_failed", path="/flush_cache")
            return _native_error_response(_internal())
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

    async def models(self, request: Request) -> Response:
        """OpenAI's model list."""
        try:
            cards = self.api.info.model_cards()
            data = [self._model(c) for c in cards]
            return Response(orjson.dumps({"object": "list", "data": data}), media_type=JSON)
        except MeshError as e:
            return _native_error_response(e)
        except Exception:
            log.exception("http_request_failed", path="/v1/models")
            return _native_error_response(_internal())

    def _model(self, card: sglang_pb2.ModelCard) -> dict[str, Any]:
        return {
            "id": card.id,
            "object": "model",
            "created": self.created,
            "owned_by": "meshlm",
            "root": card.root or card.id,
            "parent": card.parent if card.HasField("parent") else None,
            "max_model_len": card.max_model_len if card.HasField("max_model_len") else None,
        }


def _samples(req: native.NativeRequest) -> int:
    """The requests one prompt puts into the mesh (its n samples)."""
    sampling = req.sampling_params
    return sampling.n if sampling.HasField("n") and sampling.n > 1 else 1


# ---- streams ---------------------------------------------------------------------------------

_EMPTY = object()


async def _first(stream: AsyncIterator[Any]) -> Any:
    """The stream's first message (_EMPTY if none); closes the stream when that fails."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return _EMPTY
    except BaseException:
        await _aclose(stream)
        raise


async def _aclose(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class _Streams:
    """The api streams of one /generate call (one per prompt), closed together."""

    def __init__(self, streams: list[AsyncIterator[Any]]) -> None:
        self.streams = streams

    async def aclose(self) -> None:
        for stream in self.streams:
            await _aclose(stream)


async def _first_of_each(streams: list[AsyncIterator[Any]]) -> list[Any]:
    """Each stream's first message, fetched concurrently; the first failure is raised (the
    caller closes the streams)."""
    firsts = await asyncio.gather(*(_first(s) for s in streams), return_exceptions=True)
    for first in firsts:
        if isinstance(first, BaseException):
            raise first
    return firsts


async def _drain(parts: list[tuple[NativeChoices, AsyncIterator[Any]]]) -> None:
    """Fold every stream into its choices, concurrently; the first failure cancels the rest."""
    async def one(out: NativeChoices, stream: AsyncIterator[Any]) -> None:
        async for message in stream:
            out.add(message)

    tasks = [asyncio.ensure_future(one(out, stream)) for out, stream in parts]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _ndjson(first: Any, stream: AsyncIterator[Any], rpc: str) -> AsyncIterator[bytes]:
    if first is _EMPTY:
        return
    yield transcode.result_line(first)
    try:
        async for message in stream:
            yield transcode.result_line(message)
    except MeshError as e:
        yield transcode.error_line(e)
    except Exception:
        log.exception("http_stream_failed", rpc=rpc)
        yield transcode.error_line(_internal())


async def _sse(parts: list[tuple[NativeChoices, Any, AsyncIterator[Any]]]
               ) -> AsyncIterator[bytes]:
    """SSE events of every prompt's stream, in arrival order, then [DONE]; a failed stream
    ends with an error event (the others go on). The queue is bounded, so a client that
    stops reading stops the streams too (backpressure, no buffering without limit)."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=2 * len(parts))

    async def pump(out: NativeChoices, first: Any, stream: AsyncIterator[Any]) -> None:
        try:
            if first is not _EMPTY:
                await queue.put(sse_event(out.add(first).to_dict()))
                async for message in stream:
                    await queue.put(sse_event(out.add(message).to_dict()))
        except MeshError as e:
            await queue.put(sse_event(native_error(e)))
        except Exception:
            log.exception("http_stream_failed", path="/generate")
            await queue.put(sse_event(native_error(_internal())))
        await queue.put(None)  # not when cancelled: then nobody reads the queue any more

    tasks = [asyncio.ensure_future(pump(*part)) for part in parts]
    try:
        running = len(tasks)
        while running:
            event = await queue.get()
            if event is None:
                running -= 1
            else:
                yield event
        yield SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _StreamResponse(Response):
    """Streams `chunks`. Whether the stream ends, fails or the client leaves, closes `chunks`
    and then the api iterator `source` (which aborts the request if it is not finished)."""

    def __init__(self, chunks: AsyncIterator[bytes], source: Any, media_type: str) -> None:
        self.chunks = chunks
        self.source = source
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(self._pump(send), receive)
        except (ClientGone, OSError):
            pass  # the client went away: nobody to tell
        finally:
            await _aclose(self.chunks)
            await _aclose(self.source)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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


def _internal() -> MeshError:
    return MeshError(grpc.StatusCode.INTERNAL, "internal error")


def _status_response(err: MeshError) -> Response:
    return Response(transcode.status_json(err), status_code=err.http_status, media_type=JSON)


def _native_error_response(err: MeshError) -> Response:
    return Response(orjson.dumps(native_error(err)), status_code=err.http_status, media_type=JSON)


async def _not_found(request: Request, exc: Exception) -> Response:
    err = MeshError(grpc.StatusCode.NOT_FOUND, f"no route for {request.method} {request.url.path}")
    return _status_response(err)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    err = MeshError(
        grpc.StatusCode.UNIMPLEMENTED, f"{request.method} is not allowed on {request.url.path}"
    )
    headers = exc.headers if isinstance(exc, HTTPException) else None
    return Response(transcode.status_json(err), status_code=405, headers=headers, media_type=JSON)
