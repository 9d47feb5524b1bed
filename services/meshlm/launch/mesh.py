"""Mesh: start, watch and stop the whole service mesh as child processes (tests, bench, make run).

    with Mesh(MeshOptions(workdir=tmp_path, http_port=0, grpc_port=0)) as mesh:
        channel = grpc.insecure_channel(mesh.gateway_grpc)

Start order: dev certificates, the default model, redis (unless a URL is given), then the
tokenizer, scheduler and detokenizer side by side, then the gateway pointed at their addresses.
A service is ready once it has logged its "listening" line and grpc.health.v1 answers SERVING
for "" (over mTLS on mesh ports). Every child's stdout and stderr go to
<workdir>/logs/<name>.log; a failed start stops everything and raises MeshStartError with the
tail of the failing service's log. Children die with the launcher, even when it is SIGKILLed.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.logs import get_logger
from meshlm.launch.certs import DevCerts, ensure_dev_certs
from meshlm.launch.redis_server import (
    RedisServer,
    exit_status,
    free_port,
    kill_group,
    spawn,
    terminate,
)

log = get_logger(__name__)

BACKENDS = ("tokenizer", "scheduler", "detokenizer")
_LOOPBACK = ("127.0.0.1", "::1", "localhost")
_WILDCARD = ("0.0.0.0", "::", "[::]", "")


class MeshStartError(RuntimeError):
    """A service did not become ready; the message ends with the tail of its log."""


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
    startup_timeout: float = 120.0
    stop_timeout: float = 10.0    # per stage (gateways, then backends) before SIGKILL


class ServiceProcess:
    """One service child: its command line, its log file, and what its "listening" line said.

    A reader thread copies every output line to the log file and picks out the first JSON line
    with "event": "listening" (its "address", and for a gateway "grpc_address" and
    "http_address"). Addresses are returned connectable: a wildcard host becomes 127.0.0.1.
    """

    def __init__(
        self, name: str, role: str, flags: dict[str, str], env: dict[str, str],
        log_path: Path, echo: bool = False,
    ) -> None:
        self.name = name
        self.role = role  # tokenizer | scheduler | detokenizer | gateway
        self.module = f"meshlm.{role}"
        self.flags = flags  # without the leading "--"; passed in this order
        self.env = env
        self.log_path = log_path
        self.echo = echo
        self.proc: subprocess.Popen[bytes] | None = None
        self.listening: dict[str, Any] | None = None
        self.started_at = 0.0
        self._reader: threading.Thread | None = None

    @property
    def args(self) -> list[str]:
        flags = [a for k, v in self.flags.items() for a in (f"--{k}", v)]
        return [sys.executable, "-m", self.module, *flags]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        """None while running (or never started); the exit code (-signal) once exited."""
        return exit_status(self.proc) if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.returncode is None

    @property
    def address(self) -> str:
        """Its mesh (mTLS) host:port; for a gateway, its internal inbox."""
        return self._address("address")

    @property
    def grpc_address(self) -> str:
        """A gateway's public gRPC host:port."""
        return self._address("grpc_address")

    @property
    def http_address(self) -> str:
        """A gateway's HTTP base URL, e.g. "http://127.0.0.1:30000"."""
        raw = str((self.listening or {}).get("http_address", ""))
        scheme = raw.split("://", 1)[0] if "://" in raw else "http"
        return f"{scheme}://{self._address('http_address')}"

    def start(self, append_log: bool = False) -> None:
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.listening = None
        out = open(self.log_path, "ab" if append_log else "wb")  # noqa: SIM115 - reader closes
        try:
            self.proc = spawn(self.args, env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        except BaseException:
            out.close()
            raise
        self.started_at = time.monotonic()
        self._reader = threading.Thread(
            target=self._read, args=(self.proc, out), name=f"meshlm-log-{self.name}", daemon=True
        )
        self._reader.start()

    def send_signal(self, sig: int) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig`; SIGKILL goes to the whole process group and waits until it is gone."""
        if self.proc is None:
            return
        if sig != signal.SIGKILL:
            self.send_signal(sig)
            return
        kill_group(self.proc)
        self.proc.wait()
        self._join_reader()

    def stop(self, timeout: float, signalled: bool = False) -> None:
        """SIGTERM (unless already sent), SIGKILL after `timeout`; reaps it. Idempotent."""
        if self.proc is not None and self.proc.returncode is None:
            code = terminate(self.proc, timeout, signalled)
            log.info("service_stopped", name=self.name, code=code)
        self._join_reader()

    def pin_ports(self) -> None:
        """Make the next start bind the ports this run got (restart on the same addresses)."""
        info = self.listening or {}
        for key, flag in (("address", "port"), ("grpc_address", "grpc-port"),
                          ("http_address", "http-port")):
            if key in info:
                self.flags[flag] = _connectable(str(info[key])).rsplit(":", 1)[1]

    def tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _address(self, key: str) -> str:
        if not self.listening or key not in self.listening:
            raise RuntimeError(f"{self.name} has not reported its {key} (not ready?)")
        return _connectable(str(self.listening[key]))

    def _read(self, proc: subprocess.Popen[bytes], out: IO[bytes]) -> None:
        assert proc.stdout is not None
        with out:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                if self.echo:
                    sys.stderr.buffer.write(line)
                    sys.stderr.flush()
                if self.listening is None and proc is self.proc:
                    self.listening = _listening_event(line)
        proc.stdout.close()

    def _join_reader(self) -> None:
        # Output still buffered in the pipe is drained; a grandchild holding it open is not
        # waited for beyond a moment.
        if self._reader is not None:
            self._reader.join(timeout=2.0)
            self._reader = None


class ReadinessProbe:
    """Is a started service ready? Its "listening" line is in, grpc.health.v1 answers SERVING
    on its mesh port (mTLS) and, for a gateway, on its public gRPC port (plaintext, or TLS with
    the dev CA), and a gateway's HTTP port accepts connections. Checks that pass stay passed."""

    def __init__(self, proc: ServiceProcess, certs: DevCerts) -> None:
        self.proc = proc
        self.certs = certs
        self.last_error = ""
        self._pending: list[tuple[str, str, grpc.Channel | None]] | None = None

    def ready(self, timeout: float) -> bool:
        info = self.proc.listening
        if info is None:
            self.last_error = 'no "listening" line yet'
            return False
        if self._pending is None:
            self._pending = self._checks(info)
        while self._pending:
            label, address, channel = self._pending[0]
            ok = self._serving(channel, timeout) if channel else _accepts(address, timeout)
            if not ok:
                self.last_error = f"{label} {address}: {self.last_error or 'not accepting'}"
                return False
            self.last_error = ""
            if channel is not None:
                channel.close()
            self._pending.pop(0)
        return True

    def close(self) -> None:
        for _, _, channel in self._pending or []:
            if channel is not None:
                channel.close()
        self._pending = []

    def _checks(self, info: dict[str, Any]) -> list[tuple[str, str, grpc.Channel | None]]:
        checks: list[tuple[str, str, grpc.Channel | None]] = []
        if "address" in info:
            address = _connectable(str(info["address"]))
            checks.append(("mesh health", address, _channel(address, self.certs.mesh_tls()
                                                             .channel_credentials())))
        if "grpc_address" in info:
            address = _connectable(str(info["grpc_address"]))
            cert = self.proc.flags.get("tls-cert", "")
            verifiable = not self.proc.flags.get("tls-client-ca") and (
                not cert or cert == str(self.certs.server_cert))
            if verifiable:
                ca = self.certs.ca_cert.read_bytes()
                creds = grpc.ssl_channel_credentials(ca) if cert else None
                checks.append(("public health", address, _channel(address, creds)))
            else:  # a certificate we cannot verify, or client certs required: connect only
                checks.append(("public gRPC port", address, None))
        if "http_address" in info:
            checks.append(("HTTP port", _connectable(str(info["http_address"])), None))
        return checks

    def _serving(self, channel: grpc.Channel, timeout: float) -> bool:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            self.last_error = f"{e.code().name}: {e.details()}"
            return False
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            self.last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return False
        return True


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
        self.certs = ensure_dev_certs(self.workdir / "certs", _extra_sans(o.host))
        if not o.model_path:
            _ensure_default_model(o.env.get("MESHLM_CACHE_DIR") or os.environ.get(
                "MESHLM_CACHE_DIR"))
        if not self._registered:
            atexit.register(self.stop)
            self._registered = True
        try:
            if not self._redis_url:
                self.redis = RedisServer(log_path=self.log_path("redis")).start()
                self._redis_url = self.redis.url
            backends = [self._add(name, self._backend_flags(name)) for name in BACKENDS]
            self._launch(backends)
            # The gateway reads --grpc-port 0 as "HTTP port + 10000" (or free with --http-port 0).
            grpc_port = o.grpc_port or (free_port(o.host) if o.http_port else 0)
            gateway = self._add("gateway", self._gateway_flags(
                o.http_port, grpc_port, public_tls=self._public_tls()))
            self._launch([gateway])
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
        proc = self.service(name)
        proc.stop(self.options.stop_timeout)
        proc.pin_ports()
        self._launch([proc], append_log=True)

    def start_gateway(self, name: str, tls: bool = False, **flags: Any) -> ServiceProcess:
        """Another gateway over the same backends and redis, on free ports unless `flags` say
        otherwise; waits until it is ready. `tls` serves its public ports with the mesh's public
        certificate (the dev server.pem unless MeshOptions.tls_cert); `flags` are gateway flags
        with underscores (tls_client_ca=..., http_port=...) and win over both."""
        if name in self.services:
            raise ValueError(f"service {name!r} already exists")
        values = self._gateway_flags(0, 0, public_tls=tls)
        values.update({k.replace("_", "-"): str(v) for k, v in flags.items()})
        proc = self._add(name, values, role="gateway")
        self._launch([proc])
        return proc

    def exited(self) -> dict[str, int]:
        """Services whose process has exited, with their exit codes."""
        return {n: p.returncode for n, p in self.services.items() if p.returncode is not None}

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
        proc = ServiceProcess(
            name, role or name, flags, env, self.log_path(name),
            echo=self.options.echo_logs,
        )
        self.services[name] = proc
        return proc

    def _common_flags(self) -> dict[str, str]:
        return {
            "host": self.options.host,
            "port": "0",
            "mesh-ca": str(self.certs.ca_cert),
            "mesh-cert": str(self.certs.mesh_cert),
            "mesh-key": str(self.certs.mesh_key),
            "log-level": self.options.log_level,
        }

    def _backend_flags(self, name: str) -> dict[str, str]:
        return {**self._common_flags(), "model-path": self.options.model_path}

    def _gateway_flags(self, http_port: int, grpc_port: int, public_tls: bool) -> dict[str, str]:
        o = self.options
        cert, key = (o.tls_cert, o.tls_key) if o.tls_cert else (
            str(self.certs.server_cert), str(self.certs.server_key))
        return {
            **self._common_flags(),
            "public-host": o.host,
            "http-port": str(http_port),
            "grpc-port": str(grpc_port),
            "tls-cert": cert if public_tls else "",
            "tls-key": key if public_tls else "",
            "tokenizers": self.service("tokenizer").address,
            "schedulers": self.service("scheduler").address,
            "detokenizers": self.service("detokenizer").address,
            "redis-url": self._redis_url,
        }

    def _public_tls(self) -> bool:
        return self.options.gateway_tls or bool(self.options.tls_cert)

    def _launch(self, procs: list[ServiceProcess], append_log: bool = False) -> None:
        """Start `procs` together and wait until all are ready (one deadline for all)."""
        for p in procs:
            p.start(append_log=append_log)
            log.info("service_started", name=p.name, pid=p.pid, log=str(p.log_path))
        deadline = time.monotonic() + self.options.startup_timeout
        probes = {p.name: ReadinessProbe(p, self.certs) for p in procs}
        pending = list(procs)
        try:
            while pending:
                for p in list(pending):
                    if p.returncode is not None:
                        p.stop(0)  # reap it and let the reader finish the log
                        raise _failure(p, f"exited with code {p.returncode} during start-up",
                                       probes[p.name])
                    remaining = deadline - time.monotonic()
                    if probes[p.name].ready(timeout=max(0.1, min(1.0, remaining))):
                        pending.remove(p)
                        log.info("service_ready", name=p.name, address=p.address,
                                 seconds=round(time.monotonic() - p.started_at, 3))
                if pending and time.monotonic() >= deadline:
                    raise _failure(pending[0], f"not ready within {self.options.startup_timeout}s",
                                   probes[pending[0].name])
                if pending:
                    time.sleep(0.05)
        except BaseException:
            for p in procs:  # no half-started batch is left behind (restart, start_gateway)
                p.stop(self.options.stop_timeout)
            raise
        finally:
            for probe in probes.values():
                probe.close()


def _failure(proc: ServiceProcess, reason: str, probe: ReadinessProbe) -> MeshStartError:
    detail = f" (last check: {probe.last_error})" if probe.last_error else ""
    return MeshStartError(
        f"{proc.name} {reason}{detail}; last lines of {proc.log_path}:\n{proc.tail()}"
    )


_PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.enable_retries", 0),
]


def _channel(address: str, creds: grpc.ChannelCredentials | None) -> grpc.Channel:
    if creds is None:
        return grpc.insecure_channel(address, options=_PROBE_OPTIONS)
    return grpc.secure_channel(address, creds, options=_PROBE_OPTIONS)


def _accepts(address: str, timeout: float) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _connectable(address: str) -> str:
    """host:port to dial: no scheme, a wildcard bind host becomes loopback, IPv6 bracketed."""
    host, port = address.split("://", 1)[-1].rstrip("/").rsplit(":", 1)
    host = host.strip("[]")
    if host in _WILDCARD:
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listening_event(line: bytes) -> dict[str, Any] | None:
    """The parsed line if it is the JSON "listening" event, else None (non-JSON is fine)."""
    if b"listening" not in line or not line.lstrip().startswith(b"{"):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and event.get("event") == "listening" else None


def _extra_sans(host: str) -> list[str]:
    """SANs the mesh certificate needs beyond loopback for services bound to `host`."""
    if host in _LOOPBACK:
        return []
    if host in _WILDCARD:
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
