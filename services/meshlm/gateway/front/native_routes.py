"""SGLang-native HTTP routes beside /generate: /health_generate, /get_model_info,
/get_server_info (and SGLang's current /model_info, /server_info), /get_load, /abort_request,
/pause_generation, /continue_generation, the profiling routes (/start_profile, /stop_profile,
/start_request_profile, /stop_request_profile) and /update_weights_from_disk, with SGLang's bodies
and reply shapes (its http_server.py; ../shared/seeds/003_*.txt for the route surface); and
vLLM's /load and /version.
/tokenize and /detokenize are `front/token_routes.py`.

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
from pathlib import Path
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from meshlm.common.errors import MeshError, invalid
from meshlm.common.logs import get_logger
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.admin import ABORTED_KEY
from meshlm.gateway.api.profile import default_output_dir, stop_message
from meshlm.gateway.front.errors import Shape
from meshlm.gateway.front.http_call import call_context
from meshlm.gateway.front.json_fields import body_of, bool_field, json_endpoint, string_field
from meshlm.v1 import profiler_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

JSON = "application/json"
HEALTH_GENERATE_TIMEOUT = 20.0  # seconds; SGLang's HEALTH_CHECK_TIMEOUT
_INT32 = 2**31

NATIVE_OWN_SHAPES = {"/update_weights_from_disk": Shape.WEIGHTS}  # not the family's shape


def native_routes(api: Any) -> list[BaseRoute]:
    """The routes over `api` (a GatewayAPI)."""
    h = _NativeHandlers(api)
    get, post = ["GET"], ["POST"]
    return [
        Route("/health_generate", json_endpoint(h.health_generate), methods=get),
        Route("/get_model_info", json_endpoint(h.get_model_info), methods=get),
        Route("/model_info", json_endpoint(h.get_model_info), methods=get),  # SGLang's today
        Route("/get_server_info", json_endpoint(h.get_server_info), methods=get),
        Route("/server_info", json_endpoint(h.get_server_info), methods=get),
        Route("/get_load", json_endpoint(h.get_load), methods=get),
        Route("/load", json_endpoint(h.server_load), methods=get),  # vLLM's
        Route("/version", json_endpoint(h.version), methods=get),  # vLLM's
        Route("/abort_request", json_endpoint(h.abort_request), methods=post),
        Route("/pause_generation", json_endpoint(h.pause_generation), methods=post),
        Route("/continue_generation", json_endpoint(h.continue_generation), methods=post),
        Route("/start_profile", json_endpoint(h.start_profile), methods=post),
        Route("/stop_profile", json_endpoint(h.stop_profile), methods=post),
        Route("/start_request_profile", json_endpoint(h.start_request_profile), methods=post),
        Route("/stop_request_profile", json_endpoint(h.stop_request_profile), methods=post),
        Route("/update_weights_from_disk", json_endpoint(h.update_weights_from_disk), methods=post),
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
                if _parsed(model.json_info)["is_generation"]:
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
        """GetModelInfo's facts (SGLang's keys among them) and SGLang's fixed ones."""
        reply = await self.api.info.GetModelInfo(pb.GetModelInfoRequest(), call_context(request))
        info = _parsed(reply.json_info)
        return {**info, "preferred_sampling_params": None, "has_image_understanding": False,
                "has_audio_understanding": False, "max_model_len": info.get("max_model_len")}

    async def get_server_info(self, request: Request) -> dict[str, Any]:
        """The gateway's facts (GetServerInfo), each scheduler's state as `internal_states`
        (GetLoad) and the version, as SGLang's server_args + internal_states + version."""
        call_context(request)  # the deadline of a grpc-timeout header
        loads = await self.api.info.loads(None)
        return {**self.api.info.server_facts(loads), "internal_states": loads,
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

    async def server_load(self, request: Request) -> dict[str, Any]:
        """vLLM's {"server_load": n}: the requests this gateway has in flight (each prompt of
        a batch and each of n samples counted), whatever route or transport they came by."""
        return {"server_load": len(self.api.core.table.requests)}

    async def version(self, request: Request) -> dict[str, Any]:
        """vLLM's {"version": ...}: meshlm's."""
        return {"version": _version()}

    async def abort_request(self, request: Request) -> dict[str, Any]:
        """{"rid": ..., "abort_all": bool} -> {"success": true, "aborted": how many requests
        were ended (0: there was nothing to abort)}, as the Abort RPC says."""
        doc = await body_of(request, ("rid", "abort_all"))
        rid = string_field(doc, "rid", "")
        abort_all = bool_field(doc, "abort_all", False)
        if not rid and not abort_all:
            raise invalid("rid", "give the rid of a request, or \"abort_all\": true")
        ctx = call_context(request)
        reply = await self.api.admin.Abort(pb.AbortRequest(rid=rid, abort_all=abort_all), ctx)
        return {"success": reply.success, "aborted": int(ctx.trailers.get(ABORTED_KEY, 0))}

    async def pause_generation(self, request: Request) -> dict[str, Any]:
        """{"mode": "abort" (default) | "retract" | "in_place"}."""
        doc = await body_of(request, ("mode",))
        mode = string_field(doc, "mode", "abort")
        reply = await self.api.pause.PauseGeneration(pb.PauseGenerationRequest(mode=mode),
                                               call_context(request))
        return {"message": reply.message, "status": "ok"}

    async def continue_generation(self, request: Request) -> dict[str, Any]:
        await body_of(request, ())
        reply = await self.api.pause.ContinueGeneration(pb.ContinueGenerationRequest(),
                                                  call_context(request))
        return {"message": reply.message, "status": "ok"}

    async def start_profile(self, request: Request) -> dict[str, Any]:
        """{"run_id", "trace_path_template", "event_dir", "enable_torch" (default true),
        "output_dir"}: a torch trace and request events across the mesh. Without paths,
        `output_dir` (default: under the temp dir) holds `trace*` and `events/`."""
        doc = await body_of(request, ("run_id", "trace_path_template", "event_dir",
                                    "enable_torch", "output_dir"))
        run_id = string_field(doc, "run_id", "") or uuid.uuid4().hex[:12]
        template = string_field(doc, "trace_path_template", "")
        event_dir = string_field(doc, "event_dir", "")
        if not template and not event_dir:
            out = Path(string_field(doc, "output_dir", "") or default_output_dir(run_id))
            if not out.is_absolute():
                raise invalid("output_dir", f"must be an absolute path, got {str(out)!r}")
            template, event_dir = str(out / "trace"), str(out / "events")
        elif "output_dir" in doc:
            raise invalid("output_dir", "give output_dir, or trace_path_template / event_dir, "
                                        "not both")
        return await self._start_profile(profiler_pb2.ProfileStart(
            run_id=run_id, trace_path_template=template, event_dir=event_dir,
            enable_torch=bool_field(doc, "enable_torch", True)))

    async def start_request_profile(self, request: Request) -> dict[str, Any]:
        """{"run_id", "event_dir"}: request events only, no torch trace."""
        doc = await body_of(request, ("run_id", "event_dir"))
        run_id = string_field(doc, "run_id", "") or uuid.uuid4().hex[:12]
        event_dir = string_field(doc, "event_dir", "") or str(Path(default_output_dir(run_id)) /
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
        doc = await body_of(request, ("run_id",))
        run = await self.api.profile.stop_profile(string_field(doc, "run_id", ""))
        return {"status": "ok" if run.services else "not_active", "run_id": run.run_id or None,
                "files": run.files, "message": stop_message(run), "unreached": run.failed}

    stop_request_profile = stop_profile  # a run is one session: both stop all of it

    async def update_weights_from_disk(self, request: Request) -> dict[str, Any]:
        """{"model_path", "load_format" (auto | safetensors | dummy), "abort_all_requests"
        (false: running requests are retracted and recomputed on the new weights)} ->
        SGLang's {"success", "message", "num_paused_requests"}; a failure has success false and
        the error's HTTP status (400: bad argument or incompatible checkpoint, 404: no
        checkpoint there, 503: a scheduler did not answer)."""
        doc = await body_of(request, ("model_path", "load_format", "abort_all_requests"))
        update = await self.api.weights.update_weights(
            string_field(doc, "model_path", ""), string_field(doc, "load_format", ""),
            abort_all=bool_field(doc, "abort_all_requests", False))
        return {"success": True, "message": update.message,
                "num_paused_requests": update.retracted}


# ---- helpers ----------------------------------------------------------------------------------


def _query_int(raw: str, key: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise invalid(key, f"must be an integer, got {raw!r}") from None
    if not -_INT32 <= value < _INT32:
        raise invalid(key, f"{value} is out of range")
    return value


def _parsed(text: str) -> Any:
    return json.loads(text) if text else {}


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
