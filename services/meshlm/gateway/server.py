"""Gateway process: public gRPC (SglangService) and HTTP on their ports, the internal inbox
(mutual TLS) that detokenizers stream into, the dependency watchers, discovery and the RID
registry."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import uvicorn

from meshlm.common import config as cfg
from meshlm.common.channels import ChannelPool
from meshlm.common.logs import get_logger
from meshlm.common.memory import freeze_startup_objects
from meshlm.common.metrics import GatewayMetrics
from meshlm.common.redis_client import RedisAuth
from meshlm.common.roles import MESH_PORTS
from meshlm.common.server import Binding, GrpcServer, is_native, wait_for_signal
from meshlm.common.service import (
    ServiceConfig,
    advertised,
    mesh_server,
    start_mesh_server,
    start_metrics,
    streams_tls,
)
from meshlm.common.streams import BatchedStream
from meshlm.common.tasks import Periodic
from meshlm.common.tls import MeshTLS, server_credentials, tls_context
from meshlm.gateway.api.core import GatewayCore, GatewayIdentity
from meshlm.gateway.api.gateway import GatewayAPI
from meshlm.gateway.api.weights import FOLLOW_INTERVAL
from meshlm.gateway.front.auth import ApiKeyInterceptor, ApiKeys
from meshlm.gateway.front.http_app import build_http_app
from meshlm.gateway.front.http_protocol import timed_http
from meshlm.gateway.front.reclaim import Reclaimer
from meshlm.gateway.front.servicer import SglangServicer
from meshlm.gateway.mesh.dependencies import ROLES, Dependencies
from meshlm.gateway.mesh.discovery import Discovery
from meshlm.gateway.mesh.inbox import InboxServicer, RequestTable
from meshlm.gateway.mesh.membership import split_entries
from meshlm.gateway.mesh.registry import RidRegistry
from meshlm.gateway.mesh.replicas import Replicas
from meshlm.gateway.protocol.bounds import (
    DEFAULT_BODY_BYTES,
    DEFAULT_GRPC_RECEIVE_BYTES,
    DEFAULT_READ_TIMEOUT,
    Bounds,
)
from meshlm.gateway.protocol.reasoning import PARSERS as REASONING_PARSERS
from meshlm.gateway.protocol.tool_parsers import PARSERS
from meshlm.v1 import gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2_grpc

log = get_logger(__name__)


@dataclass
class GatewayConfig(ServiceConfig):
    """meshlm gateway: the public API (gRPC + HTTP)."""

    port: int = cfg.field(MESH_PORTS["gateway"],
                          "internal inbox gRPC port (mutual TLS); 0 picks a free port")
    http_port: int = cfg.field(30000, "public HTTP port; 0 picks a free port")
    grpc_port: int = cfg.field(0, "public gRPC port; 0 = HTTP port + 10000 (free port if the "
                                  "HTTP port is 0)")
    public_host: str = cfg.field("127.0.0.1", "address to bind the public HTTP and gRPC ports on")
    tls_cert: str = cfg.field("", "public TLS certificate (PEM); plaintext when empty")
    tls_key: str = cfg.field("", "public TLS private key (PEM)")
    tls_client_ca: str = cfg.field("", "require public clients' certificates signed by this CA")
    tokenizers: tuple[str, ...] = cfg.field(
        (f"127.0.0.1:{MESH_PORTS['tokenizer']}",), "tokenizer addresses: "
                                            "host:port, or dns:///<name>:<port> for every "
                                            "address the name resolves to")
    schedulers: tuple[str, ...] = cfg.field(
        (f"127.0.0.1:{MESH_PORTS['scheduler']}",), "scheduler addresses (as "
                                            "--tokenizers); a scheduler's dp rank is its place: "
                                            "host:port entries in order, then the others sorted")
    detokenizers: tuple[str, ...] = cfg.field(
        (f"127.0.0.1:{MESH_PORTS['detokenizer']}",), "detokenizer addresses (as "
                                              "--tokenizers)")
    redis_url: str = cfg.field("redis://127.0.0.1:6379/0", "Redis for the shared RID registry "
                                                           "(and --discover)")
    discover: bool = cfg.field(False, "also use the replicas that announce themselves in "
                                      "--redis-url (--announce-redis-url on the backends); "
                                      "polled every --heartbeat-interval")
    dns_server: str = cfg.field("", "host:port of the DNS server for dns:/// entries; empty = "
                                    "the system resolver (/etc/resolv.conf, search domains)")
    registry_ttl: float = cfg.field(3600.0, "seconds a live request's record is kept")
    registry_finished_ttl: float = cfg.field(300.0, "seconds a finished request's record is kept")
    served_model_name: str = cfg.field("", "model id in ListModels and /v1/models "
                                           "(default: the checkpoint directory's name)")
    tool_call_parser: str = cfg.field("", "the model's own tool-call format, read for chat "
                                          "completions with tool_choice \"auto\": hermes "
                                          "or qwen25 (<tool_call>{json}</tool_call>: Hermes 2 "
                                          "Pro and later, Qwen2.5, Qwen3), llama3_json, "
                                          "llama4_json or llama3 (Llama 3.1 and later's JSON "
                                          "calls), pythonic (Llama 3.2 and 4's [f(a=1)]), "
                                          "mistral ([TOOL_CALLS]: Mistral, Mixtral, Magistral, "
                                          "Devstral), qwen3_coder (<function=...> with "
                                          "<parameter=...>: Qwen3-Coder, Qwen3.5), glm45 or "
                                          "glm47 (<arg_key>/<arg_value>: GLM-4.5 and later), "
                                          "deepseek_v3 or deepseekv3 (DeepSeek-V3, R1), "
                                          "deepseek_v31 or deepseekv31 (DeepSeek-V3.1 and "
                                          "later), kimi_k2 (Kimi K2); empty: auto is refused "
                                          "(forced calls need none)")
    reasoning_parser: str = cfg.field("", "the model's thinking, split from its chat answers "
                                          "as reasoning_content: deepseek-r1 (deepseek_r1) or "
                                          "qwen3-thinking (the output starts in thought, up "
                                          "to </think>), qwen3 or glm45 (<think>...</think> "
                                          "when the output starts so), mistral ([THINK]..."
                                          "[/THINK], Magistral), deepseek-v3 or deepseek_v3 "
                                          "(in thought when the chat's template variable "
                                          "thinking is true: DeepSeek-V3.1); empty: none")
    trust_request_chat_template: bool = cfg.field(
        False, "render a chat completion's own chat_template (vLLM's field; a template runs "
               "in the tokenizer's Jinja sandbox, but can spend its CPU: only for trusted "
               "clients); off: such a request is a 400")
    max_inflight: int = cfg.field(1024, "requests in flight on this gateway (each of n samples "
                                        "counts); beyond it RESOURCE_EXHAUSTED / 429 at once")
    http_max_body_bytes: int = cfg.field(DEFAULT_BODY_BYTES, "largest HTTP request body; past "
                                                             "it 413 before the body is read "
                                                             "(0 = no limit)")
    http_read_timeout: float = cfg.field(DEFAULT_READ_TIMEOUT, "seconds an HTTP client may take "
                                         "to send a request's head (its connection closes) "
                                         "and between two pieces of its body (408); 0 = no "
                                         "limit")
    grpc_max_receive_bytes: int = cfg.field(DEFAULT_GRPC_RECEIVE_BYTES, "largest public gRPC "
                                            "request message; past it grpc answers "
                                            "RESOURCE_EXHAUSTED (0 = 64 MiB, what the "
                                            "internal ports take)")
    grpc_accept_ahead: int = cfg.field(64, "public gRPC calls of each method the gateway asks "
                                          "grpc for ahead of their arrival, so that a busy "
                                          "gateway starts new calls without waiting on its "
                                          "event loop one at a time; 0 = grpc's own (one)")
    grpc_server: str = cfg.field("native", "what serves the public gRPC port: native (the "
                                           "gateway's own HTTP/2 on its event loop: a fifth "
                                           "of grpc.aio's CPU per streamed message) or grpcio "
                                           "(grpc.aio, with --grpc-accept-ahead)")
    max_prompt_chars: int = cfg.field(0, "characters of a text prompt (a chat: of its "
                                         "messages) checked before tokenization; past it "
                                         "INVALID_ARGUMENT / 400; 0 = the model's context "
                                         "length x 32 (characters a token: more than any "
                                         "prompt that fits averages)")
    max_batch: int = cfg.field(0, "requests one call may put into the mesh (prompts x n); "
                                  "past it INVALID_ARGUMENT / 400 before any is sent; 0 = "
                                  "--max-inflight (never more than that)")
    api_key: tuple[str, ...] = cfg.field((), "API keys: every public RPC and route but health, "
                                             "reflection and /metrics then needs "
                                             "'authorization: Bearer <key>'", secret=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it Nagle + delayed ACK hold each streamed chunk ~40 ms on a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _http_server(config: GatewayConfig, app: Any) -> uvicorn.Server:
    kwargs: dict[str, object] = {}
    if config.tls_cert:
        kwargs.update(ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key)
        if config.tls_client_ca:
            kwargs.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    uv_config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                               timeout_graceful_shutdown=int(config.shutdown_grace),
                               http=timed_http(config.http_read_timeout), loop="none",
                               **kwargs)  # type: ignore[arg-type]
    return uvicorn.Server(uv_config)


async def serve(config: GatewayConfig) -> None:
    lists = {"tokenizer": config.tokenizers, "scheduler": config.schedulers,
             "detokenizer": config.detokenizers}
    entries = {role: split_entries(lists[role], f"--{role}s") for role in ROLES}
    for flag, value, names in (("--tool-call-parser", config.tool_call_parser, PARSERS),
                               ("--reasoning-parser", config.reasoning_parser,
                                REASONING_PARSERS)):
        if value not in ("", *names):
            raise ValueError(f"{flag}: {value!r} is not one of {', '.join(names)} (or empty: "
                             "none)")
    tls = MeshTLS(config.mesh_ca, config.mesh_cert, config.mesh_key)
    channels = ChannelPool(tls.channel_credentials(), config.peer_tls_name,
                           streams_tls(config, tls))
    table = RequestTable()
    redis_auth = RedisAuth.from_config(config)
    registry = RidRegistry(config.redis_url, config.registry_ttl, config.registry_finished_ttl,
                           redis_auth)
    registry.start()

    inbox_servicer = InboxServicer(table)
    inbox = mesh_server(config, [Binding(gateway_pb2_grpc.add_GatewayInboxServicer_to_server,
                                         inbox_servicer, "meshlm.v1.GatewayInbox",
                                         inbox_servicer.sinks())])
    inbox_address = advertised(config, await start_mesh_server(inbox, config, tls))
    identity = GatewayIdentity(inbox=inbox_address, served_model_name=config.served_model_name,
                               tool_call_parser=config.tool_call_parser,
                               reasoning_parser=config.reasoning_parser,
                               trust_request_chat_template=config.trust_request_chat_template)

    submit: dict[str, BatchedStream[tokenizer_pb2.GenerateRequest]] = {}
    public: GrpcServer | None = None
    api_ref: list[GatewayAPI] = []

    def on_change(ready: bool) -> None:
        asyncio.ensure_future(_set_ready(ready))

    async def _set_ready(ready: bool) -> None:
        core = api_ref[0].core
        if ready and core.model is None:
            await core.refresh_info()
            if core.model is not None and not identity.served_model_name:
                identity.served_model_name = Path(core.model.model_path).name
        serving = ready and core.model is not None
        log.info("ready" if serving else "not_ready", missing=core.missing())
        for server in (inbox, public):
            if server is not None:
                await server.set_serving(serving)

    deps = Dependencies(channels, {role: static for role, (static, _) in entries.items()},
                        on_change,
                        lambda role, address: api_ref[0].generation.on_dependency_down(role,
                                                                                   address))
    metrics = GatewayMetrics(lambda: identity.served_model_name,
                             lambda: _engine_loads(channels, deps.addresses["scheduler"]),
                             registry_degraded=lambda: registry.degraded)
    bounds = Bounds(max_body_bytes=config.http_max_body_bytes,
                    read_timeout=config.http_read_timeout,
                    max_prompt_chars=config.max_prompt_chars, max_batch=config.max_batch,
                    max_inflight=config.max_inflight)
    api = GatewayAPI(GatewayCore(identity, deps, table, registry, channels, bounds), submit,
                     metrics)
    api_ref.append(api)
    replicas = Replicas(deps, channels, submit, api.generation)
    for address in deps.addresses["tokenizer"]:
        replicas.open_submit(address)
    discovery = Discovery(replicas, {role: names for role, (_, names) in entries.items()},
                          redis_url=config.redis_url if config.discover else "",
                          interval=config.heartbeat_interval, dns_server=config.dns_server,
                          redis_auth=redis_auth)

    keys = ApiKeys(config.api_key)
    reclaim = Reclaimer()  # memory of big requests, given back after them
    native = is_native(config.grpc_server, "--grpc-server")
    public = GrpcServer([Binding(sglang_pb2_grpc.add_SglangServiceServicer_to_server,
                                 SglangServicer(api, reclaim), "sglang.runtime.v1.SglangService")],
                        interceptors=[ApiKeyInterceptor(keys)] if keys else [],
                        public=True, max_receive_bytes=config.grpc_max_receive_bytes or None,
                        accept_ahead=config.grpc_accept_ahead, native=native)
    public_creds: grpc.ServerCredentials | ssl.SSLContext | None = None
    if config.tls_cert:
        public_creds = (tls_context if native else server_credentials)(
            config.tls_cert, config.tls_key, config.tls_client_ca or None,
            bool(config.tls_client_ca))
    http_sock = _bind(config.public_host, config.http_port)
    http_port = http_sock.getsockname()[1]
    grpc_port = config.grpc_port or (http_port + 10000 if config.http_port else 0)
    grpc_address = await public.start(config.public_host, grpc_port, public_creds)
    http = _http_server(config, build_http_app(api, metrics=metrics, keys=keys, bounds=bounds,
                                               reclaim=reclaim))
    http_task = asyncio.create_task(http.serve(sockets=[http_sock]), name="http")
    exporter = await start_metrics(config, metrics)
    health = await inbox.serve_health(config.host, config.health_port) \
        if config.health_port else None
    deps.start()
    following = Periodic("follow_checkpoint", api.weights.follow_checkpoint, FOLLOW_INTERVAL)
    following.start()
    if discovery.enabled:
        discovery.start()
    api.generation.loads.start()
    scheme = "https" if config.tls_cert else "http"
    host = config.public_host if ":" not in config.public_host else f"[{config.public_host}]"
    extra = {"metrics_address": advertised(config, exporter.address)} if exporter else {}
    if health is not None:
        extra["health_address"] = health
    freeze_startup_objects()  # collections walk only what requests make
    # After the freeze: the call requests it keeps outstanding are replaced as calls come, and
    # a frozen one would keep a failed call's error, traceback and request, for good.
    public.accept_ahead.start()
    log.info("listening", address=inbox_address, grpc_address=grpc_address,
             http_address=f"{scheme}://{host}:{http_port}", tls=bool(config.tls_cert),
             api_keys=bool(keys), **extra)

    await wait_for_signal()
    # Stop taking new work, let in-flight calls finish within the grace period, then exit.
    await public.set_serving(False)
    await inbox.set_serving(False)
    http.should_exit = True
    await public.stop(config.shutdown_grace)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(http_task, config.shutdown_grace + 1)
    await inbox.stop(1.0)
    if exporter is not None:
        await exporter.stop()
    await api.core.background.close()
    await api.generation.loads.close()
    await following.close()
    await discovery.close()
    await deps.close()
    await replicas.close()
    await registry.close()
    await channels.close()


async def _engine_loads(channels: ChannelPool,
                        schedulers: Sequence[str]) -> list[tuple[int, dict[str, Any]]]:
    """(dp_rank, Engine.stats()) of every scheduler that answers, for /metrics."""
    async def one(rank: int, address: str) -> tuple[int, dict[str, Any]] | None:
        stub = scheduler_pb2_grpc.SchedulerStub(channels.get(address))
        try:
            load = await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return None
        return rank, json.loads(load.json_info)

    loads = await asyncio.gather(*(one(r, a) for r, a in enumerate(schedulers)))
    return [load for load in loads if load is not None]
