"""deploy/compose.yaml on a real Docker engine: the image built from deploy/Dockerfile, `docker
compose up --wait`, requests through the published ports, scaling, a killed scheduler, and a
drain on `docker compose down`. Skips without Docker (see containers.py); CI runs it."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from containers import REDIS_IMAGE, ROOT, docker
from helpers import wait_until

from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

COMPOSE_FILE = ROOT / "deploy" / "compose.yaml"
SCALED = ("--scale", "scheduler=2", "--scale", "tokenizer=2", "--scale", "detokenizer=2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    http_port: int
    grpc_port: int
    up_seconds: list[float] = field(default_factory=list)

    def compose(self, *args: str, check: bool = True, timeout: float = 600):
        return docker("compose", "-f", str(COMPOSE_FILE), "-p", self.project, *args,
                      check=check, timeout=timeout, env=self.env)

    def up(self, *args: str) -> None:
        start = time.monotonic()
        self.compose("up", "-d", "--wait", "--pull", "never", *args)
        self.up_seconds.append(time.monotonic() - start)

    def containers(self, service: str = "", all_states: bool = False) -> list[dict]:
        args = ["ps", "--format", "json", *(["-a"] if all_states else []),
                *([service] if service else [])]
        out = self.compose(*args).stdout.strip()
        if not out:
            return []
        rows = json.loads(out) if out.startswith("[") else [json.loads(line)
                                                              for line in out.splitlines()]
        return rows

    def container_at(self, ip: str) -> str:
        """The name of this project's container with address `ip`."""
        for row in self.containers():
            info = json.loads(docker("inspect", row["Name"]).stdout)[0]
            nets = info["NetworkSettings"]["Networks"].values()
            if any(n["IPAddress"] == ip for n in nets):
                return row["Name"]
        raise AssertionError(f"no container at {ip}")

    def stub(self) -> sglang_pb2_grpc.SglangServiceStub:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        return sglang_pb2_grpc.SglangServiceStub(channel)

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of this project still on the engine."""
        label = f"label=com.docker.compose.project={self.project}"
        found = []
        for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
            out = docker(*kind, "-q", "--filter", label).stdout.split()
            found += [f"{kind[0]} {x}" for x in out]
        return found


@pytest.fixture(scope="module")
def stack(meshlm_image: str) -> Iterator[Stack]:
    project = f"meshlm-e2e-compose-{uuid.uuid4().hex[:6]}"
    http_port, grpc_port = _free_port(), _free_port()
    env = {
        "MESHLM_IMAGE": meshlm_image, "MESHLM_REDIS_IMAGE": REDIS_IMAGE,
        "MESHLM_PUBLISH_HOST": "127.0.0.1", "MESHLM_HTTP_PORT": str(http_port),
        "MESHLM_GRPC_PORT": str(grpc_port),
    }
    for name in ("MESHLM_MODEL_PATH", "MESHLM_MODEL_VOLUME", "MESHLM_API_KEY",
                 "OTEL_EXPORTER_OTLP_ENDPOINT"):
        env[name] = ""  # the developer's own settings must not leak into the stack
    s = Stack(project, env, http_port, grpc_port)
    try:
        s.up()
        print(f"\ncompose up --wait: {s.up_seconds[0]:.1f} s to healthy")
        yield s
    finally:
        for row in s.containers(all_states=True) if s.leftovers() else ():
            logs = docker("logs", "--tail", "40", row["Name"], check=False)
            print(f"--- {row['Name']} ({row.get('State')})\n{logs.stdout[-4000:]}"
                  f"{logs.stderr[-4000:]}")
        s.compose("down", "-v", "--remove-orphans", "-t", "30", check=False)


STREAMED = 1900  # tokens of the streaming checks
DRAINED_TOKENS = 600  # tokens of the request in flight at `compose down`


def _generate(text: str, n: int, **extra) -> pb.TextGenerateRequest:
    params = pb.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return pb.TextGenerateRequest(text=text, sampling_params=params, stream=True, **extra)


@dataclass
class Follower:
    """Reads one gRPC stream in a thread: the messages, and how it ended."""

    stub: sglang_pb2_grpc.SglangServiceStub
    request: pb.TextGenerateRequest
    messages: list[pb.TextGenerateResponse] = field(default_factory=list)
    error: grpc.RpcError | None = None
    ended_at: float = 0.0
    thread: threading.Thread | None = None

    def start(self) -> Follower:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            for msg in self.stub.TextGenerate(self.request, timeout=120):
                self.messages.append(msg)
        except grpc.RpcError as e:
            self.error = e
        self.ended_at = time.monotonic()

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "stream still open"

    @property
    def tokens(self) -> int:
        return sum(len(m.output_ids) for m in self.messages)

    @property
    def finish_reason(self) -> str:
        last = self.messages[-1].meta_info.get("finish_reason", "") if self.messages else ""
        return json.loads(last)["type"] if last.startswith("{") else last


def test_streams_over_grpc_and_http_through_published_ports(stack: Stack) -> None:
    # A stream's mailbox folds what arrives while the gateway is busy: on a loaded machine 200
    # tokens (0.2 s of the tiny model now) once came as one message. 1900 take 1-2 s: streamed
    # in pieces unless the gateway stalls for all of it.
    follower = Follower(stack.stub(), _generate("Once upon a time", STREAMED)).start()
    follower.join(60)
    assert follower.error is None, follower.error
    assert len(follower.messages) > 1 and follower.tokens == STREAMED
    assert follower.messages[-1].finished and follower.finish_reason == "length"

    base = f"http://127.0.0.1:{stack.http_port}"
    events = []
    with httpx.stream("POST", f"{base}/generate", timeout=60, json={
            "text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": STREAMED, "temperature": 0,
                                "ignore_eos": True}}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    assert json.loads(events[-2])["meta_info"]["completion_tokens"] == STREAMED

    models = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": models[0]["id"], "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hello!"}]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] > 0

    # The image's build stage compiled the C decode-attention kernel; the image has no
    # compiler, and the scheduler serves with the kernel.
    logs = stack.compose("logs", "--no-log-prefix", "scheduler").stdout.splitlines()
    ready = [json.loads(line[line.index("{"):]) for line in logs if '"engine_ready"' in line]
    assert ready and ready[-1]["attention_backend"] == "native", logs[-20:]


def _added(stack: Stack, role: str) -> set[str]:
    """The `role` replicas' IPs the gateway added (its dependency_added log lines)."""
    found = set()
    for line in stack.compose("logs", "--no-log-prefix", "gateway").stdout.splitlines():
        if '"dependency_added"' in line:
            event = json.loads(line[line.index("{"):])
            if event["role"] == role:
                found.add(event["address"].rsplit(":", 1)[0])
    return found


def _loads(stack: Stack) -> list[dict]:
    return json.loads(stack.stub().GetLoad(pb.GetLoadRequest(), timeout=10).json_info)


def test_scale_schedulers_and_both_serve(stack: Stack) -> None:
    stack.up(*SCALED)
    wait_until(lambda: len(_loads(stack)) == 2, 30, "the gateway to see 2 schedulers")
    # Every scaled role is found through its service's DNS name.
    for role in ("tokenizer", "detokenizer"):
        ips = {json.loads(docker("inspect", row["Name"]).stdout)[0]["NetworkSettings"]
               ["Networks"][f"{stack.project}_mesh"]["IPAddress"]
               for row in stack.containers(role)}
        assert len(ips) == 2
        wait_until(lambda role=role, ips=ips: ips <= _added(stack, role), 30, f"2 {role}s")
    # Routing spreads concurrent requests over both (GetLoad counts what each finished). Each
    # prompt is its own affinity key, hashed with the replicas' addresses to the one that would
    # cache it: all 24 on one replica has odds of 2^-23 (with 6, 1 in 32 failed a CI run).
    before = {load["dp_rank"]: load["finished_total"] for load in _loads(stack)}
    stub = stack.stub()
    followers = [Follower(stub, _generate(f"prompt number {i} goes here", 50)).start()
                 for i in range(24)]
    for f in followers:
        f.join(120)
        assert f.error is None and f.tokens == 50
    after = {load["dp_rank"]: load["finished_total"] for load in _loads(stack)}
    assert sorted(after) == [0, 1]
    assert all(after[rank] > before[rank] for rank in (0, 1)), (before, after)


def _serves(stub: sglang_pb2_grpc.SglangServiceStub, rank: int) -> bool:
    """Whether a short request routed to dp rank `rank` completes."""
    follower = Follower(stub, _generate("are you there", 4, routed_dp_rank=rank)).start()
    follower.join(60)
    return follower.error is None and follower.tokens == 4


def test_killed_scheduler_fails_only_its_requests_and_rejoins(stack: Stack) -> None:
    stub = stack.stub()
    loads = _loads(stack)
    assert [load["dp_rank"] for load in loads] == [0, 1]
    victim = stack.container_at(loads[0]["address"].rsplit(":", 1)[0])
    doomed = [Follower(stub, _generate(f"doomed {i}", 1500, routed_dp_rank=0)).start()
              for i in range(2)]
    spared = [Follower(stub, _generate(f"spared {i}", 300, routed_dp_rank=1)).start()
              for i in range(2)]
    wait_until(lambda: all(f.messages for f in doomed + spared), 60, "all streams to start")
    killed_at = time.monotonic()
    docker("kill", victim)
    for f in doomed:
        f.join(30)
        assert f.error is not None, f"a stream on the killed scheduler ended {f.finish_reason}"
        assert f.error.code() == grpc.StatusCode.UNAVAILABLE, f.error
        assert f.ended_at - killed_at < 5.0
    for f in spared:
        f.join(120)
        assert f.error is None, f.error
        assert f.tokens == 300 and f.finish_reason == "length"
    # New requests keep working on the survivor meanwhile.
    alive = Follower(stub, _generate("meanwhile", 8)).start()
    alive.join(60)
    assert alive.error is None and alive.tokens == 8
    # `docker kill` is a manual stop for Docker's restart policy; compose brings it back.
    stack.up(*SCALED)
    wait_until(lambda: len(_loads(stack)) == 2, 30, "the restarted scheduler to rejoin")
    # GetLoad reaches it as soon as it listens; routing waits for its health Watch to say
    # SERVING (CI once asked in between and got "the scheduler of dp rank 0 is not serving").
    wait_until(lambda: _serves(stub, 0), 30, "the restarted scheduler to serve again")
    if os.geteuid() != 0:
        return  # the crash below kills a host process: root only (CI runs as root)
    # A crash (the container's processes die, not a `docker kill`) is restarted by the restart
    # policy alone, and the scheduler is used again.
    def state() -> tuple[int, str]:
        info = json.loads(docker("inspect", victim).stdout)[0]
        return info["RestartCount"], info["State"].get("Health", {}).get("Status", "")

    restarts, _ = state()
    os.kill(json.loads(docker("inspect", victim).stdout)[0]["State"]["Pid"], signal.SIGKILL)
    wait_until(lambda: state() == (restarts + 1, "healthy"), 120, "the restart policy")
    wait_until(lambda: _serves(stub, 0), 30, "the crashed scheduler to serve again")


def test_profiles_render_with_gpu_reservation_and_observability(stack: Stack) -> None:
    config = json.loads(stack.compose("--profile", "gpu", "--profile", "observability",
                                      "config", "--format", "json").stdout)
    services = config["services"]
    assert {"jaeger", "prometheus", "grafana", "scheduler-gpu"} <= set(services)
    gpu = services["scheduler-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert gpu["environment"]["MESHLM_DEVICE"] == "cuda"
    assert "scheduler" in gpu["networks"]["mesh"]["aliases"]
    gateway = services["gateway"]
    assert {p["published"] for p in gateway["ports"]} == {str(stack.http_port),
                                                         str(stack.grpc_port)}


def test_down_drains_a_request_in_flight_and_leaves_nothing(stack: Stack) -> None:
    stub = stack.stub()
    # 600 tokens stream for about 4.5 s here (c=1, through the published port): long enough to be
    # in flight when the gateway gets SIGTERM, short enough to end within its 20 s grace on a
    # host a few times slower (1,200 did not, on a loaded CI host).
    follower = Follower(stub, _generate("a long story", DRAINED_TOKENS)).start()
    wait_until(lambda: bool(follower.messages), 60, "the stream to start")
    began, tokens_then = time.monotonic(), follower.tokens
    down = stack.compose("down", "-v", "--remove-orphans", "-t", "30", timeout=180)
    follower.join(60)
    print(f"\ndown began after {tokens_then} tokens; the stream ended "
          f"{follower.ended_at - began:.1f} s later with {follower.tokens}")
    assert follower.error is None, follower.error
    assert follower.tokens == DRAINED_TOKENS and follower.finish_reason == "length"
    assert "gateway" in down.stderr
    assert stack.leftovers() == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{stack.http_port}/health", timeout=2)


