"""Profiling sessions in every service: request-level event files, and a torch trace where the
service runs torch.

A session starts with `Profiler.Start` (run_id, event_dir, trace_path_template, enable_torch)
and ends with `Profiler.Stop` (run_id, or "" for whatever is active). While a session with an
event directory is open, the service writes one JSON line per request event to
`<event_dir>/events_<stage>_<pid>.jsonl`:

    {"ts": 1700000000.123456, "run_id": "...", "stage": "scheduler", "pid": 4242,
     "rid": "...", "event": "recv"}

Every stage records `recv` when a request reaches it and the events that mark where it hands
the request on (`send`, or `first` / `finish` for the first and last output); `python -m
meshlm.profiler <event_dir>` turns the files of all services into per-request timelines,
per-stage and per-hop times (`meshlm/profiler/report.py`). Timestamps are wall-clock seconds,
comparable across services on one host (on several hosts, as good as their clock sync).

Recording costs one attribute check per event while no session is open.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Protocol

import grpc
import orjson

from meshlm.common.errors import MeshError
from meshlm.common.logs import get_logger
from meshlm.common.server import Binding
from meshlm.v1 import profiler_pb2 as pb
from meshlm.v1 import profiler_pb2_grpc as pb_grpc

log = get_logger(__name__)


class RequestEvents:
    """One service's request-event file for the open session (none open: `active` is False)."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.run_id = ""
        self.path: Path | None = None
        self._file: IO[bytes] | None = None
        self._lock = threading.Lock()  # the scheduler records from its engine thread too

    @property
    def active(self) -> bool:
        return self._file is not None

    def open(self, run_id: str, event_dir: str) -> Path:
        directory = Path(event_dir).expanduser()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"events_{self.stage}_{os.getpid()}.jsonl"
        with self._lock:
            self._close_locked()
            self._file = open(path, "ab")  # noqa: SIM115 - kept open for the session
            self.run_id, self.path = run_id, path
        return path

    def close(self) -> Path | None:
        with self._lock:
            return self._close_locked()

    def _close_locked(self) -> Path | None:
        path, self.path = self.path, None
        if self._file is not None:
            self._file.close()
            self._file = None
        return path

    def record(self, event: str, rids: str | Iterable[str], **fields: object) -> None:
        """One line per rid; a no-op while no session is open."""
        if self._file is None:
            return
        ts = time.time()
        head = {"ts": ts, "run_id": self.run_id, "stage": self.stage, "pid": os.getpid()}
        lines = b"".join(
            orjson.dumps({**head, "rid": rid, "event": event, **fields}) + b"\n"
            for rid in ([rids] if isinstance(rids, str) else rids)
        )
        with self._lock:
            if self._file is not None:
                self._file.write(lines)


class TorchTrace(Protocol):
    """A service's torch profiler: started with a path prefix, stopped into its files."""

    async def start(self, path_prefix: str) -> None: ...

    async def stop(self) -> list[str]: ...


class Profiling:
    """A service's profiling state: its event recorder and, where it runs torch, its trace."""

    def __init__(self, stage: str, torch_trace: TorchTrace | None = None) -> None:
        self.stage = stage
        self.events = RequestEvents(stage)
        self.torch_trace = torch_trace
        self.run_id = ""
        self._tracing = False

    async def start(self, req: pb.ProfileStart) -> pb.ProfileReply:
        if self.run_id:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{self.stage}: profiling run {self.run_id!r} is already active; "
                            "stop it first")
        run_id = req.run_id or uuid.uuid4().hex[:12]
        parts = []
        if req.event_dir:
            parts.append(f"events -> {self.events.open(run_id, req.event_dir)}")
        if req.enable_torch and req.trace_path_template and self.torch_trace is not None:
            await self.torch_trace.start(f"{req.trace_path_template}-{self.stage}-{os.getpid()}")
            self._tracing = True
            parts.append("torch trace")
        self.run_id = run_id
        log.info("profile_started", run_id=run_id, stage=self.stage, what=", ".join(parts))
        return pb.ProfileReply(ok=True, message=f"{self.stage}: run {run_id} started "
                                                f"({', '.join(parts) or 'nothing to record'})")

    async def stop(self, req: pb.ProfileStop) -> pb.ProfileReply:
        if not self.run_id:
            return pb.ProfileReply(ok=False, message=f"{self.stage}: no profiling run is active")
        if req.run_id and req.run_id != self.run_id:
            return pb.ProfileReply(ok=False, message=f"{self.stage}: the active run is "
                                                     f"{self.run_id!r}, not {req.run_id!r}")
        files = []
        if self._tracing and self.torch_trace is not None:
            files += await self.torch_trace.stop()
            self._tracing = False
        path = self.events.close()
        if path is not None:
            files.append(str(path))
        run_id, self.run_id = self.run_id, ""
        log.info("profile_stopped", run_id=run_id, stage=self.stage, files=files)
        return pb.ProfileReply(ok=True, message=f"{self.stage}: run {run_id} stopped",
                               files=files)


class ProfilerServicer(pb_grpc.ProfilerServicer):
    """meshlm.v1.Profiler over a service's Profiling."""

    def __init__(self, profiling: Profiling) -> None:
        self.profiling = profiling

    async def Start(self, request: pb.ProfileStart, context: grpc.aio.ServicerContext
                    ) -> pb.ProfileReply:
        return await self.profiling.start(request)

    async def Stop(self, request: pb.ProfileStop, context: grpc.aio.ServicerContext
                   ) -> pb.ProfileReply:
        return await self.profiling.stop(request)


def profiler_binding(profiling: Profiling) -> Binding:
    """The Binding that serves `profiling` beside a service's own servicer."""
    return Binding(pb_grpc.add_ProfilerServicer_to_server, ProfilerServicer(profiling),
                   pb.DESCRIPTOR.services_by_name["Profiler"].full_name)
