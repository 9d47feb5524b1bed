"""A request's priority orders the scheduler's waiting queue: larger first, first come first
served among equals (SGLang's default order), asked over gRPC, native /generate, the
transcoded /v1/runtime/text_generate and OpenAI's /v1/completions (an extra field in SGLang
and vLLM).

The observable: a scheduler with one running slot, busy with a long request, gets two requests
that share a long prompt prefix, `early` then `late`. Whichever it admits first computes the
shared prefix; the other finds it in the prefix cache (cached_tokens > 0). Both wait until the
long request is cancelled, so the order is the queue's alone, not the arrival's timing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from helpers import mesh_credentials, own_mesh, scheduler_load, text_request, wait_until

from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2_grpc

SHORT = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
# One request's cached_tokens, sent with its prompt and priority (None: not given).
Send = Callable[[str, "int | None"], int]


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with own_mesh(tmp_path_factory.mktemp("one-slot"), env={"MESHLM_MAX_RUNNING": "1"}) as m:
        yield m


@pytest.fixture(scope="module")
def stub(one_slot: Mesh) -> Iterator[sglang_pb2_grpc.SglangServiceStub]:
    with grpc.insecure_channel(one_slot.addresses.gateway_grpc) as ch:
        yield sglang_pb2_grpc.SglangServiceStub(ch)


def over_grpc(stub: sglang_pb2_grpc.SglangServiceStub) -> Send:
    def send(text: str, priority: int | None) -> int:
        req = text_request(text, **SHORT)
        if priority is not None:
            req.priority = priority
        msgs = list(stub.TextGenerate(req, timeout=120))
        assert msgs[-1].finished
        return int(msgs[-1].meta_info["cached_tokens"])
    return send


def over_native(mesh: Mesh) -> Send:
    def send(text: str, priority: int | None) -> int:
        body = {"text": text, "sampling_params": SHORT, "priority": priority}  # null: not given
        r = httpx.post(f"{mesh.addresses.gateway_http}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return int(r.json()["meta_info"]["cached_tokens"])
    return send


def over_transcoding(mesh: Mesh) -> Send:
    def send(text: str, priority: int | None) -> int:
        body = {"text": text, "sampling_params": SHORT,
                **({} if priority is None else {"priority": priority})}
        r = httpx.post(f"{mesh.addresses.gateway_http}/v1/runtime/text_generate", json=body,
                       timeout=120)
        assert r.status_code == 200, r.text
        (line,) = [json.loads(x) for x in r.text.splitlines() if x.strip()]
        return int(line["result"]["meta_info"]["cached_tokens"])
    return send


def over_openai(mesh: Mesh) -> Send:
    def send(text: str, priority: int | None) -> int:
        body = {"prompt": text, "max_tokens": SHORT["max_new_tokens"], "temperature": 0,
                "ignore_eos": True, **({} if priority is None else {"priority": priority})}
        r = httpx.post(f"{mesh.addresses.gateway_http}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return send


class BlockerEnded(Exception):
    """The long request ended before both requests queued behind it: the trial says nothing."""


def served_first(mesh: Mesh, stub: sglang_pb2_grpc.SglangServiceStub, send: Send,
                 early: int | None, late: int | None) -> str:
    """Queue `early` then `late` (their priorities) behind a long request, free the slot, and
    say which of the two the scheduler admitted first. A trial whose long request ended too
    soon (1900 tokens take the tiny model about 1.5 s alone) is made again, at most 3 times."""
    for attempt in range(3):
        try:
            return one_trial(mesh, stub, send, early, late)
        except BlockerEnded:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def one_trial(mesh: Mesh, stub: sglang_pb2_grpc.SglangServiceStub, send: Send,
              early: int | None, late: int | None) -> str:
    creds = mesh_credentials(mesh)
    prefix = f"{uuid.uuid4().hex} " + "a preamble both requests share, block after block, " * 6
    blocker = stub.TextGenerate(text_request(f"{uuid.uuid4().hex} keep the only slot busy",
                                             max_new_tokens=1900, ignore_eos=True), timeout=120)
    next(blocker)  # running: the one slot is taken
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(send, prefix + "early", early)
        second = None

        def queued(n: int) -> bool:
            if first.done():  # served: the slot came free before both had queued
                raise BlockerEnded
            return scheduler_load(mesh, creds).waiting == n

        try:
            wait_until(lambda: queued(1), 60, "early to queue")
            second = pool.submit(send, prefix + "late", late)
            wait_until(lambda: queued(2), 60, "late to queue")
        except BlockerEnded:
            blocker.cancel()
            for sent in (first, second):
                if sent is not None:
                    sent.result(timeout=120)
            raise
        blocker.cancel()
        assert second is not None
        cached = {"early": first.result(timeout=120), "late": second.result(timeout=120)}
    (computed,) = [name for name, tokens in cached.items() if tokens == 0]
    assert cached["late" if computed == "early" else "early"] > 0, cached
    return computed


@pytest.mark.parametrize("transport", ["grpc", "native", "transcoded", "openai"])
def test_a_later_higher_priority_request_is_served_first(one_slot, stub, transport):
    send = {"grpc": over_grpc(stub), "native": over_native(one_slot),
            "transcoded": over_transcoding(one_slot), "openai": over_openai(one_slot)}[transport]
    assert served_first(one_slot, stub, send, early=None, late=5) == "late"
    assert served_first(one_slot, stub, send, early=-1, late=0) == "late"


def test_equal_priorities_are_first_come_first_served(one_slot, stub):
    assert served_first(one_slot, stub, over_grpc(stub), early=None, late=None) == "early"
    assert served_first(one_slot, stub, over_native(one_slot), early=4, late=4) == "early"
    assert served_first(one_slot, stub, over_grpc(stub), early=9, late=2) == "early"
