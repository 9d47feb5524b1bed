"""What every service shares: its base configuration and the process entry point."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import uvloop

from meshlm.common import config as cfg
from meshlm.common.announce import Announcer
from meshlm.common.logs import get_logger, setup_logging
from meshlm.common.memory import freeze_startup_objects
from meshlm.common.metrics import ServiceMetrics
from meshlm.common.metrics_server import MetricsServer
from meshlm.common.redis_client import RedisAuth
from meshlm.common.server import Binding, GrpcServer, is_native, wait_for_signal
from meshlm.common.streams import BatchedStream, StreamPool
from meshlm.common.tls import MeshTLS
from meshlm.common.tracing import setup_tracing, shutdown_tracing

log = get_logger(__name__)


@dataclass
class ServiceConfig:
    """Flags every mesh service takes (each also MESHLM_<NAME>)."""

    host: str = cfg.field("127.0.0.1", "address to bind the mesh gRPC port on")
    port: int = cfg.field(0, "mesh gRPC port (mutual TLS); 0 picks a free port")
    advertise_host: str = cfg.field("", "host other services use to reach this one "
                                        "(default: --host)")
    mesh_ca: str = cfg.field("", "CA certificate (PEM) that signs every mesh service")
    mesh_cert: str = cfg.field("", "this service's mesh certificate (PEM)")
    mesh_key: str = cfg.field("", "this service's mesh private key (PEM)")
    log_level: str = cfg.field("info", "debug | info | warning | error")
    shutdown_grace: float = cfg.field(5.0, "seconds in-flight calls get to finish on SIGTERM")
    metrics_port: int = cfg.field(0, "Prometheus GET /metrics on this port (plain HTTP, bound "
                                     "on --host); 0 = off")
    announce_redis_url: str = cfg.field("", "tokenizer, scheduler, detokenizer: announce this "
                                            "replica in this Redis (meshlm:members:<role>) for "
                                            "gateways started with --discover; empty = off")
    heartbeat_interval: float = cfg.field(1.0, "seconds between heartbeats in "
                                               "--announce-redis-url (an entry is stale after 3); "
                                               "on a gateway, between discovery polls")
    peer_tls_name: str = cfg.field("", "check every mesh peer's certificate against this name "
                                       "instead of its address; '{role}' becomes the peer's role "
                                       "(gateway, tokenizer, scheduler, detokenizer), e.g. "
                                       "'meshlm-{role}'; empty = the address's host")
    health_port: int = cfg.field(0, "also serve grpc.health.v1 alone, plaintext, on this port "
                                    "(Kubernetes' native grpc probes); 0 = off")
    redis_password: str = cfg.field("", "password for --redis-url / --announce-redis-url "
                                        "(prefer --redis-password-file)", secret=True)
    redis_password_file: str = cfg.field("", "file holding the Redis password")
    redis_ca: str = cfg.field("", "CA that a rediss:// server's certificate must chain to "
                                  "(default: --mesh-ca)")
    mesh_server: str = cfg.field("native", "what serves the mesh gRPC port: native (the "
                                           "service's own HTTP/2 on its event loop: a hop "
                                           "costs half the latency) or grpcio (grpc.aio)")
    mesh_streams: str = cfg.field("native", "what carries this service's batched streams to "
                                            "its peers: native (its own HTTP/2 client on its "
                                            "event loop) or grpcio (grpc.aio's channel, which "
                                            "unary calls always use)")
    event_loop: str = cfg.field("auto", "the event loop: uvloop, asyncio, or auto (uvloop, "
                                        "but asyncio's for the scheduler: its engine thread "
                                        "shares the GIL with the loop and gained nothing)")


C = TypeVar("C", bound=ServiceConfig)
T = TypeVar("T")

# Set by the launcher on a standby copy of a service (launch/process.py): the process imports
# its code, parses its flags, then waits for "start" on stdin before it runs.
START_GATE_ENV = "MESHLM_START_GATE"
STANDBY_READY = "standby_ready"  # the event a standby logs once it waits
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def run(role: str, config: C, main: Callable[[C], Coroutine[Any, Any, None]]) -> None:
    """Set up logging and tracing, log the configuration, run `main` until it returns. A
    standby copy waits for its launcher's word first, and ends quietly without it."""
    setup_logging(role, config.log_level)
    if not _started_by_launcher():
        return
    loop = event_loop(role, config.event_loop)
    setup_tracing(role)
    log.info("starting", config=cfg.as_dict(config))
    try:
        loop(main(config))
    except KeyboardInterrupt:
        pass
    finally:
        shutdown_tracing()
        log.info("stopped")


def event_loop(role: str, choice: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """What runs the service's main coroutine, by --event-loop. uvloop's loop costs less a
    wake-up and a socket read: about 1.5 µs of the gateway's CPU a streamed token and 0.2-0.8
    ms of a request's TTFT through the mesh (docs/operations.md)."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"--event-loop: {choice!r} is not one of {', '.join(EVENT_LOOPS)}")
    if choice == "uvloop" or (choice == "auto" and role != "scheduler"):
        return uvloop.run
    return asyncio.run


def _started_by_launcher() -> bool:
    """True at once unless this is a standby copy (START_GATE_ENV): then it says so in its
    log ("standby_ready", what the launcher waits for) and blocks until the launcher writes
    "start" to its stdin (True) or closes it (False: not needed after all). The variable is
    dropped, so nothing this service starts inherits it."""
    if os.environ.pop(START_GATE_ENV, "") != "stdin":
        return True
    log.info(STANDBY_READY)
    return sys.stdin.readline().strip() == "start"


def mesh_server(config: ServiceConfig, bindings: Sequence[Binding]) -> GrpcServer:
    """The service's mesh port, on the server --mesh-server names."""
    return GrpcServer(bindings, native=is_native(config.mesh_server, "--mesh-server"))


async def start_mesh_server(server: GrpcServer, config: ServiceConfig, tls: MeshTLS) -> str:
    """Bind the mesh port (--host, --port) with mutual TLS; returns the bound host:port."""
    credentials = tls.server_context() if server.native else tls.server_credentials()
    return await server.start(config.host, config.port, credentials)


def streams_tls(config: ServiceConfig, tls: MeshTLS) -> ssl.SSLContext | None:
    """The TLS of the native batched streams (--mesh-streams native), or None for grpc.aio's."""
    return tls.client_context() if is_native(config.mesh_streams, "--mesh-streams") else None


def advertised(config: ServiceConfig, bound: str) -> str:
    """The address to put in routes: --advertise-host (or the bind host) with the bound port.
    A wildcard bind host advertises the address this host's name resolves to (a container's or
    a pod's own IP), else loopback."""
    port = bound.rsplit(":", 1)[1]
    host = config.advertise_host or config.host
    if host in ("0.0.0.0", "::", "[::]"):
        host = own_address()
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def own_address() -> str:
    """The IP this host's name resolves to (/etc/hosts in a container or pod), else loopback."""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
    return address


def resolve_model_path(model_path: str) -> str:
    """The checkpoint directory to serve: the given one, or the embedded default model."""
    if model_path:
        return model_path
    from meshlm.common.default_model import ensure_default_model

    return str(ensure_default_model())


def model_info_json(model_path: str, extra: dict[str, object]) -> str:
    """config.json of the checkpoint plus serving facts, as one JSON string."""
    import json
    from pathlib import Path

    info: dict[str, object] = {}
    config_file = Path(model_path) / "config.json"
    if config_file.exists():
        info["config"] = json.loads(config_file.read_text())
    info.update(extra)
    return json.dumps(info, default=str)


class MeshPeers:
    """This service's side of the mesh: mTLS credentials, one channel per peer address, and
    pools of batched streams to peers whose addresses arrive in-band."""

    def __init__(self, config: ServiceConfig) -> None:
        from meshlm.common.channels import ChannelPool
        from meshlm.common.tls import MeshTLS

        self.tls = MeshTLS(config.mesh_ca, config.mesh_cert, config.mesh_key)
        self.channels = ChannelPool(self.tls.channel_credentials(), config.peer_tls_name,
                                    streams_tls(config, self.tls))
        self._pools: list[StreamPool[Any]] = []

    def stream_pool(self, name: str, role: str, open_call: Callable[[Any], Any],
                    make_batch: Callable[[list[T]], Any],
                    on_lost: Callable[[str], None] | None = None,
                    weight: Callable[[T], int] | None = None,
                    write_through: bool = False) -> StreamPool[T]:
        """Streams `name` to any `role` peer's address: `open_call(channel)` gives the RPC to
        call (e.g. `lambda ch: DetokenizerStub(ch).Push`), `make_batch(items)` the message,
        `on_lost(address)` runs after a call to that peer failed, `weight(item)` what an item
        counts against the queue's bounds, `write_through` for a producer that puts once per
        step (see BatchedStream)."""
        def open_stream(address: str) -> BatchedStream[T]:
            self.channels.for_role(role, address)  # names the peer
            channel = self.channels.stream_channel(address)
            return BatchedStream(name, address, open_call(channel), make_batch,
                                 ready=channel.channel_ready, on_lost=on_lost, weight=weight,
                                 write_through=write_through)

        pool: StreamPool[T] = StreamPool(open_stream)
        self._pools.append(pool)
        return pool

    async def close(self) -> None:
        for pool in self._pools:
            await pool.close()
        await self.channels.close()


async def start_metrics(config: ServiceConfig, metrics: ServiceMetrics) -> MetricsServer | None:
    """Serve `metrics` on --metrics-port, if set."""
    if not config.metrics_port:
        return None
    exporter = MetricsServer(metrics)
    await exporter.start(config.host, config.metrics_port)
    return exporter


async def serve_until_signal(server: GrpcServer, config: ServiceConfig, bound: str,
                             watch: asyncio.Task[Any] | None = None,
                             metrics: ServiceMetrics | None = None, *, role: str = "",
                             on_stop: Callable[[], None] | None = None,
                             **fields: Any) -> None:
    """Serve `metrics` on --metrics-port (if set), freeze the start-up's objects out of the
    collector's reach (common/memory.py), mark SERVING, log `listening`, announce this
    `role` replica in Redis (with --announce-redis-url), run until SIGTERM/SIGINT (or until
    `watch` ends), then call `on_stop` (whatever else sets health stops: e.g. the scheduler's
    watchdog), leave Redis, NOT_SERVING and a graceful stop."""
    exporter = await start_metrics(config, metrics) if metrics is not None else None
    if exporter is not None:
        fields["metrics_address"] = advertised(config, exporter.address)
    if config.health_port:
        fields["health_address"] = await server.serve_health(config.host, config.health_port)
    freeze_startup_objects()
    await server.set_serving(True)
    log.info("listening", address=advertised(config, bound), **fields)
    announcer = None
    if config.announce_redis_url and role:
        announcer = Announcer(config.announce_redis_url, role, advertised(config, bound),
                              config.heartbeat_interval, RedisAuth.from_config(config))
        announcer.start()
    waiter = asyncio.create_task(wait_for_signal())
    tasks: set[asyncio.Task[Any]] = {waiter} | ({watch} if watch is not None else set())
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    if watch is not None and watch in done:
        log.error("task_stopped", task=watch.get_name(), error=repr(watch.exception()))
    waiter.cancel()
    if on_stop is not None:
        on_stop()
    if announcer is not None:
        await announcer.leave()  # gateways drop it before it stops serving
    await server.set_serving(False)
    await server.stop(config.shutdown_grace)
    if exporter is not None:
        await exporter.stop()
