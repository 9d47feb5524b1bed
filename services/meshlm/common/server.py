"""The gRPC server every service runs: its own services plus grpc.health.v1 and reflection,
the interceptors (tracing, errors, request parsing), keepalive settings, and graceful
shutdown on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from meshlm.common.accept_ahead import AcceptAhead, RecordingServer
from meshlm.common.channels import (
    MESH_MESSAGE_BYTES,
    MIN_PING_INTERVAL_MS,
    SERVER_KEEPALIVE_TIME_MS,
    SERVER_PING_TIMEOUT_MS,
)
from meshlm.common.interceptors import ErrorInterceptor, TracingInterceptor
from meshlm.common.logs import get_logger
from meshlm.common.native_grpc.server import NativeServer
from meshlm.common.parsing import ParseInterceptor, Parser

log = get_logger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Health service name that is SERVING while the process runs, ready or not (until shutdown): for
# liveness probes, which must not restart a replica that only waits for its dependencies.
LIVENESS = "liveness"

# Keepalive: a hung client's connection closes within seconds, and the mesh clients' pings
# (every KEEPALIVE_TIME_MS of silence, common/channels.py) are allowed on idle streams.
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", SERVER_PING_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", SERVER_PING_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MESH_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MESH_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

# A public port's clients are on networks of any quality and hold idle connections for long:
# ping them after 30 s of silence and give the answer 10 s (they may ping as the mesh does).
PUBLIC_KEEPALIVE: dict[str, Any] = {
    "grpc.keepalive_time_ms": 30_000,
    "grpc.keepalive_timeout_ms": 10_000,
    "grpc.http2.ping_timeout_ms": 10_000,
}


# A mesh port's streams carry one batch per engine step; its receive window stays small and
# fixed (no BDP probing, which grows it to megabytes), so a receiver that falls behind stops
# its sender within a few batches. The sender's queue then merges what waits into one batch
# (common/streams.py): a gateway short of CPU gets several steps' tokens per message, and
# sends each client fewer, fuller messages, instead of seconds of single-step batches
# queueing in HTTP/2 buffers (measured at saturation on the tiny model: outputs reached the
# gateway ~1 s after the detokenizer sent them, 1 message per streamed token; with this
# window 25-45 ms, 0.7 messages per token, and 1.25-1.6x the mesh's throughput).
MESH_WINDOW_BYTES = 16 * 1024
MESH_FLOW: list[tuple[str, Any]] = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", MESH_WINDOW_BYTES),
]


def server_options(public: bool = False, max_receive_bytes: int | None = None,
                   ) -> list[tuple[str, Any]]:
    """SERVER_OPTIONS, with PUBLIC_KEEPALIVE for a public port and its message limit, or
    MESH_FLOW for a mesh port (a public port keeps grpc's growing window: its clients may be
    far away)."""
    overrides: dict[str, Any] = {**PUBLIC_KEEPALIVE} if public else {}
    if max_receive_bytes is not None:
        overrides["grpc.max_receive_message_length"] = max_receive_bytes
    options = [(k, overrides.get(k, v)) for k, v in SERVER_OPTIONS]
    return options if public else options + MESH_FLOW


NATIVE_PUBLIC_WINDOW = 4 * 1024 * 1024  # a public call's receive window on the native server


def _parsing(sink: Sink, parser: Parser) -> Callable[[bytes], None]:
    """`sink` taking bytes: each parsed (a malformed one is INVALID_ARGUMENT, as everywhere)."""
    parse, take = parser.parse, sink.take
    return lambda raw: take(parse(raw, None))


def _keepalive_seconds(public: bool) -> tuple[float, float]:
    """The native server's (idle time before it PINGs a silent client, time for the answer),
    as grpc.aio's server options set them."""
    if public:
        return (PUBLIC_KEEPALIVE["grpc.keepalive_time_ms"] / 1000,
                PUBLIC_KEEPALIVE["grpc.keepalive_timeout_ms"] / 1000)
    return SERVER_KEEPALIVE_TIME_MS / 1000, SERVER_PING_TIMEOUT_MS / 1000


SERVER_KINDS = ("native", "grpcio")


def is_native(kind: str, flag: str) -> bool:
    """Whether a --*-server flag's value picks the native server (else grpc.aio's)."""
    if kind not in SERVER_KINDS:
        raise ValueError(f"{flag}: {kind!r} is not one of {', '.join(SERVER_KINDS)}")
    return kind == "native"


@dataclass
class Binding:
    """One service implementation to register: `add(servicer, server)` from the generated
    *_pb2_grpc module and the service's full name (for health and reflection)."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    name: str
    sinks: Mapping[str, Sink] = field(default_factory=dict)  # method name -> its sink


@dataclass(frozen=True)
class Sink:
    """Where a streamed request's messages go on the native server: each is parsed as
    `message` and given to `take` as its bytes arrive, instead of waking the method's handler
    for it (`NativeServer.add_sink`). The handler, which grpc.aio's server runs as ever, must
    do the same with each message it reads; on the native server it reads only their end."""

    message: type[Message]
    take: Callable[[Any], None]


class GrpcServer:
    """A grpc.aio server with health (Check/Watch for "" and each service) and reflection.
    `interceptors` run before the tracing and error ones (the gateway's API-key check);
    `public` is the gateway's public port: `max_receive_bytes` instead of the mesh's 64 MiB
    message limit (RESOURCE_EXHAUSTED past it) and PUBLIC_KEEPALIVE; requests are parsed
    innermost, so a malformed one is INVALID_ARGUMENT (common/parsing.py). `accept_ahead`: more
    call requests kept outstanding for each method of `bindings` (common/accept_ahead.py), for
    a port where new calls come often to a busy event loop; `accept_ahead.start()` them once
    started (after gc.freeze, where the process freezes its start-up objects). `native`: the
    same services on common/native_grpc's server instead of grpc.aio's (the gateway's public
    port, where a message per token crosses it; no accept-ahead, none needed)."""

    def __init__(self, bindings: Sequence[Binding],
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 public: bool = False, max_receive_bytes: int | None = None,
                 accept_ahead: int = 0, native: bool = False) -> None:
        chain = (*interceptors, TracingInterceptor(), ErrorInterceptor(), ParseInterceptor())
        self.native = native
        if native:
            self.server: grpc.aio.Server = NativeServer(
                chain, max_receive_bytes=max_receive_bytes or MESH_MESSAGE_BYTES,
                stream_window=NATIVE_PUBLIC_WINDOW if public else MESH_WINDOW_BYTES,
                keepalive=_keepalive_seconds(public))
            accept_ahead = 0
        else:
            self.server = grpc.aio.server(interceptors=chain,
                                          options=server_options(public, max_receive_bytes))
        self.health = HealthServicer()
        self.names = [b.name for b in bindings]
        recording = RecordingServer(self.server)
        for b in bindings:
            b.add(b.servicer, recording)
            if isinstance(self.server, NativeServer):
                for method, sink in b.sinks.items():
                    path = f"/{b.name}/{method}"
                    self.server.add_sink(path, _parsing(sink, Parser(sink.message.FromString,
                                                                     path)))
        self.accept_ahead = AcceptAhead(self.server, recording.methods, chain, accept_ahead)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME],
            self.server,
        )
        self.port = 0
        self._health_only: grpc.aio.Server | None = None

    async def start(self, host: str, port: int,
                    credentials: grpc.ServerCredentials | ssl.SSLContext | None) -> str:
        """Bind and start; returns the bound host:port (port 0 picks a free one). A native
        server takes TLS as an ssl.SSLContext (native_grpc.server.tls_context)."""
        address = f"{_bracket(host)}:{port}"
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)  # type: ignore[arg-type]
        if self.port == 0:
            raise RuntimeError(f"could not bind {address}")
        if isinstance(self.server, NativeServer):
            [self.port] = await self.server.bind()
        await self.server.start()
        await self.set_serving(False)
        return f"{_bracket(host)}:{self.port}"

    async def serve_health(self, host: str, port: int) -> str:
        """Also answer grpc.health.v1 (and nothing else) in plaintext on `port`, with this
        server's statuses: for probes that cannot present the mesh certificate (Kubernetes'
        native `grpc:` probes; service "liveness" answers SERVING until shutdown, "" and the
        services their readiness). Returns the bound host:port."""
        self._health_only = grpc.aio.server(
            interceptors=[ErrorInterceptor(), ParseInterceptor()], options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_only)
        address = f"{_bracket(host)}:{port}"
        bound = self._health_only.add_insecure_port(address)
        if bound == 0:
            raise RuntimeError(f"could not bind {address}")
        await self._health_only.start()
        await self.health.set(LIVENESS, SERVING)
        return f"{_bracket(host)}:{bound}"

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.names):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        self.accept_ahead.close()
        if self._health_only is not None:
            await self._health_only.stop(None)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def wait_for_signal() -> None:
    """Return on the first SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutdown_requested")
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(Exception):
            loop.remove_signal_handler(sig)
