"""Hung replicas: a scheduler, detokenizer or tokenizer stopped with SIGSTOP (its process does
not run, its sockets stay open, so no connection breaks by itself) is treated as down within
DOWN_BOUND (common/channels.py: keepalive closes its connections): the requests that need it
end UNAVAILABLE, the others finish, new requests go to the other replica, and after SIGCONT it
is used again. A resumed scheduler drops the requests it held (its watchdog saw the freeze), so
none goes on generating for nobody."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from helpers import (
    Stream,
    collect_text,
    dependencies,
    end_spared,
    finished_in_full,
    recorded_failed,
    routes,
    scheduler_busy,
    serves,
    streaming,
    text_request,
    wait_until,
)
from two_of_each import mesh2, registry, stub  # noqa: F401 (fixtures)

from meshlm.common.channels import DOWN_BOUND
from meshlm.gateway.api.info import LOAD_TIMEOUT
from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2 as pb


@contextmanager
def stopped(mesh2: Mesh, name: str) -> Iterator[float]:
    """SIGSTOP a service for the block (yields when); SIGCONT however the block ends."""
    proc = mesh2.service(name)
    proc.send_signal(signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        proc.send_signal(signal.SIGCONT)


def assert_ended_unavailable_in_time(streams: list[Stream], stopped_at: float,
                                     what: str) -> None:
    for s in streams:
        s.join()
        assert s.code() == grpc.StatusCode.UNAVAILABLE, (
            s.rid, s.code(), dict(s.messages[-1].meta_info))  # how it ended instead
    took = [round(s.ended_at - stopped_at, 2) for s in streams]
    print(f"\n{what}: requests ended UNAVAILABLE {took} s after SIGSTOP (bound {DOWN_BOUND} s)")
    assert max(took) <= DOWN_BOUND, took


def test_scheduler_stopped_mid_stream(mesh2, stub, registry):
    victim, other = mesh2.replicas("scheduler")
    doomed = [Stream(stub, f"on rank 0 #{i}", dp_rank=0, wait_first=False) for i in range(3)]
    spared = [Stream(stub, f"on rank 1 #{i}", dp_rank=1, max_new_tokens=300, wait_first=False)
              for i in range(2)]
    streaming(doomed + spared)
    with stopped(mesh2, victim.name) as stopped_at:
        # The load and info calls answer within LOAD_TIMEOUT: the stopped one with its error.
        asked = time.monotonic()
        loads = json.loads(stub.GetLoad(pb.GetLoadRequest(), timeout=10).json_info)
        assert time.monotonic() - asked < LOAD_TIMEOUT + 1
        asked = time.monotonic()
        info = json.loads(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).json_info)
        assert time.monotonic() - asked < LOAD_TIMEOUT + 1
        assert [load["address"] for load in loads] == [victim.address, other.address]
        assert "error" in loads[0] and "error" not in loads[1], loads
        assert info["max_total_num_tokens"] == (loads[1]["kv_blocks_total"]
                                                * loads[1]["kv_block_size"])
        assert_ended_unavailable_in_time(doomed, stopped_at, "scheduler")
        finished_in_full(spared, 300)
        recorded_failed(registry, doomed)
        # New requests go to the scheduler that answers, unless they insist on the stopped one.
        for i in range(4):
            rid = f"h-after-{uuid.uuid4().hex[:8]}"
            _, msgs = collect_text(stub, text_request(f"after the stop {i}", rid=rid,
                                                      max_new_tokens=3))
            assert msgs[-1].finished
            assert routes(registry, rid)["scheduler"] == other.address
        pinned = text_request("to the stopped one", max_new_tokens=2)
        pinned.routed_dp_rank = 0
        with pytest.raises(grpc.RpcError) as err:
            collect_text(stub, pinned)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # It answers again: used again, and what it held when it stopped is gone, not generated
    # for nobody (1900 tokens each would take far longer than this wait).
    wait_until(lambda: serves(stub, routed_dp_rank=0), timeout=60,
               what="a request pinned to the resumed scheduler to succeed")
    wait_until(lambda: scheduler_busy(mesh2, victim.address) == 0, timeout=10,
               what="the resumed scheduler to drop the requests it held")


def test_detokenizer_stopped_mid_stream(mesh2, stub, registry):
    streams = streaming([Stream(stub, f"detok {i} {uuid.uuid4().hex}", wait_first=False)
                         for i in range(6)])
    victim = mesh2.replicas("detokenizer")[0]
    # Stopped as soon as they stream (their routes are read from the registry meanwhile), so
    # none can finish first, however slow the machine is between the steps of this test.
    with stopped(mesh2, victim.name) as stopped_at:
        by_route = {s.rid: routes(registry, s.rid)["detokenizer"] for s in streams}
        doomed = [s for s in streams if by_route[s.rid] == victim.address]
        spared = [s for s in streams if by_route[s.rid] != victim.address]
        assert doomed and spared, by_route
        assert_ended_unavailable_in_time(doomed, stopped_at, "detokenizer")
        end_spared(stub, spared)
        for i in range(4):
            _, msgs = collect_text(stub, text_request(f"after detok stop {i}", max_new_tokens=3))
            assert msgs[-1].finished
        # The schedulers stopped the doomed requests too (nobody is left to read them).
        wait_until(lambda: all(scheduler_busy(mesh2, s.address) == 0
                               for s in mesh2.replicas("scheduler")),
                   what="every scheduler to be idle")
    wait_until(lambda: all(dependencies(stub)["detokenizer"].values()), timeout=30,
               what="the detokenizer to serve again")
    after = [Stream(stub, f"detok back {i}", max_new_tokens=3) for i in range(4)]
    assert {routes(registry, s.rid)["detokenizer"] for s in after} >= {victim.address}
    for s in after:
        assert s.join().finished, (s.rid, s.error)


def test_tokenizer_stopped(mesh2, stub, registry):
    running_streams = [Stream(stub, f"tok {i}", max_new_tokens=200) for i in range(4)]
    victim = mesh2.replicas("tokenizer")[0]
    with stopped(mesh2, victim.name) as stopped_at:
        # Round robin over both tokenizers: one of two new requests waits in the stopped one.
        fresh = [Stream(stub, f"tok new {i}", max_new_tokens=3, wait_first=False)
                 for i in range(2)]
        stuck = [s for s in fresh if routes(registry, s.rid)["tokenizer"] == victim.address]
        assert len(stuck) == 1, [routes(registry, s.rid) for s in fresh]
        assert_ended_unavailable_in_time(stuck, stopped_at, "tokenizer")
        # Requests past their tokenizer do not need it any more.
        for s in running_streams + [s for s in fresh if s not in stuck]:
            assert s.join().finished, (s.rid, s.error)
        for i in range(4):
            _, msgs = collect_text(stub, text_request(f"after tok stop {i}", max_new_tokens=2))
            assert msgs[-1].finished
    wait_until(lambda: all(dependencies(stub)["tokenizer"].values()), timeout=30,
               what="the tokenizer to serve again")
