"""Where the scheduler's steps run, seen from outside. Pinned to one CPU (`--engine-cpus`), the
scheduler says at start-up that its steps run on the event loop, and it serves as the session's
mesh does: the same greedy tokens, alone or in a burst of concurrent requests, a long prompt
(whose step goes to the engine thread) included."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import collect_text, own_mesh, text_request

from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2_grpc

PROMPTS = [f"Request {i} asks about the river and the town" for i in range(16)]
LONG = " ".join(f"word{i}" for i in range(300))  # a prompt chunk well over one decode step


@pytest.fixture(scope="module")
def one_cpu_mesh(tmp_path_factory) -> Iterator[Mesh]:
    cpu = min(os.sched_getaffinity(0))
    with own_mesh(tmp_path_factory.mktemp("one-cpu"),
                  env={"MESHLM_ENGINE_CPUS": str(cpu)}) as m:
        yield m


def _startup_choice(mesh: Mesh) -> dict[str, str]:
    log = mesh.log_path("scheduler").read_text().splitlines()
    lines = [json.loads(line) for line in log if line.startswith("{")]
    [choice] = [line for line in lines if line.get("event") == "engine_steps"]
    return choice


def _texts(stub: sglang_pb2_grpc.SglangServiceStub, prompts: list[str],
           concurrent: bool) -> list[str]:
    def one(prompt: str) -> str:
        return collect_text(stub, text_request(prompt, max_new_tokens=24, ignore_eos=True))[0]

    if not concurrent:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_a_scheduler_on_one_cpu_runs_its_steps_on_the_event_loop(one_cpu_mesh):
    choice = _startup_choice(one_cpu_mesh)
    assert choice["on"].startswith("event loop") and "one CPU" in choice["why"], choice


def test_it_generates_what_a_threaded_scheduler_generates(one_cpu_mesh, stub):
    with grpc.insecure_channel(one_cpu_mesh.addresses.gateway_grpc) as channel:
        pinned = sglang_pb2_grpc.SglangServiceStub(channel)
        alone = _texts(pinned, PROMPTS[:4] + [LONG], concurrent=False)
        burst = _texts(pinned, PROMPTS + [LONG], concurrent=True)
    reference = _texts(stub, PROMPTS + [LONG], concurrent=False)
    assert all(alone) and burst == reference
    assert alone == reference[:4] + reference[-1:]
