"""Mesh: start, watch and stop the whole service mesh as child processes (tests, bench, make run).

    with Mesh(MeshOptions(workdir=tmp_path, http_port=0, grpc_port=0)) as mesh:
        channel = grpc.insecure_channel(mesh.gateway_grpc)

Start order: dev certificates, the default model, redis (unless a URL is given), then the
tokenizer, scheduler and detokenizer side by side, then the gateway pointed at their addresses.
A service is ready once it has logged its "listening" line and grpc.health.v1 answers SERVING
for "" (over mTLS on mesh ports). Every child's stdout and stderr go to
<workdir>/logs/<name>.log; a failed start stops everything and raises MeshStartError with the
tail of the failing service's log. Children die with the launcher, even when it is SIGKILLed.

With `discover` the backends announce themselves in the mesh's Redis and the gateways find
them there (no static lists), so `start_backend` can add a replica to a running mesh.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from meshlm.common.logs import get_logger
from meshlm.common.service import START_GATE_ENV
from meshlm.launch.addresses import WILDCARD_HOSTS, free_port
from meshlm.launch.certs import DevCerts, ensure_dev_certs
from meshlm.launch.mesh_secrets import ensure_redis_password
from meshlm.launch.process import ServiceProcess
from meshlm.launch.readiness import wait_until_ready
from meshlm.launch.redis_server import RedisServer

log = get_logger(__name__)

BACKENDS = ("tokenizer", "scheduler", "detokenizer")
API_KEY_ENV = "MESHLM_API_KEY"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class MeshOptions:
    """How to run the mesh. Ports: 0 picks a free one (tests use 0 everywhere)."""

    workdir: Path                 # certs/ and logs/<name>.log
    model_path: str = ""          # "" = the embedded default model
    host: str = "127.0.0.1"       # every service binds here
    http_port: int = 30000        # gateway HTTP
    grpc_port: int = 40000        # gateway public gRPC
    redis_url: str = ""           # "" = start a RedisServer
    gateway_tls: bool = False     # public TLS with the dev server certificate
    tls_cert: str = ""            # public TLS with this certificate instead (implies TLS)
    tls_key: str = ""
    log_level: str = "info"
    echo_logs: bool = False       # also copy every child's log lines to this process's stderr
    env: dict[str, str] = field(default_factory=dict)  # extra env for every service
    api_keys: tuple[str, ...] = ()  # the gateways' API keys (in their environment, not argv)
    metrics_port: int | None = None  # None: no metrics ports; 0: free ones; N: gateway N,
                                     # tokenizer N+1, scheduler N+2, detokenizer N+3
    startup_timeout: float = 120.0
    stop_timeout: float = 10.0    # per stage (gateways, then backends) before SIGKILL
    replicas: dict[str, int] = field(default_factory=dict)  # per role ("gateway" too); 1 each
                                  # by default. Names: "scheduler", "scheduler-1", ...
    discover: bool = False        # backends announce in Redis (--announce-redis-url), gateways
                                  # find them there (--discover) instead of static lists
    heartbeat_interval: float = 1.0  # seconds between heartbeats and discovery polls
    sans: tuple[str, ...] = ()    # more names / IPs for the mesh certificate (replicas bound
                                  # on other loopback IPs, DNS names gateways resolve)

    def count(self, role: str) -> int:
        return max(1, self.replicas.get(role, 1))


def replica_name(role: str, index: int) -> str:
    return role if index == 0 else f"{role}-{index}"


@dataclass(frozen=True)
class MeshAddresses:
    """host:port of each service's mesh port (mTLS), the gateway's public ports, and more."""

    tokenizer: str
    scheduler: str
    detokenizer: str
    gateway_grpc: str   # public gRPC host:port (plaintext unless gateway TLS)
    gateway_http: str   # base URL, "http://127.0.0.1:30000" (https with gateway TLS)
    gateway_inbox: str  # the gateway's internal (mTLS) port
    redis_url: str
    certs: DevCerts


class Mesh:
    """Supervisor for one mesh: start, kill/restart single services, stop everything."""

    def __init__(self, options: MeshOptions) -> None:
        self.options = options
        self.workdir = Path(options.workdir).absolute()
        self.certs: DevCerts = DevCerts(self.workdir / "certs")
        self.redis: RedisServer | None = None
        self.services: dict[str, ServiceProcess] = {}
        self._redis_url = options.redis_url
        self._redis_password_file: Path | None = None
        self._registered = False

    @property
    def addresses(self) -> MeshAddresses:
        """Where everything listens (valid once start() has returned)."""
        gateway = self.service("gateway")
        return MeshAddresses(
            tokenizer=self.service("tokenizer").address,
            scheduler=self.service("scheduler").address,
            detokenizer=self.service("detokenizer").address,
            gateway_grpc=gateway.grpc_address,
            gateway_http=gateway.http_address,
            gateway_inbox=gateway.address,
            redis_url=self._redis_url,
            certs=self.certs,
        )

    def replicas(self, role: str) -> list[ServiceProcess]:
        """Every service of a role, in start order."""
        return [p for p in self.services.values() if p.role == role]

    def service(self, name: str) -> ServiceProcess:
        try:
            return self.services[name]
        except KeyError:
            raise KeyError(f"no service {name!r} (have {sorted(self.services)})") from None

    def log_path(self, name: str) -> Path:
        if name == "redis" and self.redis is not None:
            return self.redis.log_path
        return self.workdir / "logs" / f"{name}.log"

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start everything and wait until it is ready; on failure stop all and raise."""
        o = self.options
        self.services = {}
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.certs = ensure_dev_certs(self.workdir / "certs", [*_extra_sans(o.host), *o.sans])
        if not o.model_path:
            _ensure_default_model(o.env.get("MESHLM_CACHE_DIR") or os.environ.get(
                "MESHLM_CACHE_DIR"))
        if not self._registered:
            atexit.register(self.stop)
            self._registered = True
        try:
            if not self._redis_url:
                # A generated password, handed to the services as a file (never a flag value).
                self._redis_password_file = ensure_redis_password(self.workdir / "redis")
                self.redis = RedisServer(
                    log_path=self.log_path("redis"),
                    password=self._redis_password_file.read_text().strip()).start()
                self._redis_url = self.redis.url
            backends = [self._add(replica_name(role, i), self._backend_flags(role), role=role)
                        for role in BACKENDS for i in range(o.count(role))]
            self._launch(backends)
            # The gateway reads --grpc-port 0 as "HTTP port + 10000" (or free with --http-port 0).
            grpc_port = o.grpc_port or (free_port(o.host) if o.http_port else 0)
            gateways = [self._add("gateway", self._gateway_flags(
                o.http_port, grpc_port, public_tls=self._public_tls()))]
            gateways += [self._add(replica_name("gateway", i), self._gateway_flags(
                0, 0, public_tls=self._public_tls()), role="gateway")
                for i in range(1, o.count("gateway"))]
            self._launch(gateways)
        except BaseException:
            self.stop()
            raise
        gateway = self.service("gateway")
        log.info("mesh_ready", http=gateway.http_address, grpc=gateway.grpc_address,
                 redis=self._redis_url, workdir=str(self.workdir))

    def stop(self) -> None:
        """SIGTERM the gateways, then the backends, then redis; SIGKILL whatever outlives
        `stop_timeout`. Idempotent; also runs at interpreter exit."""
        timeout = self.options.stop_timeout
        gateways = [p for p in self.services.values() if p.role == "gateway"]
        backends = [p for p in self.services.values() if p not in gateways]
        for stage in (gateways, backends):
            for p in stage:
                p.discard_standby()
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for p in stage:
                p.stop(max(0.0, deadline - time.monotonic()), signalled=True)
        if self.redis is not None:
            self.redis.stop()
        if self._registered:
            atexit.unregister(self.stop)
            self._registered = False

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one service (or "redis"); SIGKILL hits its whole process group and waits."""
        if name == "redis":
            assert self.redis is not None, "redis was not started by this mesh"
            self.redis.kill(sig)
            return
        self.service(name).kill(sig)

    def restart(self, name: str) -> None:
        """Stop the service if it still runs, start it on the same port(s), wait for SERVING."""
        if name == "redis":
            assert self.redis is not None, "redis was not started by this mesh"
            self.redis.restart()
            return
        self.wait_ready(self.respawn(name))

    def respawn(self, name: str) -> ServiceProcess:
        """Stop the service if it still runs and start it again on the same port(s), its log
        appended to; does not wait (see wait_ready)."""
        proc = self.service(name)
        proc.stop(self.options.stop_timeout)
        proc.pin_ports()
        self._spawn([proc], append_log=True)
        return proc

    def wait_ready(self, *procs: ServiceProcess, cancel: threading.Event | None = None) -> None:
        """Wait until every one of `procs` is ready (one deadline for all); if one exits, the
        deadline passes or `cancel` is set, stop them all and raise MeshStartError."""
        wait_until_ready(list(procs), self.certs, self.options.startup_timeout,
                         self.options.stop_timeout, cancel)

    def start_gateway(self, name: str, tls: bool = False, switches: tuple[str, ...] = (),
                      **flags: Any) -> ServiceProcess:
        """Another gateway over the same backends and redis, on free ports unless `flags` say
        otherwise; waits until it is ready. `tls` serves its public ports with the mesh's public
        certificate (the dev server.pem unless MeshOptions.tls_cert); `flags` are gateway flags
        with underscores (tls_client_ca=..., http_port=...) and win over both; `switches` are
        on/off flags to turn on (trust_request_chat_template), set by their environment
        variables."""
        if name in self.services:
            raise ValueError(f"service {name!r} already exists")
        values = self._gateway_flags(0, 0, public_tls=tls)
        values.update({k.replace("_", "-"): str(v) for k, v in flags.items()})
        proc = self._add(name, values, role="gateway")
        proc.env.update({f"MESHLM_{switch.upper()}": "true" for switch in switches})
        self._launch([proc])
        return proc

    def start_backend(self, role: str, name: str = "", **flags: Any) -> ServiceProcess:
        """Another tokenizer, scheduler or detokenizer (named `<role>-<n>` unless `name`),
        configured as the mesh's own (it announces itself with `discover`); waits until it is
        SERVING. `flags` are its flags with underscores (host=..., port=...) and win."""
        if role not in BACKENDS:
            raise ValueError(f"not a backend role: {role!r}")
        index = len(self.replicas(role))
        while not name or name in self.services:
            name, index = replica_name(role, index), index + 1
        values = self._backend_flags(role)
        values.update({k.replace("_", "-"): str(v) for k, v in flags.items()})
        proc = self._add(name, values, role=role)
        self._launch([proc])
        return proc

    def exited(self) -> dict[str, int]:
        """Services (and the mesh's own redis, as "redis") whose process has exited, with their
        exit codes."""
        dead = {n: p.returncode for n, p in self.services.items() if p.returncode is not None}
        if self.redis is not None and self.redis.returncode is not None:
            dead["redis"] = self.redis.returncode
        return dead

    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- internals ---------------------------------------------------------------------------

    def _add(self, name: str, flags: dict[str, str], role: str = "") -> ServiceProcess:
        env = {**os.environ, **self.options.env, "PYTHONUNBUFFERED": "1"}
        env.pop(START_GATE_ENV, None)  # set on standbys only (process.py)
        # API keys (options, else an inherited MESHLM_API_KEY) go to gateways only, and by
        # environment: argv is readable by every user (ps).
        keys = ",".join(self.options.api_keys) or env.pop(API_KEY_ENV, "")
        env.pop(API_KEY_ENV, None)
        if (role or name) == "gateway" and keys:
            env[API_KEY_ENV] = keys
        if (role or name) == "gateway":  # a switch, not a flag with a value
            env["MESHLM_DISCOVER"] = "true" if self.options.discover else "false"
        proc = ServiceProcess(
            name, role or name, flags, env, self.log_path(name),
            echo=self.options.echo_logs,
        )
        self.services[name] = proc
        return proc

    def _common_flags(self, role: str) -> dict[str, str]:
        return {
            "host": self.options.host,
            "port": "0",
            "mesh-ca": str(self.certs.ca_cert),
            "mesh-cert": str(self.certs.mesh_cert),
            "mesh-key": str(self.certs.mesh_key),
            "log-level": self.options.log_level,
            "metrics-port": str(self._metrics_port(role)),
            "heartbeat-interval": str(self.options.heartbeat_interval),
            "redis-password-file": str(self._redis_password_file or ""),
        }

    def _metrics_port(self, role: str) -> int:
        base = self.options.metrics_port
        if base is None:
            return 0  # off (explicitly: an inherited MESHLM_METRICS_PORT would collide)
        if base == 0 or self.replicas(role):
            return free_port(self.options.host)  # extra replicas take free ports
        return base + ("gateway", *BACKENDS).index(role)

    def _backend_flags(self, name: str) -> dict[str, str]:
        flags = {**self._common_flags(name), "model-path": self.options.model_path,
                 "announce-redis-url": self._redis_url if self.options.discover else ""}
        schedulers = self.options.count("scheduler")
        if name == "scheduler" and schedulers > 1 and "MESHLM_CPUS" not in {
                **os.environ, **self.options.env}:
            # Each scheduler sizes its engine threads to its share of the cores it measures
            # (scheduler/cpus.py); several on one machine split the cores between them.
            cores = len(os.sched_getaffinity(0))
            flags["cpus"] = f"{max(1.0, cores / schedulers):g}"
        return flags

    def _gateway_flags(self, http_port: int, grpc_port: int, public_tls: bool) -> dict[str, str]:
        o = self.options
        cert, key = (o.tls_cert, o.tls_key) if o.tls_cert else (
            str(self.certs.server_cert), str(self.certs.server_key))

        def static(role: str) -> str:
            return "" if o.discover else ",".join(p.address for p in self.replicas(role))

        return {
            **self._common_flags("gateway"),
            "public-host": o.host,
            "http-port": str(http_port),
            "grpc-port": str(grpc_port),
            "tls-cert": cert if public_tls else "",
            "tls-key": key if public_tls else "",
            "tokenizers": static("tokenizer"),
            "schedulers": static("scheduler"),
            "detokenizers": static("detokenizer"),
            "redis-url": self._redis_url,
        }

    def _public_tls(self) -> bool:
        return self.options.gateway_tls or bool(self.options.tls_cert)

    def _launch(self, procs: list[ServiceProcess], append_log: bool = False) -> None:
        """Start `procs` together and wait until all are ready (one deadline for all)."""
        self._spawn(procs, append_log)
        wait_until_ready(procs, self.certs, self.options.startup_timeout,
                         self.options.stop_timeout)

    def _spawn(self, procs: list[ServiceProcess], append_log: bool = False) -> None:
        for p in procs:
            p.start(append_log=append_log)
            log.info("service_started", name=p.name, pid=p.pid, log=str(p.log_path))


def _extra_sans(host: str) -> list[str]:
    """SANs the mesh certificate needs beyond loopback for services bound to `host`."""
    if host in _LOOPBACK:
        return []
    if host in WILDCARD_HOSTS:
        return [socket.gethostname()]
    return [host]


def _ensure_default_model(cache_dir: str | None) -> None:
    """Create the embedded default model once, before the services race to (it is atomic)."""
    try:
        from meshlm.common.default_model import ensure_default_model
    except ModuleNotFoundError as e:
        if e.name != "meshlm.common.default_model":
            raise
        log.warning("default_model_unavailable")
        return
    path = ensure_default_model(cache_dir)
    log.info("default_model", path=str(path))
