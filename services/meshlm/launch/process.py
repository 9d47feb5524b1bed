"""Child processes: spawning and stopping them, and one service child of the mesh.

spawn() starts a child in its own session that dies with the launcher (PR_SET_PDEATHSIG on
Linux); terminate() and kill_group() stop it and whatever is left of its process group.
ServiceProcess runs one meshlm service (its log file, its "listening" line) and ReadinessProbe
says when it answers grpc.health.v1. Used by mesh.py and redis_server.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.logs import get_logger
from meshlm.launch.certs import DevCerts

log = get_logger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")  # bind hosts that mean "every interface"

# --- spawning and stopping children ----------------------------------------------------------

# Runs between fork and the real program: PR_SET_PDEATHSIG survives execve, so the child is
# SIGKILLed when the launcher dies, even by SIGKILL. A shim instead of preexec_fn keeps
# subprocess on its vfork path: no Python code between fork and exec in a threaded launcher,
# and no gRPC fork handlers ("Other threads are currently calling into gRPC ...").
_SHIM = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the launcher died before prctl took effect
os.execvp(sys.argv[2], sys.argv[2:])
"""
_LINUX = sys.platform.startswith("linux")


class _Spawner:
    """Starts children from one long-lived daemon thread.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: a
    child started from a short-lived thread (asyncio.to_thread, a test helper thread) would be
    killed when that thread ends. Daemon threads live until the process exits.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[list[str], dict[str, Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="meshlm-spawner",
                                                daemon=True)
                self._thread.start()
        done: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((args, kwargs, done))
        return done.result()

    def _run(self) -> None:
        while True:
            args, kwargs, done = self._jobs.get()
            try:
                done.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as e:  # handed to the caller
                done.set_exception(e)


_spawner = _Spawner()


def spawn(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a child in its own session (Ctrl-C at the terminal reaches only the launcher, which
    stops children in order) that dies with the launcher (PR_SET_PDEATHSIG on Linux).

    Call from any thread: the fork happens on a long-lived daemon thread (see _Spawner)."""
    if _LINUX:
        args = [sys.executable, "-S", "-c", _SHIM, str(os.getpid()), *args]
    return _spawner.popen(
        args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        start_new_session=True,
    )


def terminate(proc: subprocess.Popen[bytes], timeout: float, signalled: bool = False) -> int:
    """SIGTERM (unless `signalled`: a second SIGTERM can kill a process mid-shutdown), wait up
    to `timeout` seconds for it to exit, then SIGKILL what is left of its process group
    (stragglers, helpers it started) and reap it. Returns the exit code."""
    if proc.returncode is None:
        if not signalled:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        if not wait_exited(proc, timeout):
            log.warning("kill_straggler", pid=proc.pid, timeout=timeout)
    kill_group(proc)
    return proc.wait()


def wait_exited(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait for the child to exit without reaping it: while it is a zombie its pid (and so its
    process-group id) cannot be reused, which makes a following kill_group safe."""
    deadline = time.monotonic() + timeout
    while exit_status(proc) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def exit_status(proc: subprocess.Popen[bytes]) -> int | None:
    """The exit code (-signal if killed) once the child has exited, else None; like poll()
    but leaves it unreaped, so `terminate` can still clean up its process group."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    except ChildProcessError:
        return proc.poll()
    if info is None:
        return None
    killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
    return -info.si_status if killed else info.si_status


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Signal the child's whole process group (it leads its own session); no-op once reaped."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, close). Callers retry if they lose a race."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


# --- service children ------------------------------------------------------------------------


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
    def metrics_address(self) -> str:
        """host:port of its Prometheus GET /metrics port (started with --metrics-port)."""
        return self._address("metrics_address")

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
    if host in WILDCARD_HOSTS:
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
