"""One service child of the mesh: its command line, its log file, its "listening" line.

ServiceProcess starts a meshlm service with spawn() (it dies with the launcher), copies its
output to <workdir>/logs/<name>.log and reports the addresses its "listening" line names. Used
by mesh.py; readiness.py says when it answers grpc.health.v1.

A restart can start from a standby (`prepare_standby`): a copy of the service started ahead,
on the same command line and ports, that has imported its code and parsed its flags and waits
for "start" on its stdin (common/service.py). Its imports are most of a start: a scheduler's
(torch) take 2-3 s of CPU, and on a 2-core machine busy serving a restarted scheduler spent 5-9
s in them before its first log line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from meshlm.common.logs import get_logger
from meshlm.common.service import STANDBY_READY, START_GATE_ENV
from meshlm.launch.addresses import connectable
from meshlm.launch.spawn import exit_status, kill_group, spawn, terminate

log = get_logger(__name__)

STANDBY_WAIT = 60.0  # seconds a start waits for a standby still importing, then starts afresh


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
        self._standby: subprocess.Popen[bytes] | None = None
        self._standby_for: tuple[list[str], dict[str, str]] | None = None  # its args and env
        # Reads the standby's output up to its "standby_ready" line (kept for the log).
        self._standby_watch: threading.Thread | None = None
        self._standby_said: list[bytes] = []
        self._standby_ready = threading.Event()

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
            self.proc = self._take_standby()
            if self.proc is not None:  # its lines so far (standby_ready) go to the log first
                out.writelines(self._standby_said)
                out.flush()
            else:
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

    def prepare_standby(self) -> None:
        """Start a standby copy of this service (on the ports it has now) for its next start
        to use; replaces one already waiting."""
        self.discard_standby()
        self.pin_ports()
        self._standby_for = (self.args, dict(self.env))
        self._standby_said, self._standby_ready = [], threading.Event()
        self._standby = spawn(self.args, env={**self.env, START_GATE_ENV: "stdin"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        self._standby_watch = threading.Thread(
            target=self._watch_standby, args=(self._standby, self._standby_said,
                                              self._standby_ready),
            name=f"meshlm-standby-{self.name}", daemon=True)
        self._standby_watch.start()

    def wait_standby(self, timeout: float) -> bool:
        """Whether the standby waits (has logged standby_ready) within `timeout` seconds."""
        return self._standby is not None and self._standby_ready.wait(timeout)

    @staticmethod
    def _watch_standby(standby: subprocess.Popen[bytes], said: list[bytes],
                       ready: threading.Event) -> None:
        """Keep the standby's lines up to its standby_ready event (or its end)."""
        assert standby.stdout is not None
        with contextlib.suppress(OSError, ValueError):  # closed by discard_standby
            for line in standby.stdout:
                said.append(line)
                if STANDBY_READY.encode() in line:
                    ready.set()
                    return

    def discard_standby(self) -> None:
        """Kill a standby and reap it: it has bound no port and written nothing yet."""
        standby, self._standby = self._standby, None
        if standby is None:
            return
        kill_group(standby)
        standby.wait()
        if self._standby_watch is not None:
            self._standby_watch.join(2.0)  # its pipe ends with the process
        for pipe in (standby.stdin, standby.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def _take_standby(self) -> subprocess.Popen[bytes] | None:
        """The standby, told to start, if one waits for this command line and environment;
        else None (none, or it died, or the service changed: it is discarded)."""
        standby = self._standby
        if standby is None:
            return None
        if exit_status(standby) is None and self._standby_for == (self.args, self.env):
            try:
                assert standby.stdin is not None
                standby.stdin.write(b"start\n")
                standby.stdin.close()
            except OSError:
                pass  # it died meanwhile
            else:
                # Still importing, its watcher holds the pipe until standby_ready: one reader
                # at a time (the service's own starts after this).
                if self._standby_watch is not None:
                    self._standby_watch.join(STANDBY_WAIT)
                if self._standby_watch is None or not self._standby_watch.is_alive():
                    self._standby = None
                    return standby
        self.discard_standby()
        return None

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
                self.flags[flag] = connectable(str(info[key])).rsplit(":", 1)[1]

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
        return connectable(str(self.listening[key]))

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


def _listening_event(line: bytes) -> dict[str, Any] | None:
    """The parsed line if it is the JSON "listening" event, else None (non-JSON is fine)."""
    if b"listening" not in line or not line.lstrip().startswith(b"{"):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and event.get("event") == "listening" else None
