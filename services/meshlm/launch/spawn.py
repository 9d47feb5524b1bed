"""Child processes that die with the launcher: starting them, and stopping them with whatever is
left of their process group.

spawn() starts a child in its own session that dies with the launcher (PR_SET_PDEATHSIG on
Linux); terminate() and kill_group() stop it and its process group. Used by process.py
(ServiceProcess), redis_server.py and the bench.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

from meshlm.common.logs import get_logger

log = get_logger(__name__)

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
    stdin: int = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """Start a child in its own session (Ctrl-C at the terminal reaches only the launcher, which
    stops children in order) that dies with the launcher (PR_SET_PDEATHSIG on Linux).

    Call from any thread: the fork happens on a long-lived daemon thread (see _Spawner)."""
    if _LINUX:
        args = [sys.executable, "-S", "-c", _SHIM, str(os.getpid()), *args]
    return _spawner.popen(
        args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
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
