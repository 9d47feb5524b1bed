"""Bounds before work, from the public ports of a real mesh: a 10 MB prompt is refused by its
characters before tokenization (INVALID_ARGUMENT / 400 naming the limit) on every route, while a
small request of another client keeps its latency and no service keeps the memory; bodies and
messages over the size limits are refused unread; a batch that could never be admitted is
refused at once, before any of it enters the mesh."""

from __future__ import annotations

import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
from helpers import mesh_credentials, scheduler_load, text_request, wait_until

from meshlm.gateway.protocol.bounds import DEFAULT_BODY_BYTES, PROMPT_CHARS_PER_TOKEN
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc as pb_grpc

BIG = "word " * 2_000_000  # 10 MB
CONTEXT = 2048  # the default model's
LIMIT = f"at most {CONTEXT * PROMPT_CHARS_PER_TOKEN} (--max-prompt-chars)"
ROLES = ("gateway", "tokenizer", "scheduler", "detokenizer")
RSS_SLACK_MB = 100
# Seconds the barrage may add whatever the ratio. Two clients sending 10 MB prompts back to back
# keep a 2-core machine's CPUs busy (each refusal costs the gateway 15-35 ms of its loop), so
# every hop of the small request waits its turn: 0.06 s added on a quiet machine, 0.4 s on a
# loaded CI host. A mesh that tokenized the prompts, or stalled behind them, adds seconds.
LATENCY_FLOOR = 1.0


def _http_refusals(base: str) -> Iterator[tuple[str, httpx.Response]]:
    """The 10 MB prompt on each HTTP route that takes text."""
    with httpx.Client(base_url=base, timeout=60) as http:
        yield "/generate", http.post("/generate", content=orjson.dumps({"text": BIG}))
        yield "/v1/chat/completions", http.post("/v1/chat/completions", content=orjson.dumps(
            {"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": BIG}]}))
        yield "/v1/completions", http.post("/v1/completions",
                                           content=orjson.dumps({"prompt": BIG}))
        yield "/encode", http.post("/encode", content=orjson.dumps({"text": BIG}))
        yield "/tokenize", http.post("/tokenize", content=orjson.dumps({"prompt": BIG}))


def _grpc_refusals(stub) -> Iterator[tuple[str, grpc.RpcError]]:
    calls: dict[str, Callable[[], object]] = {
        "TextGenerate": lambda: list(stub.TextGenerate(text_request(BIG), timeout=60)),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text=BIG), timeout=60),
        "TextEmbed": lambda: stub.TextEmbed(pb.TextEmbedRequest(text=BIG), timeout=60),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        yield name, err.value


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _rss(mesh) -> dict[str, float]:
    return {role: _rss_mb(mesh.service(role).pid) for role in ROLES}


def _small(stub) -> float:
    """Seconds for one small generation, end to end."""
    started = time.perf_counter()
    msgs = list(stub.TextGenerate(text_request("Hello there", stream=False, max_new_tokens=4,
                                               ignore_eos=True), timeout=60))
    assert msgs[-1].finished
    return time.perf_counter() - started


def _median_small(stub, n: int = 7) -> float:
    return statistics.median(_small(stub) for _ in range(n))


def test_a_huge_prompt_is_refused_before_tokenization_and_nothing_keeps_its_memory(
        mesh, stub) -> None:
    _median_small(stub, 3)  # warm
    before = _rss(mesh)
    for _ in range(3):
        for name, err in _grpc_refusals(stub):
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.details())
            assert "the prompt is 10000000 characters" in err.details(), name
            assert LIMIT in err.details(), name
        for route, r in _http_refusals(mesh.addresses.gateway_http):
            assert r.status_code == 400, (route, r.text[:300])
            assert LIMIT in r.json()["error"]["message"], route
    grown: dict[str, float] = {}

    def settled() -> bool:  # the last refusal's memory is given back just after it
        after = _rss(mesh)
        grown.update({role: round(after[role] - before[role], 1) for role in ROLES})
        return all(g < RSS_SLACK_MB for g in grown.values())

    settled()
    print(f"\nRSS before {before} MB, growth just after {grown} MB")
    wait_until(settled, timeout=10, what=f"RSS within {RSS_SLACK_MB} MB of its baseline")
    print(f"RSS growth settled at {grown} MB")
    assert _small(stub) < 60  # still serving


def test_a_small_request_keeps_its_latency_while_huge_prompts_arrive(mesh, stub) -> None:
    _median_small(stub, 3)  # warm
    unloaded = _median_small(stub)
    stop = threading.Event()
    refused = {"http": 0, "grpc": 0}
    body = orjson.dumps({"text": BIG})
    request = text_request(BIG)

    def http_client() -> None:
        with httpx.Client(base_url=mesh.addresses.gateway_http, timeout=60) as http:
            while not stop.is_set():
                assert http.post("/generate", content=body).status_code == 400
                refused["http"] += 1

    def grpc_client() -> None:  # another client: a connection of its own
        with grpc.insecure_channel(mesh.addresses.gateway_grpc) as channel:
            other = pb_grpc.SglangServiceStub(channel)
            while not stop.is_set():
                with pytest.raises(grpc.RpcError):
                    list(other.TextGenerate(request, timeout=60))
                refused["grpc"] += 1

    threads = [threading.Thread(target=f, daemon=True) for f in (http_client, grpc_client)]
    for t in threads:
        t.start()
    try:
        loaded = _median_small(stub)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    print(f"\nsmall request: {unloaded * 1000:.1f} ms unloaded, {loaded * 1000:.1f} ms "
          f"beside 10 MB prompts ({refused} refused meanwhile), ratio {loaded / unloaded:.2f}")
    assert refused["http"] and refused["grpc"]
    assert loaded <= max(2 * unloaded, unloaded + LATENCY_FLOOR), (loaded, unloaded)


@pytest.fixture(params=["native", "grpcio"])
def wide_stub(mesh, request) -> Iterator[pb_grpc.SglangServiceStub]:
    """A gateway of the mesh that lets 10 MB prompts through to the tokenizer, its Submit
    streams on the native client and on grpc.aio's (--mesh-streams)."""
    name = f"gateway-wide-{uuid.uuid4().hex[:6]}"
    proc = mesh.start_gateway(name, max_prompt_chars=20_000_000, mesh_streams=request.param)
    try:
        with grpc.insecure_channel(proc.grpc_address) as channel:
            yield pb_grpc.SglangServiceStub(channel)
    finally:
        proc.stop(10)
        del mesh.services[name]


def test_the_tokenizer_refuses_a_huge_prompt_without_encoding_it_all(mesh, wide_stub) -> None:
    """Past a gateway that lets it through, the tokenizer counts the prompt piece by piece and
    refuses it once the count passes the context; its memory goes back to its baseline."""
    before = _rss_mb(mesh.service("tokenizer").pid)
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as err:
            list(wide_stub.TextGenerate(text_request(BIG), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert err.value.details().startswith("text: the prompt is more than")
        assert "10000000 characters" in err.value.details()
        assert f"context length ({CONTEXT} tokens)" in err.value.details()
    grown: list[float] = []

    def settled() -> bool:
        grown.append(round(_rss_mb(mesh.service("tokenizer").pid) - before, 1))
        return grown[-1] < RSS_SLACK_MB

    wait_until(settled, timeout=10, what="the tokenizer's RSS back near its baseline")
    print(f"\ntokenizer RSS {before:.1f} MB, growth after 3 refused 10 MB prompts {grown[-1]} MB")
    assert _small(wide_stub) < 60


def test_samples_of_a_huge_prompt_past_one_mesh_message_are_answered(mesh, wide_stub) -> None:
    """Eight samples of a 10 MB prompt are 80 MB for the tokenizer, over the mesh's message
    limit (64 MiB): the gateway sends them in several messages and the tokenizer refuses the
    prompt, where one message would have failed the Submit stream and the request would have
    waited for ever. The call also comes back in seconds (reading a large message in linear
    time), not at its deadline."""
    request = text_request(BIG)
    request.sampling_params.n = 8
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(wide_stub.TextGenerate(request, timeout=60))
    took = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert f"context length ({CONTEXT} tokens)" in err.value.details()
    print(f"\n8 samples of a 10 MB prompt refused in {took:.2f} s")
    assert took < 30, took
    assert _small(wide_stub) < 60


def test_bodies_and_messages_over_the_size_limits_are_refused_unread(mesh, stub) -> None:
    over = b"x" * (DEFAULT_BODY_BYTES + 1)
    with httpx.Client(base_url=mesh.addresses.gateway_http, timeout=60) as http:
        declared = http.post("/generate", content=over)

        def chunked() -> Iterator[bytes]:
            for i in range(0, len(over), 1 << 20):
                yield over[i:i + (1 << 20)]

        streamed = http.post("/v1/chat/completions", content=chunked())
        for r in (declared, streamed):
            assert r.status_code == 413, r.text[:300]
            message = r.json()["error"]["message"]
            assert f"limit of {DEFAULT_BODY_BYTES} bytes" in message
            assert "--http-max-body-bytes" in message
        assert http.post("/generate", json={"text": "still", "sampling_params": {
            "max_new_tokens": 2}}).status_code == 200  # the connection and gateway go on
    with pytest.raises(grpc.RpcError) as err:
        list(stub.TextGenerate(text_request("y" * (DEFAULT_BODY_BYTES + 1)), timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # grpc's own refusal
    assert _small(stub) < 60


def test_a_batch_that_could_never_be_admitted_is_refused_at_once(mesh, stub) -> None:
    credentials = mesh_credentials(mesh)
    finished = scheduler_load(mesh, credentials).finished_total
    body = orjson.dumps({"text": [f"prompt {i}" for i in range(10_000)],
                         "sampling_params": {"max_new_tokens": 1}})
    started = time.perf_counter()
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", content=body, timeout=60)
    took = time.perf_counter() - started
    print(f"\n10,000-prompt batch refused in {took * 1000:.1f} ms")
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert message.startswith("text: the call asks for 10000 requests")
    assert "at most 1024" in message and "--max-batch" in message
    assert took < 2.0
    # Nothing entered the mesh: no request ended in the scheduler, none is in flight.
    load = scheduler_load(mesh, credentials)
    assert load.finished_total == finished and load.running == 0 and load.waiting == 0
    info = orjson.loads(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).json_info)
    assert int(info["requests_in_flight"]) == 0


def _closed_after(socks: dict[socket.socket, bytes], limit: float) -> list[float]:
    """Seconds from now until the server closes each socket, sending each its bytes every
    0.1 s meanwhile (b"": a silent client); fails past `limit`."""
    started = time.monotonic()
    took: dict[socket.socket, float] = {}
    for sock in socks:
        sock.setblocking(False)
    while len(took) < len(socks):
        assert time.monotonic() - started < limit, f"still open after {limit} s: {took}"
        for sock, trickle in socks.items():
            if sock in took:
                continue
            try:
                if sock.recv(1024) == b"" or (trickle and not sock.send(trickle)):
                    took[sock] = time.monotonic() - started
            except BlockingIOError:
                pass
            except OSError:  # reset: closed too
                took[sock] = time.monotonic() - started
        time.sleep(0.1)  # the trickle's pace, not synchronisation
    return [took[sock] for sock in socks]


def test_clients_slow_to_send_a_request_head_are_cut_off(mesh) -> None:
    """A connection that sends nothing, and one that sends its head a byte at a time, are
    closed once --http-read-timeout has passed (uvicorn alone keeps both for ever, and a few
    thousand of them take every file descriptor); a client that sends in time is served."""
    name = f"gateway-timed-{uuid.uuid4().hex[:6]}"
    proc = mesh.start_gateway(name, http_read_timeout=1)
    try:
        host, port = proc.http_address.removeprefix("http://").rsplit(":", 1)
        silent = socket.create_connection((host, int(port)))
        slow = socket.create_connection((host, int(port)))
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        with silent, slow:
            took = _closed_after({silent: b"", slow: b"X"}, 10)
        print(f"\nsilent and trickling connections closed after {took} s (timeout 1 s)")
        assert all(0.8 <= t for t in took), took
        r = httpx.post(f"{proc.http_address}/generate", timeout=30, content=orjson.dumps(
            {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}))
        assert r.status_code == 200, r.text
    finally:
        proc.stop(10)
        del mesh.services[name]
