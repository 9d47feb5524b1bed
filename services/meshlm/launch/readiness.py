"""Is a started service ready, and waiting until a batch of them is.

ReadinessProbe checks one ServiceProcess: its "listening" line, grpc.health.v1 SERVING on its
mesh port (mTLS) and, for a gateway, on its public ports. wait_until_ready() polls the probes of
a batch under one deadline and raises MeshStartError, with the tail of the failing service's log,
when one exits or the deadline passes. Used by mesh.py.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.logs import get_logger
from meshlm.launch.addresses import connectable
from meshlm.launch.certs import DevCerts
from meshlm.launch.process import ServiceProcess

log = get_logger(__name__)


class MeshStartError(RuntimeError):
    """A service did not become ready; the message ends with the tail of its log."""


def wait_until_ready(procs: list[ServiceProcess], certs: DevCerts, timeout: float,
                     stop_timeout: float, cancel: threading.Event | None = None) -> None:
    """Wait until every one of `procs` is ready (one deadline, `timeout` seconds, for all); if
    one exits, the deadline passes or `cancel` is set, stop them all (each given `stop_timeout`
    seconds) and raise MeshStartError."""
    deadline = time.monotonic() + timeout
    probes = {p.name: ReadinessProbe(p, certs) for p in procs}
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
                raise _failure(pending[0], f"not ready within {timeout}s",
                               probes[pending[0].name])
            if pending and cancel is not None and cancel.is_set():
                raise MeshStartError(f"start of {pending[0].name} cancelled")
            if pending:
                time.sleep(0.05)
    except BaseException:
        for p in procs:  # no half-started batch is left behind (restart, start_gateway)
            p.stop(stop_timeout)
        raise
    finally:
        for probe in probes.values():
            probe.close()


def _failure(proc: ServiceProcess, reason: str, probe: ReadinessProbe) -> MeshStartError:
    detail = f" (last check: {probe.last_error})" if probe.last_error else ""
    return MeshStartError(
        f"{proc.name} {reason}{detail}; last lines of {proc.log_path}:\n{proc.tail()}"
    )

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
            address = connectable(str(info["address"]))
            checks.append(("mesh health", address, _channel(address, self.certs.mesh_tls()
                                                             .channel_credentials())))
        if "grpc_address" in info:
            address = connectable(str(info["grpc_address"]))
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
            checks.append(("HTTP port", connectable(str(info["http_address"])), None))
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
