"""SGLang-native HTTP routes beside /generate: /health_generate, /get_model_info,
/get_server_info, /get_load, /abort_request, /pause_generation, /continue_generation, /tokenize,
/detokenize, the profiling routes (/start_profile, /stop_profile, /start_request_profile,
/stop_request_profile) and /update_weights_from_disk, with SGLang's bodies and reply shapes (its
http_server.py and OpenAI-serving tokenize; ../shared/seeds/003_*.txt for the route surface).

The handlers are thin: parse the body, call the GatewayAPI method that the gRPC RPC calls, shape
the reply. Unknown body fields are refused (a mistyped "mode" must not pause in the default
mode). Handlers raise; errors are answered as /generate's, {"error": {"message", "code",
"type"}} with the mapped HTTP status and the message naming the field (`front/errors.py`), but
/update_weights_from_disk's in SGLang's reply shape ({"success": false, ...}).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import uuid
from collections.abc import Awaitable, Callable
from functools import wraps
from pathlib import Path
from typing import Any

import grpc
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from meshlm.common.errors import MeshError, invalid
from meshlm.common.logs import get_logger
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.profile import default_output_dir, stop_message
from meshlm.gateway.front.errors import Shape
from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.protocol import transcode
from meshlm.v1 import profiler_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

JSON = "application/json"
HEALTH_GENERATE_TIMEOUT = 20.0  # seconds; SGLang's HEALTH_CHECK_TIMEOUT
MAX_PROMPTS = 1024  # prompts (or token lists) in one /tokenize or /detokenize call
_INT32 = 2**31

Handler = Callable[[Request], Awaitable[Any]]
OWN_SHAPES = {"/update_weights_from_disk": Shape.WEIGHTS}  # not the family's error shape


def native_routes(api: Any) -> list[BaseRoute]:
    """The routes over `api` (a GatewayAPI)."""
    h = _NativeHandlers(api)
    get, post = ["GET"], ["POST"]
    return [
        Route("/health_generate", _json(h.health_generate), methods=get),
        Route("/get_model_info", _json(h.get_model_info), methods=get),
        Route("/get_server_info", _json(h.get_server_info), methods=get),
        Route("/get_load", _json(h.get_load), methods=get),
        Route("/abort_request", _json(h.abort_request), methods=post),
        Route("/pause_generation", _json(h.pause_generation), methods=post),
        Route("/continue_generation", _json(h.continue_generation), methods=post),
        Route("/tokenize", _json(h.tokenize), methods=post),
        Route("/detokenize", _json(h.detokenize), methods=post),
        Route("/start_profile", _json(h.start_profile), methods=post),
        Route("/stop_profile", _json(h.stop_profile), methods=post),
        Route("/start_request_profile", _json(h.start_request_profile), methods=post),
        Route("/stop_request_profile", _json(h.stop_request_profile), methods=post),
        Route("/update_weights_from_disk", _json(h.update_weights_from_disk), methods=post),
    ]


class _NativeHandlers:
    """Each returns a JSON-able reply (or a Response) and raises MeshError."""

    def __init__(self, api: Any) -> None:
        self.api = api

    async def health_generate(self, request: Request) -> Response:
        """200 once a one-token generation (an embedding, for embedding-only models) came
        back through the whole mesh; 503 if not ready, failed or not within the timeout (also
        while generation is paused: the probe waits like any request)."""
        ctx = call_context(request)
        try:
            if not self.api.core.is_healthy():
                raise MeshError(grpc.StatusCode.UNAVAILABLE,
                                f"not ready: waiting for {self.api.core.missing() or 'model info'}")
            model = await self.api.info.GetModelInfo(pb.GetModelInfoRequest(), ctx)
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT):
                if _is_generation(_parsed(model.json_info).get("config", {})):
                    await self._one_token(ctx)
                else:
                    await self.api.generation.Embed(pb.EmbedRequest(input_ids=[0]), ctx)
        except TimeoutError:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, "health_generate: no output within "
                                                         f"{HEALTH_GENERATE_TIMEOUT:g} s") from None
        except MeshError as e:  # whatever failed, the mesh is not healthy: 503
            raise MeshError(grpc.StatusCode.UNAVAILABLE, e.message) from None
        return Response(b"", status_code=200)

    async def _one_token(self, ctx: CallContext) -> None:
        stream = self.api.generation.Generate(pb.GenerateRequest(
            input_ids=[0], stream=True,
            sampling_params=pb.SamplingParams(max_new_tokens=1, temperature=0.0)), ctx)
        try:
            await anext(stream)
        finally:
            await stream.aclose()  # aborts it in the mesh if it is still going

    async def get_model_info(self, request: Request) -> dict[str, Any]:
        reply = await self.api.info.GetModelInfo(pb.GetModelInfoRequest(), call_context(request))
        info = _parsed(reply.json_info)
        config = info.get("config", {})
        return {
            "model_path": reply.model_path,
            "tokenizer_path": reply.model_path,
            "is_generation": _is_generation(config),
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "max_model_len": info.get("max_model_len"),
        }

    async def get_server_info(self, request: Request) -> dict[str, Any]:
        """The gateway's facts (GetServerInfo), each scheduler's state as `internal_states`
        (GetLoad) and the version, as SGLang's server_args + internal_states + version."""
        ctx = call_context(request)
        info, loads = await asyncio.gather(
            self.api.info.GetServerInfo(pb.GetServerInfoRequest(), ctx),
            self.api.info.GetLoad(pb.GetLoadRequest(), ctx))
        return {**_parsed(info.json_info), "internal_states": _parsed(loads.json_info),
                "version": _version()}

    async def get_load(self, request: Request) -> list[dict[str, Any]]:
        """One entry per scheduler (`?dp_rank=N` for one): SGLang's dp_rank, num_reqs
        (running + waiting), num_waiting_reqs, num_tokens (KV tokens in use), and meshlm's
        num_running_reqs, token_usage, paused (the pause mode or null) and address."""
        req = pb.GetLoadRequest()
        params = request.query_params
        for key in params:
            if key != "dp_rank":
                raise invalid(key, "unknown query parameter; /get_load takes dp_rank")
        if "dp_rank" in params:
            req.dp_rank = _query_int(params["dp_rank"], "dp_rank")
        reply = await self.api.info.GetLoad(req, call_context(request))
        return [_load(entry) for entry in _parsed(reply.json_info)]

    async def abort_request(self, request: Request) -> dict[str, Any]:
        """{"rid": ..., "abort_all": bool} -> {"success": bool}: false when no request with
        that rid is known (any more), as the Abort RPC says."""
        doc = await _body(request, ("rid", "abort_all"))
        rid = _string(doc, "rid", "")
        abort_all = _boolean(doc, "abort_all", False)
        if not rid and not abort_all:
            raise invalid("rid", "give the rid of a request, or \"abort_all\": true")
        reply = await self.api.admin.Abort(pb.AbortRequest(rid=rid, abort_all=abort_all),
                                     call_context(request))
        return {"success": reply.success}

    async def pause_generation(self, request: Request) -> dict[str, Any]:
        """{"mode": "abort" (default) | "retract" | "in_place"}."""
        doc = await _body(request, ("mode",))
        mode = _string(doc, "mode", "abort")
        reply = await self.api.pause.PauseGeneration(pb.PauseGenerationRequest(mode=mode),
                                               call_context(request))
        return {"message": reply.message, "status": "ok"}

    async def continue_generation(self, request: Request) -> dict[str, Any]:
        await _body(request, ())
        reply = await self.api.pause.ContinueGeneration(pb.ContinueGenerationRequest(),
                                                  call_context(request))
        return {"message": reply.message, "status": "ok"}

    async def start_profile(self, request: Request) -> dict[str, Any]:
        """{"run_id", "trace_path_template", "event_dir", "enable_torch" (default true),
        "output_dir"}: a torch trace and request events across the mesh. Without paths,
        `output_dir` (default: under the temp dir) holds `trace*` and `events/`."""
        doc = await _body(request, ("run_id", "trace_path_template", "event_dir",
                                    "enable_torch", "output_dir"))
        run_id = _string(doc, "run_id", "") or uuid.uuid4().hex[:12]
        template, event_dir = _string(doc, "trace_path_template", ""), _string(doc, "event_dir", "")
        if not template and not event_dir:
            out = Path(_string(doc, "output_dir", "") or default_output_dir(run_id))
            if not out.is_absolute():
                raise invalid("output_dir", f"must be an absolute path, got {str(out)!r}")
            template, event_dir = str(out / "trace"), str(out / "events")
        elif "output_dir" in doc:
            raise invalid("output_dir", "give output_dir, or trace_path_template / event_dir, "
                                        "not both")
        return await self._start_profile(profiler_pb2.ProfileStart(
            run_id=run_id, trace_path_template=template, event_dir=event_dir,
            enable_torch=_boolean(doc, "enable_torch", True)))

    async def start_request_profile(self, request: Request) -> dict[str, Any]:
        """{"run_id", "event_dir"}: request events only, no torch trace."""
        doc = await _body(request, ("run_id", "event_dir"))
        run_id = _string(doc, "run_id", "") or uuid.uuid4().hex[:12]
        event_dir = _string(doc, "event_dir", "") or str(Path(default_output_dir(run_id)) /
                                                         "events")
        return await self._start_profile(profiler_pb2.ProfileStart(
            run_id=run_id, event_dir=event_dir, enable_torch=False))

    async def _start_profile(self, start: profiler_pb2.ProfileStart) -> dict[str, Any]:
        run = await self.api.profile.start_profile(start)
        return {"status": "ok", "run_id": run.run_id, "event_dir": start.event_dir or None,
                "trace_path_template": start.trace_path_template if start.enable_torch else None,
                "message": f"Profiling run {run.run_id} started on {run.services} service(s).",
                "services": run.messages}

    async def stop_profile(self, request: Request) -> dict[str, Any]:
        """{"run_id"} (optional: without it, whatever run is open stops everywhere)."""
        doc = await _body(request, ("run_id",))
        run = await self.api.profile.stop_profile(_string(doc, "run_id", ""))
        return {"status": "ok" if run.services else "not_active", "run_id": run.run_id or None,
                "files": run.files, "message": stop_message(run), "unreached": run.failed}

    stop_request_profile = stop_profile  # a run is one session: both stop all of it

    async def update_weights_from_disk(self, request: Request) -> dict[str, Any]:
        """{"model_path", "load_format" (auto | safetensors | dummy), "abort_all_requests"
        (false: running requests are retracted and recomputed on the new weights)} ->
        SGLang's {"success", "message", "num_paused_requests"}; a failure has success false and
        the error's HTTP status (400: bad argument or incompatible checkpoint, 404: no
        checkpoint there, 503: a scheduler did not answer)."""
        doc = await _body(request, ("model_path", "load_format", "abort_all_requests"))
        update = await self.api.weights.update_weights(
            _string(doc, "model_path", ""), _string(doc, "load_format", ""),
            abort_all=_boolean(doc, "abort_all_requests", False))
        return {"success": True, "message": update.message,
                "num_paused_requests": update.retracted}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """{"prompt": str | [str, ...], "add_special_tokens": true} ->
        {"tokens", "count", "max_model_len"} (lists for a list of prompts)."""
        doc = await _body(request, ("prompt", "add_special_tokens", "model"))
        _string(doc, "model", "")  # one model is served: the name is not checked
        add_special = _boolean(doc, "add_special_tokens", True)
        prompt = doc.get("prompt")
        batch = isinstance(prompt, list)
        prompts = _batch(prompt if isinstance(prompt, list) else [prompt], "prompt")
        for i, text in enumerate(prompts):
            where = f"prompt[{i}]" if batch else "prompt"
            if not isinstance(text, str):
                raise invalid(where, "give a string" + ("" if batch else " or a list of them"))
            if not text:
                raise invalid(where, "must not be empty")
        ctx = call_context(request)
        replies = await asyncio.gather(*(self.api.tokens.Tokenize(
            pb.TokenizeRequest(text=text, add_special_tokens=add_special), ctx)
            for text in prompts))
        tokens = [list(r.tokens) for r in replies]
        counts = [r.count for r in replies]
        return {"tokens": tokens if batch else tokens[0],
                "count": counts if batch else counts[0],
                "max_model_len": replies[0].max_model_len}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        """{"tokens": [id, ...] | [[id, ...], ...], "skip_special_tokens": true} ->
        {"text": str | [str, ...]}."""
        doc = await _body(request, ("tokens", "skip_special_tokens", "model"))
        _string(doc, "model", "")
        skip = _boolean(doc, "skip_special_tokens", True)
        tokens = doc.get("tokens")
        if not isinstance(tokens, list):
            raise invalid("tokens", "give a list of token ids, or a list of such lists")
        batch = bool(tokens) and all(isinstance(t, list) for t in tokens)
        lists = _batch(tokens if batch else [tokens], "tokens")
        for i, ids in enumerate(lists):
            _check_ids(ids, f"tokens[{i}]" if batch else "tokens")
        ctx = call_context(request)

        async def one(i: int, ids: list[int]) -> str:
            try:
                reply = await self.api.tokens.Detokenize(pb.DetokenizeRequest(tokens=ids), ctx,
                                                  skip_special_tokens=skip)
            except MeshError as e:  # its message names "tokens[j]": say which list
                if batch and e.message.startswith("tokens["):
                    e = MeshError(e.code, f"tokens[{i}]" + e.message[len("tokens"):])
                raise e from None
            return str(reply.text)

        texts = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(lists)))
        return {"text": texts if batch else texts[0]}


# ---- helpers ----------------------------------------------------------------------------------


def _json(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint: the handler's reply as JSON (a Response as it is)."""
    @wraps(handler)
    async def endpoint(request: Request) -> Response:
        reply = await handler(request)
        if isinstance(reply, Response):
            return reply
        return Response(orjson.dumps(reply), media_type=JSON)
    return endpoint


async def _body(request: Request, known: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object body ({} when empty), nulls dropped; unknown keys are refused."""
    doc = transcode.parse_json_body(await request.body())
    if not isinstance(doc, dict):
        raise invalid("body", "must be a JSON object")
    for key in doc:
        if key not in known:
            takes = ", ".join(known) if known else "no fields"
            raise invalid(key, f"unknown field; {request.url.path} takes {takes}")
    return {k: v for k, v in doc.items() if v is not None}


def _string(doc: dict[str, Any], key: str, default: str) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str):
        raise invalid(key, f"must be a string, got {json.dumps(value)}")
    return value


def _boolean(doc: dict[str, Any], key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise invalid(key, f"must be true or false, got {json.dumps(value)}")
    return value


def _query_int(raw: str, key: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise invalid(key, f"must be an integer, got {raw!r}") from None
    if not -_INT32 <= value < _INT32:
        raise invalid(key, f"{value} is out of range")
    return value


def _batch(items: list[Any], key: str) -> list[Any]:
    if not items:
        raise invalid(key, "must not be an empty list")
    if len(items) > MAX_PROMPTS:
        raise invalid(key, f"has {len(items)} entries; at most {MAX_PROMPTS} per request")
    return items


def _check_ids(ids: Any, where: str) -> None:
    """A list of token ids that fit the wire (the API checks them against the vocabulary)."""
    if not isinstance(ids, list):
        raise invalid(where, "give a list of token ids")
    for j, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise invalid(f"{where}[{j}]", f"must be an integer token id, got {json.dumps(t)}")
        if not 0 <= t < _INT32:
            raise invalid(f"{where}[{j}]", f"token id {t} is out of range")


def _parsed(text: str) -> Any:
    return json.loads(text) if text else {}


def _is_generation(config: dict[str, Any]) -> bool:
    """Whether the checkpoint generates: a bare `*Model` architecture only embeds."""
    architectures = config.get("architectures") or [""]
    return not str(architectures[0]).endswith("Model")


def _load(entry: dict[str, Any]) -> dict[str, Any]:
    """One scheduler's GetLoad entry in SGLang's /get_load shape (plus meshlm's figures)."""
    if "error" in entry:
        return {"dp_rank": entry["dp_rank"], "address": entry.get("address"),
                "error": entry["error"]}
    running, waiting = entry.get("running", 0), entry.get("waiting", 0)
    return {
        "dp_rank": entry["dp_rank"],
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": entry.get("kv_tokens_used", 0),
        "num_running_reqs": running,
        "token_usage": entry.get("token_usage", 0.0),
        "paused": entry.get("paused"),
        "address": entry.get("address"),
    }


def _version() -> str:
    try:
        return importlib.metadata.version("meshlm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
