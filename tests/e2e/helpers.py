"""Small client helpers shared by the e2e tests."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import orjson
import redis
from prometheus_client.parser import text_string_to_metric_families

from meshlm.common.default_model import BOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN
from meshlm.gateway.mesh.registry import key
from meshlm.launch.mesh import Mesh, MeshOptions
from meshlm.v1 import scheduler_pb2, scheduler_pb2_grpc
from sglang.runtime.v1 import sglang_pb2 as pb


def text_request(text: str, *, stream: bool = True, rid: str | None = None,
                 **sampling: object) -> pb.TextGenerateRequest:
    params = pb.SamplingParams(**{"temperature": 0.0, "max_new_tokens": 16, **sampling})
    req = pb.TextGenerateRequest(text=text, sampling_params=params, stream=stream)
    if rid is not None:
        req.rid = rid
    return req


def collect_text(stub, req: pb.TextGenerateRequest) -> tuple[str, list[pb.TextGenerateResponse]]:
    msgs = list(stub.TextGenerate(req, timeout=120))
    return "".join(m.text for m in msgs), msgs


def server_info(stub) -> dict[str, Any]:
    """GetServerInfo's json_info, parsed."""
    return json.loads(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).json_info)


def dependencies(stub) -> dict[str, dict[str, bool]]:
    """Per role, each replica the gateway knows and whether it is SERVING."""
    return server_info(stub)["dependencies"]


def serves(stub, **fields: object) -> bool:
    """Does a fresh 2-token request (with these request fields) complete now?"""
    req = text_request("are you there", max_new_tokens=2)
    for name, value in fields.items():
        setattr(req, name, value)
    try:
        _, msgs = collect_text(stub, req)
    except grpc.RpcError:
        return False
    return msgs[-1].finished


def scheduler_load(mesh, credentials: grpc.ChannelCredentials) -> scheduler_pb2.Load:
    with grpc.secure_channel(mesh.addresses.scheduler, credentials) as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(scheduler_pb2.GetLoadRequest(),
                                                            timeout=10)


def scheduler_busy(mesh: Mesh, address: str) -> int:
    """Requests the scheduler at `address` runs or queues (GetLoad over mTLS)."""
    with grpc.secure_channel(address, mesh_credentials(mesh)) as ch:
        load = scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(scheduler_pb2.GetLoadRequest(),
                                                            timeout=10)
    return load.running + load.waiting


def gateway_load(stub) -> dict:
    return json.loads(stub.GetLoad(pb.GetLoadRequest(), timeout=10).json_info)[0]


def wait_idle(mesh, timeout: float = 60.0) -> None:
    """Wait until the mesh's scheduler has nothing running or waiting (an earlier test's
    requests have ended)."""
    creds = mesh_credentials(mesh)

    def idle() -> bool:
        load = scheduler_load(mesh, creds)
        return load.running == 0 and load.waiting == 0

    wait_until(idle, timeout=timeout, what="an idle scheduler")


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll a condition on the system under test (a state, not a duration) with a deadline."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


def mesh_credentials(mesh: Mesh, client_cert: bool = True) -> grpc.ChannelCredentials:
    certs = mesh.addresses.certs
    ca = Path(certs.ca_cert).read_bytes()
    if not client_cert:
        return grpc.ssl_channel_credentials(ca)
    return grpc.ssl_channel_credentials(ca, Path(certs.mesh_key).read_bytes(),
                                        Path(certs.mesh_cert).read_bytes())


TWO_OF_EACH = {"gateway": 2, "tokenizer": 2, "scheduler": 2, "detokenizer": 2}


@contextmanager
def own_mesh(workdir: Path, **options: Any) -> Iterator[Mesh]:
    """A mesh of a test module's own (free ports, one engine thread each unless `env` says
    otherwise), stopped even when a test fails. `options` are MeshOptions fields."""
    env = {"MESHLM_NUM_THREADS": "1", **options.pop("env", {})}
    mesh = Mesh(MeshOptions(workdir=workdir, http_port=0, grpc_port=0, env=env, **options))
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


def generate_events(base: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The events of a streamed POST /generate (no error event allowed)."""
    with httpx.stream("POST", f"{base}/generate", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[len("data: "):])
            assert "error" not in event, event
            yield event


class TokenStream:
    """One streaming generation drained in a thread: `ids` and `text` grow as it arrives.
    Subclasses define run(), which calls follow_grpc or follow_sse."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.error: BaseException | None = None
        self.done = False
        self.cond = threading.Condition()

    def run(self) -> None:
        raise NotImplementedError

    def start(self) -> TokenStream:
        threading.Thread(target=self._guarded, daemon=True).start()
        return self

    def _guarded(self) -> None:
        try:
            self.run()
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self.error = e
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def _progress(self, ids: list[int], text: str) -> None:
        with self.cond:
            self.ids, self.text = ids, text
            self.cond.notify_all()

    def follow_grpc(self, responses: Any) -> None:
        """Read a TextGenerate stream."""
        ids: list[int] = []
        text = ""
        for m in responses:
            ids, text = ids + list(m.output_ids), text + m.text
            if m.finished:
                self.finish_reason = m.meta_info["finish_reason"]
                self.completion_tokens = int(m.meta_info["completion_tokens"])
            self._progress(ids, text)

    def follow_sse(self, base: str, body: dict[str, Any]) -> None:
        """Read a streamed /generate (each event has the ids and text so far)."""
        for event in generate_events(base, body):
            meta = event["meta_info"]
            if meta["finish_reason"] is not None:
                self.finish_reason = meta["finish_reason"]["type"]
                self.completion_tokens = meta["completion_tokens"]
            self._progress(event["output_ids"], event["text"])

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        with self.cond:
            self.cond.wait_for(lambda: len(self.ids) >= n or self.done, timeout)
        assert len(self.ids) >= n, f"{self.rid} ended after {len(self.ids)} tokens: {self.error}"

    def wait_done(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.done, timeout)

    def result(self, timeout: float = 300) -> TokenStream:
        assert self.wait_done(timeout), f"{self.rid} did not end"
        if self.error is not None:
            raise self.error
        return self


def mesh_redis(mesh: Mesh) -> Any:
    """A client of the mesh's Redis, with the password the launcher generated for it."""
    import redis

    password = mesh.redis.password if mesh.redis is not None else None
    return redis.Redis.from_url(mesh.addresses.redis_url, password=password or None,
                                decode_responses=True)


class Stream:
    """A streaming TextGenerate drained in a thread; records how and when it ended (long by
    default: 1900 tokens, ignore_eos). Made once its first message is in (it is being
    generated), unless `wait_first` is False: a request that may be stuck on its way, or one
    of several started together (`streaming`)."""

    def __init__(self, stub, text: str, *, dp_rank: int | None = None,
                 max_new_tokens: int = 1900, wait_first: bool = True) -> None:
        self.rid = f"f-{uuid.uuid4().hex[:10]}"
        req = text_request(text, rid=self.rid, max_new_tokens=max_new_tokens, ignore_eos=True)
        if dp_rank is not None:
            req.routed_dp_rank = dp_rank
        self.call = stub.TextGenerate(req, timeout=120)
        self.messages = [next(self.call)] if wait_first else []
        self.error: grpc.RpcError | None = None
        self.ended_at = 0.0
        self.first_in = threading.Event()  # its first message came, or it ended without one
        if self.messages:
            self.first_in.set()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
                self.first_in.set()
        except grpc.RpcError as e:
            self.error = e
        self.ended_at = time.monotonic()
        self.first_in.set()

    def started(self, timeout: float = 60) -> Stream:
        """Wait for its first message (it is being generated)."""
        assert self.first_in.wait(timeout), f"{self.rid}: no first message in {timeout} s"
        assert self.messages, f"{self.rid}: ended before its first message: {self.error}"
        return self

    def join(self, timeout: float = 60) -> Stream:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.rid}: the stream is hanging"
        return self

    @property
    def finished(self) -> bool:
        return self.error is None and bool(self.messages) and self.messages[-1].finished

    def code(self) -> grpc.StatusCode | None:
        return self.error.code() if self.error is not None else None


def streaming(streams: list[Stream]) -> list[Stream]:
    """`streams`, made with wait_first=False so that they start together, once each has its
    first message: a fault that follows then meets every one mid-stream, however slow the
    machine (made one after another, the first could finish while the last waits for its
    first token)."""
    for s in streams:
        s.started()
    return streams


def routes(registry: redis.Redis, rid: str) -> dict[str, str]:
    """`rid`'s record in the RID registry (where it runs), once it has one."""
    wait_until(lambda: registry.hget(key(rid), "detokenizer") is not None,
               what=f"{rid}'s record")
    return registry.hgetall(key(rid))


def finished_in_full(streams: list[Stream], tokens: int) -> None:
    """Streams a fault spared end as if nothing happened: finished, all `tokens` made."""
    for s in streams:
        assert s.join().finished, (s.rid, s.error)
        assert s.messages[-1].meta_info["completion_tokens"] == str(tokens), s.rid


def recorded_failed(registry: redis.Redis, streams: list[Stream]) -> None:
    """Each of `streams` ends up recorded as failed in the RID registry."""
    for s in streams:
        wait_until(lambda s=s: registry.hget(key(s.rid), "state") == "error",
                   what=f"{s.rid} recorded as failed")


def end_spared(stub, streams: list[Stream]) -> None:
    """Streams a fault spared end cleanly: each still streaming is aborted and ends with
    "abort"; one that ended meanwhile finished in full ("length": on a fast machine a long
    stream can end before the fault is noticed)."""
    for s in streams:
        if s.thread.is_alive():
            stub.Abort(pb.AbortRequest(rid=s.rid), timeout=10)
        assert s.join().finished, (s.rid, s.error)
        assert s.messages[-1].meta_info["finish_reason"] in ("abort", "length"), s.rid


def openai_client(mesh: Mesh) -> openai.OpenAI:
    keys = mesh.options.api_keys  # the gateway needs one only when it has any
    return openai.OpenAI(base_url=f"{mesh.addresses.gateway_http}/v1",
                         api_key=keys[0] if keys else "unused", max_retries=0, timeout=120)


def chatml(messages: list[dict[str, str]]) -> str:
    """The default checkpoint's template (ChatML after the bos token), with the assistant's
    turn opened."""
    turns = "".join(f"{IM_START_TOKEN}{m['role']}\n{m['content']}{IM_END_TOKEN}\n"
                    for m in messages)
    return f"{BOS_TOKEN}{turns}{IM_START_TOKEN}assistant\n"


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """A Prometheus /metrics page, as (name, labels) -> value."""
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over the series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def extra_gateway(mesh, kind: str, **flags: str) -> Iterator[Any]:
    """A second gateway of the mesh with the given flags (parsers), stopped afterwards: for a
    module fixture, `yield from extra_gateway(mesh, ...)`."""
    name = f"gateway-{kind}-{uuid.uuid4().hex[:6]}"
    proc = mesh.start_gateway(name, **flags)
    yield proc
    proc.stop(10)
    del mesh.services[name]
