"""PauseGeneration / ContinueGeneration against the real mesh, each mode under live streaming
requests (one over gRPC, one over HTTP SSE), paused and continued over gRPC and over HTTP
(/pause_generation, /continue_generation):

- retract: the running requests go back to the queue with their KV freed, and their outputs
  after continue equal an unpaused run (greedy, and seeded sampling);
- in_place: nothing moves, KV kept; outputs equal an unpaused run;
- abort: the streams end with finish_reason abort.

In every mode a request sent while paused is queued (not refused) and completes after continue.
The mesh is shared by the whole session: every test continues generation and ends its streams
in a fixture's teardown, whatever happened.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from helpers import TokenStream, gateway_load, text_request, wait_until

from sglang.runtime.v1 import sglang_pb2 as pb

# tokens: the tiny model makes 1900 in about 1.5 s alone on 2 CPU cores, far more than a pause
# takes to land (400, 0.3 s, was once outrun: a stream finished before the pause retracted it)
LONG = 1900
SHORT = 8
PROMPTS = {"greedy": "Once upon a time in a faraway land",
           "seeded": "The weather today is",
           "late": "While we were waiting"}
SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 1234},
    "late": {"temperature": 0.0},
}


class Stream(TokenStream):
    def __init__(self, kind: str, max_new_tokens: int) -> None:
        super().__init__(f"pause-{kind}-{uuid.uuid4().hex[:8]}")
        self.kind = kind
        self.max_new_tokens = max_new_tokens


class GrpcStream(Stream):
    def __init__(self, stub, kind: str, max_new_tokens: int = LONG) -> None:
        super().__init__(kind, max_new_tokens)
        self.stub = stub

    def run(self) -> None:
        req = text_request(PROMPTS[self.kind], rid=self.rid, max_new_tokens=self.max_new_tokens,
                           ignore_eos=True, **SAMPLING[self.kind])
        self.follow_grpc(self.stub.TextGenerate(req, timeout=300))


class HttpStream(Stream):
    """SGLang's /generate with stream: SSE events with the text and ids so far."""

    def __init__(self, base: str, kind: str, max_new_tokens: int = LONG) -> None:
        super().__init__(kind, max_new_tokens)
        self.base = base

    def run(self) -> None:
        self.follow_sse(self.base, {
            "text": PROMPTS[self.kind], "stream": True, "rid": self.rid,
            "sampling_params": {"max_new_tokens": self.max_new_tokens, "ignore_eos": True,
                                **SAMPLING[self.kind]}})


_references: dict[tuple[str, int], tuple[list[int], str]] = {}


def reference(stub, kind: str, max_new_tokens: int = LONG) -> tuple[list[int], str]:
    """The ids and text of an unpaused run of the same request (cached for the module)."""
    key = (kind, max_new_tokens)
    if key not in _references:
        req = text_request(PROMPTS[kind], stream=False, max_new_tokens=max_new_tokens,
                           ignore_eos=True, **SAMPLING[kind])
        [only] = list(stub.TextGenerate(req, timeout=300))
        _references[key] = (list(only.output_ids), only.text)
    return _references[key]


class Control:
    """Pause and continue over one transport; both answer with a message."""

    def __init__(self, via: str, stub, base: str) -> None:
        self.via, self.stub, self.base = via, stub, base

    def pause(self, mode: str) -> str:
        if self.via == "grpc":
            return self.stub.PauseGeneration(pb.PauseGenerationRequest(mode=mode),
                                             timeout=60).message
        r = httpx.post(f"{self.base}/pause_generation", json={"mode": mode}, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        return r.json()["message"]

    def resume(self) -> str:
        if self.via == "grpc":
            return self.stub.ContinueGeneration(pb.ContinueGenerationRequest(),
                                                timeout=60).message
        r = httpx.post(f"{self.base}/continue_generation", timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        return r.json()["message"]


@pytest.fixture(params=["grpc", "http"])
def control(request, stub, mesh) -> Control:
    return Control(request.param, stub, mesh.addresses.gateway_http)


@pytest.fixture
def streams(stub) -> Iterator[list[Stream]]:
    """The test's streams; afterwards generation continues and every stream is ended."""
    started: list[Stream] = []
    try:
        yield started
    finally:
        stub.ContinueGeneration(pb.ContinueGenerationRequest(), timeout=60)
        for s in started:
            if not s.done:
                stub.Abort(pb.AbortRequest(rid=s.rid), timeout=60)
        for s in started:
            s.wait_done(60)
        wait_until(lambda: gateway_load(stub)["running"] == 0, timeout=60, what="idle mesh")


def _start(streams: list[Stream], *new: Stream) -> list[Stream]:
    for s in new:
        streams.append(s.start())
    return list(new)


def _queued_while_paused(stub, streams: list[Stream], waiting: int) -> Stream:
    """A request sent while paused: queued (waiting grows), and no step runs meanwhile."""
    generated = gateway_load(stub)["generated_tokens_total"]
    [late] = _start(streams, GrpcStream(stub, "late", SHORT))
    wait_until(lambda: gateway_load(stub)["waiting"] == waiting, timeout=30,
               what="the request sent while paused is queued")
    assert gateway_load(stub)["generated_tokens_total"] == generated
    assert not late.ids and not late.done
    return late


def _matches_reference(stub, s: Stream) -> None:
    s.result()
    ids, text = reference(stub, s.kind, s.max_new_tokens)
    assert s.finish_reason == "length" and s.completion_tokens == s.max_new_tokens
    assert s.ids == ids, f"{s.rid}: tokens differ from an unpaused run"
    assert s.text == text


def test_retract_frees_kv_and_outputs_equal_an_unpaused_run(stub, mesh, control, streams):
    for kind in ("greedy", "seeded", "late"):
        reference(stub, kind, SHORT if kind == "late" else LONG)
    before = gateway_load(stub)
    running = _start(streams, GrpcStream(stub, "greedy"),
                     HttpStream(mesh.addresses.gateway_http, "seeded"))
    for s in running:
        s.wait_tokens(3)
    message = control.pause("retract")
    assert message == "Generation paused (mode retract) on 1 scheduler(s): 2 request(s) " \
                      "retracted."
    load = gateway_load(stub)
    assert load["paused"] == "retract" and load["running"] == 0 and load["waiting"] == 2
    assert load["kv_blocks_used"] == 0  # their KV is freed (its full blocks stay cached)
    assert load["retracted_total"] == before["retracted_total"] + 2
    late = _queued_while_paused(stub, streams, waiting=3)
    assert all(len(s.ids) < LONG for s in running)
    assert control.resume() == "Generation continued on 1 scheduler(s)."
    for s in [*running, late]:
        _matches_reference(stub, s)
    assert gateway_load(stub)["paused"] is None


def test_in_place_keeps_kv_and_outputs_equal_an_unpaused_run(stub, mesh, control, streams):
    for kind in ("greedy", "late"):
        reference(stub, kind, SHORT if kind == "late" else LONG)
    before = gateway_load(stub)
    running = _start(streams, GrpcStream(stub, "greedy"),
                     HttpStream(mesh.addresses.gateway_http, "greedy"))
    for s in running:
        s.wait_tokens(3)
    message = control.pause("in_place")
    assert message == "Generation paused (mode in_place) on 1 scheduler(s): 2 request(s) kept " \
                      "in place."
    load = gateway_load(stub)
    assert load["paused"] == "in_place" and load["running"] == 2 and load["waiting"] == 0
    assert load["kv_blocks_used"] > 0
    late = _queued_while_paused(stub, streams, waiting=1)
    assert gateway_load(stub)["kv_blocks_used"] == load["kv_blocks_used"]  # nothing moved
    assert control.resume() == "Generation continued on 1 scheduler(s)."
    for s in [*running, late]:
        _matches_reference(stub, s)
    assert gateway_load(stub)["retracted_total"] == before["retracted_total"]


def test_abort_ends_every_stream_and_later_requests_wait(stub, mesh, control, streams):
    reference(stub, "late", SHORT)
    running = _start(streams, GrpcStream(stub, "greedy"),
                     HttpStream(mesh.addresses.gateway_http, "seeded"))
    for s in running:
        s.wait_tokens(3)
    message = control.pause("abort")
    assert message == "Generation paused (mode abort) on 1 scheduler(s): 2 request(s) aborted."
    for s in running:
        s.result()
        assert s.finish_reason == "abort" and 3 <= len(s.ids) < LONG
        assert s.completion_tokens == len(s.ids)
    load = gateway_load(stub)
    assert load["paused"] == "abort" and load["running"] == 0 and load["waiting"] == 0
    late = _queued_while_paused(stub, streams, waiting=1)
    assert control.resume() == "Generation continued on 1 scheduler(s)."
    _matches_reference(stub, late)


def test_pausing_twice_and_continuing_unpaused_are_harmless(stub, control, streams):
    assert control.resume() == ("Generation was not paused on any of 1 scheduler(s); "
                                "nothing to continue.")
    assert control.pause("in_place") == ("Generation paused (mode in_place) on 1 "
                                         "scheduler(s): 0 request(s) kept in place.")
    assert control.pause("in_place") == ("Generation was already paused on 1 scheduler(s); "
                                         "mode in_place applied: 0 request(s) kept in place.")
    assert control.pause("retract").startswith("Generation was already paused")
    assert gateway_load(stub)["paused"] == "retract"
    assert control.resume() == "Generation continued on 1 scheduler(s)."
    assert control.resume().startswith("Generation was not paused")
    assert gateway_load(stub)["paused"] is None


def test_pause_errors_name_the_field_and_pause_nothing(stub, mesh, streams):
    base = mesh.addresses.gateway_http
    with pytest.raises(grpc.RpcError) as err:
        stub.PauseGeneration(pb.PauseGenerationRequest(mode="sleep"), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "mode: must be one of abort, retract, in_place; got 'sleep'"
    for body, field in (({"mode": "sleep"}, "mode"), ({"mode": 1}, "mode"),
                        ({"mdoe": "retract"}, "mdoe")):
        r = httpx.post(f"{base}/pause_generation", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"{field}: ")
    r = httpx.post(f"{base}/v1/runtime/pause_generation", json={"mode": "sleep"}, timeout=60)
    assert r.status_code == 400 and r.json()["message"].startswith("mode: ")
    r = httpx.post(f"{base}/continue_generation", json={"now": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("now: ")
    assert httpx.get(f"{base}/pause_generation", timeout=60).status_code == 405
    assert gateway_load(stub)["paused"] is None
    # No mode: SGLang's default, abort. Then continue, over the transcoded RPC.
    r = httpx.post(f"{base}/pause_generation", timeout=60)
    assert r.status_code == 200 and "(mode abort)" in r.json()["message"]
    r = httpx.post(f"{base}/v1/runtime/continue_generation", json={}, timeout=60)
    assert r.json() == {"message": "Generation continued on 1 scheduler(s)."}
