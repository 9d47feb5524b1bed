"""StartProfile / StopProfile (and SGLang's /start_profile, /stop_profile, /start_request_profile,
/stop_request_profile).

A profiling run spans the whole mesh: the gateway opens it in itself and, through
`meshlm.v1.Profiler`, in every configured tokenizer, scheduler and detokenizer. Each writes its
request events to `<event_dir>/events_<stage>_<pid>.jsonl`; each scheduler writes a torch trace
to `<trace_path_template>-scheduler-<pid>.trace.json`. The paths are on each service's own
filesystem (one shared volume in a cluster), so they must be absolute. `python -m
meshlm.profiler <event_dir>` reports per-stage and per-hop times. A start that fails anywhere is
undone everywhere; stopping with no run open is harmless.
"""

from __future__ import annotations

import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc

from meshlm.common.errors import MeshError, invalid
from meshlm.common.logs import get_logger
from meshlm.common.profiling import Profiling
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.core import GatewayCore
from meshlm.gateway.mesh.dependencies import ROLES
from meshlm.gateway.mesh.fanout import failures, on_every
from meshlm.v1 import profiler_pb2, profiler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb

log = get_logger(__name__)

PROFILE_TIMEOUT = 60.0  # seconds; a scheduler exports its torch trace on stop


@dataclass
class ProfileRun:
    run_id: str
    services: int
    messages: list[str]
    files: list[str]
    failed: list[str]  # 'address: CODE details' of services that did not answer


def default_output_dir(run_id: str) -> str:
    return str(Path(tempfile.gettempdir()) / "meshlm-profiles" / run_id)


class ProfileRPCs:
    def __init__(self, core: GatewayCore, profiling: Profiling) -> None:
        self.core = core
        self.profiling = profiling  # this gateway's own part of a run

    async def StartProfile(self, req: pb.StartProfileRequest,
                           ctx: CallContext) -> pb.StartProfileResponse:
        """A torch trace and request events under `output_dir` (default: a directory under
        the system's temp dir named after the run)."""
        run_id = uuid.uuid4().hex[:12]
        out = req.output_dir if req.HasField("output_dir") else default_output_dir(run_id)
        _absolute("output_dir", out)
        run = await self.start_profile(profiler_pb2.ProfileStart(
            run_id=run_id, trace_path_template=str(Path(out) / "trace"),
            event_dir=str(Path(out) / "events"), enable_torch=True))
        return pb.StartProfileResponse(message=(
            f"Profiling run {run.run_id} started on {run.services} service(s); stop it to write "
            f"the torch traces and request events under {out} (report: python -m "
            f"meshlm.profiler {Path(out) / 'events'})."))

    async def StopProfile(self, req: pb.StopProfileRequest,
                          ctx: CallContext) -> pb.StopProfileResponse:
        run = await self.stop_profile("")
        return pb.StopProfileResponse(message=stop_message(run))

    async def start_profile(self, start: profiler_pb2.ProfileStart) -> ProfileRun:
        """Open one run in every service; undone everywhere when any service refuses."""
        if start.event_dir:
            _absolute("event_dir", start.event_dir)
        if start.trace_path_template:
            _absolute("trace_path_template", start.trace_path_template)
        if not start.run_id:
            start.run_id = uuid.uuid4().hex[:12]
        local = await self.profiling.start(start)  # FAILED_PRECONDITION when a run is open
        targets = self._profiled()
        results = await on_every(self.core.channels, targets, lambda ch: profiler_pb2_grpc.
                                 ProfilerStub(ch).Start(start, timeout=PROFILE_TIMEOUT))
        failed = failures(targets, results)
        if failed:
            await self.stop_profile(start.run_id)
            codes = {r.code() for r in results if isinstance(r, grpc.aio.AioRpcError)}
            code = (grpc.StatusCode.FAILED_PRECONDITION
                    if codes == {grpc.StatusCode.FAILED_PRECONDITION}
                    else grpc.StatusCode.UNAVAILABLE)
            raise MeshError(code, f"profiling run {start.run_id} could not start on "
                                  f"{len(failed)} of {len(targets) + 1} service(s) "
                                  f"({'; '.join(failed)}); it was stopped everywhere")
        replies = [local, *(r for r in results if isinstance(r, profiler_pb2.ProfileReply))]
        log.info("profile_run_started", run_id=start.run_id, services=len(replies),
                 event_dir=start.event_dir, torch=start.enable_torch)
        return ProfileRun(start.run_id, len(replies), [r.message for r in replies], [], [])

    async def stop_profile(self, run_id: str) -> ProfileRun:
        """Close the run (`run_id`, or whatever run is open: "") in every service; a service
        that cannot be reached is named in the messages, the others still stop."""
        stop = profiler_pb2.ProfileStop(run_id=run_id)
        run_id = run_id or self.profiling.run_id  # the wildcard's run, as far as known here
        local = await self.profiling.stop(stop)
        targets = self._profiled()
        results = await on_every(self.core.channels, targets, lambda ch: profiler_pb2_grpc.
                                 ProfilerStub(ch).Stop(stop, timeout=PROFILE_TIMEOUT))
        replies = [local, *(r for r in results if isinstance(r, profiler_pb2.ProfileReply))]
        stopped = [r for r in replies if r.ok]
        files = sorted(f for r in stopped for f in r.files)
        failed = failures(targets, results)
        if stopped:
            log.info("profile_run_stopped", run_id=run_id, files=len(files), failed=failed)
        return ProfileRun(run_id, len(stopped), [r.message for r in stopped], files, failed)

    def _profiled(self) -> list[str]:
        return [address for role in ROLES for address in self.core.deps.addresses[role]]


def stop_message(run: ProfileRun) -> str:
    unreached = f" Not reached: {'; '.join(run.failed)}." if run.failed else ""
    if not run.services:
        return "No profiling run was active." + unreached
    return (f"Profiling stopped on {run.services} service(s); files: "
            f"{', '.join(run.files) or 'none'}.{unreached}")


def _absolute(field: str, path: str) -> None:
    if not Path(path).is_absolute():
        raise invalid(field, f"must be an absolute path (each service writes it on its own "
                             f"filesystem), got {path!r}")
