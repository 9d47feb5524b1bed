"""A mesh stream's connection lost while both its ends still serve (a reset connection, a
lost keepalive answer: health is watched on other connections, so nothing flips). What was on
the wire may be gone and which requests it carried is not known, so the requests that may have
lost something end UNAVAILABLE at once, saying which stream was lost, and nothing else does;
without this they waited for ever (a lost request or final output) or silently missed tokens.

Each test cuts one stream's TCP connection with `ss -K` (the kernel's socket destroy: root and
CONFIG_INET_DIAG_DESTROY, as CI has; skipped otherwise), found by the sending process's sockets
to its peer's port: the tokenizer, scheduler and detokenizer reach those peers by the stream
alone. The
gateway's own Submit stream shares its peer with the gateway's health watch, so it is tested
where it can be cut alone (tests/unit/gateway/api/test_submit_lost.py)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import grpc
import pytest
from helpers import (
    Stream,
    finished_in_full,
    routes,
    scheduler_busy,
    serves,
    streaming,
    wait_until,
)
from two_of_each import mesh2, registry, stub  # noqa: F401 (fixtures)

from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2 as pb


def _connections(pid: int, peer: str) -> list[str]:
    """The local addresses of `pid`'s established TCP connections to `peer` (host:port)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", "dst", peer],
                         capture_output=True, text=True, check=True).stdout
    return [line.split()[2] for line in out.splitlines() if re.search(rf"pid={pid},", line)]


def cut(pid: int, peer: str) -> int:
    """Destroy `pid`'s connections to `peer` (skip the test where the kernel will not); how
    many there were."""
    local = _connections(pid, peer)
    assert local, f"pid {pid} has no connection to {peer}"
    for address in local:
        done = subprocess.run(["ss", "-K", "src", address, "dst", peer],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"ss -K failed: {done.stderr.strip()}")
    if set(local) & set(_connections(pid, peer)):
        pytest.skip("ss -K did not destroy the sockets (needs root and "
                    "CONFIG_INET_DIAG_DESTROY)")
    return len(local)


def _details(s: Stream) -> str:
    assert s.error is not None, (s.rid, s.messages[-1] if s.messages else None)
    return s.error.details() or ""


def test_a_lost_scheduler_to_detokenizer_stream_ends_the_requests_it_carried(mesh2, stub,
                                                                          registry):
    scheduler = mesh2.replicas("scheduler")[0]
    streams = streaming([Stream(stub, f"cut detok {i}", dp_rank=0, max_new_tokens=1900,
                                wait_first=False) for i in range(4)])
    through = {s.rid: routes(registry, s.rid)["detokenizer"] for s in streams}
    victim = through[streams[0].rid]
    doomed = [s for s in streams if through[s.rid] == victim]
    spared = [s for s in streams if through[s.rid] != victim]
    assert scheduler.pid is not None
    print(f"\ncutting scheduler -> {victim}: {len(doomed)} streams through it, "
          f"{len(spared)} through the other detokenizer")
    cut(scheduler.pid, victim)
    for s in doomed:
        s.join()
        assert s.code() == grpc.StatusCode.UNAVAILABLE, (s.rid, s.code())
        assert f"the stream to the detokenizer at {victim} was lost" in _details(s)
    finished_in_full(spared, 1900)
    # The stream reconnects: the scheduler is used again, through either detokenizer.
    wait_until(lambda: serves(stub, routed_dp_rank=0), timeout=30,
               what="a request on the scheduler again")
    wait_until(lambda: scheduler_busy(mesh2, scheduler.address) == 0, timeout=30,
               what="the scheduler to hold nothing of the ended requests")


def test_a_lost_detokenizer_to_gateway_stream_ends_the_requests_it_carried(mesh2, stub,
                                                                          registry):
    streams = streaming([Stream(stub, f"cut gateway {i}", max_new_tokens=1900,
                                wait_first=False) for i in range(4)])
    through = {s.rid: routes(registry, s.rid)["detokenizer"] for s in streams}
    victim = through[streams[0].rid]
    doomed = [s for s in streams if through[s.rid] == victim]
    spared = [s for s in streams if through[s.rid] != victim]
    pid = next(d.pid for d in mesh2.replicas("detokenizer") if d.address == victim)
    inbox = mesh2.addresses.gateway_inbox
    print(f"\ncutting {victim} -> gateway: {len(doomed)} streams through it, {len(spared)} "
          f"through the other detokenizer")
    cut(pid, inbox)
    for s in doomed:
        s.join()
        assert s.code() == grpc.StatusCode.UNAVAILABLE, (s.rid, s.code())
        assert f"the detokenizer lost its stream to the gateway at {inbox}" in _details(s)
    finished_in_full(spared, 1900)
    for scheduler in mesh2.replicas("scheduler"):  # the ended requests were aborted there
        wait_until(lambda a=scheduler.address: scheduler_busy(mesh2, a) == 0, timeout=30,
                   what="the schedulers to hold nothing of the ended requests")


@pytest.fixture
def paused(stub) -> Iterator[None]:
    stub.PauseGeneration(pb.PauseGenerationRequest(mode="in_place"), timeout=60)
    try:
        yield
    finally:
        stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=60)


def test_a_lost_tokenizer_to_scheduler_stream_ends_the_requests_it_may_have_dropped(
        mesh2: Mesh, stub, registry, paused) -> None:
    """Generation is paused, so the requests wait in the scheduler with no output: those that
    came through the cut stream's tokenizer end UNAVAILABLE (any of them could have been on
    the wire); those of the other tokenizer run once generation continues."""
    scheduler = mesh2.replicas("scheduler")[0]
    queued = [Stream(stub, f"cut tok {i}", dp_rank=0, max_new_tokens=4, wait_first=False)
              for i in range(4)]
    wait_until(lambda: scheduler_busy(mesh2, scheduler.address) >= len(queued), timeout=30,
               what="the requests queued in the paused scheduler")
    through = {s.rid: routes(registry, s.rid)["tokenizer"] for s in queued}
    victim = through[queued[0].rid]
    doomed = [s for s in queued if through[s.rid] == victim]
    spared = [s for s in queued if through[s.rid] != victim]
    pid = next(t.pid for t in mesh2.replicas("tokenizer") if t.address == victim)
    print(f"\ncutting {victim} -> scheduler: {len(doomed)} queued requests came through it, "
          f"{len(spared)} through the other tokenizer")
    cut(pid, scheduler.address)
    for s in doomed:
        s.join()
        assert s.code() == grpc.StatusCode.UNAVAILABLE, (s.rid, s.code())
        assert (f"the stream from the tokenizer at {victim} to the scheduler at "
                f"{scheduler.address} was lost") in _details(s)
    assert all(s.thread.is_alive() for s in spared)
    stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=60)
    finished_in_full(spared, 4)
    wait_until(lambda: serves(stub, routed_dp_rank=0), timeout=30,
               what="a request on the scheduler again")
