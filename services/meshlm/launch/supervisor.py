"""Restarts for the launcher's services, as an orchestrator's restart policy would do them.

A service (or the mesh's own redis) that exits while the mesh runs is started again on the same
address after a backoff (0.5 s, doubling, at most 10 s), while the others keep serving; from a
standby (launch/process.py) where one waits: started after the mesh is up, one service at a
time, and again after each restart. A crash
loop (more than `max_restarts` exits within `window` seconds) ends the supervision: the launcher
stops the mesh and names the service with the last lines of its log.

CrashHistory is the policy alone (no processes, no clock of its own); Supervisor applies it to a
Mesh from the launcher's main loop: `check()` every fraction of a second, `stop()` before
mesh.stop(), so that no restart starts once shutdown has begun.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from meshlm.common.logs import get_logger
from meshlm.common.metrics import LauncherMetrics
from meshlm.launch.mesh import Mesh
from meshlm.launch.readiness import MeshStartError

log = get_logger(__name__)

STANDBY_TIMEOUT = 120.0  # seconds a standby may take to import before the next is started


@dataclass(frozen=True)
class RestartPolicy:
    backoff: float = 0.5      # seconds before the first restart; doubles with each one after
    max_backoff: float = 10.0
    max_restarts: int = 5     # restarts allowed within `window`; one more exit is a crash loop
    window: float = 60.0      # seconds


@dataclass
class CrashHistory:
    """When each service was last restarted, and what its next exit means."""

    policy: RestartPolicy
    _restarts: dict[str, deque[float]] = field(default_factory=dict)

    def exited(self, name: str, now: float) -> float | None:
        """Record an exit of `name` at `now`: the seconds to wait before restarting it, or None
        for a crash loop (it was already restarted max_restarts times within the window)."""
        recent = self._restarts.setdefault(name, deque())
        while recent and now - recent[0] >= self.policy.window:
            recent.popleft()
        if len(recent) >= self.policy.max_restarts:
            return None
        delay = min(self.policy.max_backoff, self.policy.backoff * 2 ** len(recent))
        recent.append(now)
        return delay

    def restarts(self, name: str) -> int:
        """Restarts of `name` within the current window."""
        return len(self._restarts.get(name, ()))


@dataclass(frozen=True)
class CrashLoop:
    """Why supervision gave up: the service, its exit code and the end of its log."""

    name: str
    code: int
    restarts: int
    window: float
    log_path: str
    tail: str

    def message(self) -> str:
        return (f"meshlm: {self.name} exited with code {self.code} after {self.restarts} "
                f"restarts within {self.window:g} s; stopping the mesh. "
                f"Last lines of {self.log_path}:\n{self.tail}")


class Supervisor:
    """Restarts what exits; call check() from one thread (the launcher's main loop)."""

    def __init__(self, mesh: Mesh, policy: RestartPolicy,
                 metrics: LauncherMetrics | None = None, standby: bool = False) -> None:
        self.mesh = mesh
        self.policy = policy
        self.metrics = metrics
        self.standby = standby  # keep a standby of each service for its restart (process.py)
        self.history = CrashHistory(policy)
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # no respawn once stop() has begun
        self._restarting: dict[str, threading.Thread] = {}
        for name in self._names():
            self._set_up(name, True)
        if standby:
            threading.Thread(target=self._prepare_standbys, name="meshlm-standbys",
                             daemon=True).start()

    def check(self) -> CrashLoop | None:
        """Schedule a restart of every service that exited since the last check; a CrashLoop
        if one of them exited too often (restarts already scheduled still run until stop())."""
        for name in [n for n in self._restarting if not self._restarting[n].is_alive()]:
            del self._restarting[name]
        for name, code in self.mesh.exited().items():
            if name in self._restarting or self._stopping.is_set():
                continue
            delay = self.history.exited(name, time.monotonic())
            self._set_up(name, False)
            if delay is None:
                log.error("crash_loop", name=name, code=code, restarts=self.history.restarts(name),
                          window=self.policy.window)
                return CrashLoop(name, code, self.history.restarts(name), self.policy.window,
                                 str(self.mesh.log_path(name)), self._tail(name))
            log.warning("service_exited", name=name, code=code, restart_in=round(delay, 3),
                        log=str(self.mesh.log_path(name)))
            thread = threading.Thread(target=self._restart, args=(name, delay),
                                      name=f"meshlm-restart-{name}", daemon=True)
            self._restarting[name] = thread
            thread.start()
        return None

    def stop(self, timeout: float = 5.0) -> None:
        """Start no more restarts and cancel the ones waiting for readiness."""
        with self._lock:
            self._stopping.set()
        deadline = time.monotonic() + timeout
        for thread in list(self._restarting.values()):
            thread.join(max(0.0, deadline - time.monotonic()))

    def _restart(self, name: str, delay: float) -> None:
        if self._stopping.wait(delay):
            return
        began = time.monotonic()
        try:
            with self._lock:
                if self._stopping.is_set():
                    return
                if name == "redis":
                    self.mesh.restart("redis")  # waits for PING; redis starts in milliseconds
                    pid = self.mesh.redis.pid if self.mesh.redis else None
                else:
                    pid = self.mesh.respawn(name).pid
            self._restarted(name, pid)
            if name != "redis":
                self.mesh.wait_ready(self.mesh.service(name), cancel=self._stopping)
                if self.standby:
                    with self._lock:
                        if not self._stopping.is_set():
                            self.mesh.service(name).prepare_standby()
        except (MeshStartError, RuntimeError, OSError) as e:
            # It exited again (the next check() counts it) or shutdown cancelled the wait.
            if not self._stopping.is_set():
                log.warning("restart_failed", name=name, error=str(e).splitlines()[0])
            return
        log.info("service_back", name=name, seconds=round(time.monotonic() - began, 3))

    def _prepare_standbys(self) -> None:
        """A standby for every service, one after another (each imports for seconds of CPU:
        all at once would crowd a small machine's serving), then the standbys_ready line."""
        began = time.monotonic()
        for name in self.mesh.services:
            with self._lock:
                if self._stopping.is_set():
                    return
                proc = self.mesh.service(name)
                proc.prepare_standby()
            if not proc.wait_standby(STANDBY_TIMEOUT) and not self._stopping.is_set():
                log.warning("standby_failed", name=name, timeout=STANDBY_TIMEOUT)
        log.info("standbys_ready", services=len(self.mesh.services),
                 seconds=round(time.monotonic() - began, 3))

    def _restarted(self, name: str, pid: int | None) -> None:
        """The one log line and the metric of a restart."""
        log.warning("service_restarted", name=name, pid=pid,
                    restarts_in_window=self.history.restarts(name), window=self.policy.window)
        if self.metrics is not None:
            self.metrics.restarts.labels(service=name, role=self._role(name)).inc()
        self._set_up(name, True)

    def _set_up(self, name: str, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.up.labels(service=name, role=self._role(name)).set(1 if up else 0)

    def _names(self) -> list[str]:
        return [*self.mesh.services, *(["redis"] if self.mesh.redis is not None else [])]

    def _role(self, name: str) -> str:
        return "redis" if name == "redis" else self.mesh.service(name).role

    def _tail(self, name: str, lines: int = 20) -> str:
        if name == "redis":
            return self.mesh.redis.tail(lines) if self.mesh.redis else ""
        return self.mesh.service(name).tail(lines)
