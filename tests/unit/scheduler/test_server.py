"""The scheduler service over a real tiny engine, without gRPC: what the wire fields embed and
after do, and FlushCache answered by the engine loop between steps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from scheduler_helpers import Outputs, write_checkpoint

from meshlm.scheduler.server import SchedulerServicer
from meshlm.v1 import common_pb2, scheduler_pb2


@pytest.fixture
async def service(make_engine: Any, request: pytest.FixtureRequest,
                  tmp_path: Path) -> AsyncIterator[tuple[SchedulerServicer, Outputs]]:
    """A scheduler over the tiny engine; `@pytest.mark.parametrize("service", [N],
    indirect=True)` gives it a model of N positions instead of 256."""
    positions = getattr(request, "param", None)
    path = write_checkpoint(tmp_path / "long", max_positions=positions) if positions else None
    engine = make_engine(path, max_running=8, block_size=16)
    outputs = Outputs()
    servicer = SchedulerServicer(engine, ThreadPoolExecutor(1), outputs,
                                 common_pb2.ModelInfo(), "s")
    loop = asyncio.create_task(servicer.run_engine())
    yield servicer, outputs
    loop.cancel()
    servicer.close()


def _request(rid: str, prompt: list[int], **kw: Any) -> scheduler_pb2.TokenizedRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1,
                                         repetition_penalty=1.0, max_new_tokens=4,
                                         ignore_eos=True, logprob_start_len=-1)
    return scheduler_pb2.TokenizedRequest(rid=rid, input_ids=prompt, sampling=sampling,
                                          route=common_pb2.Route(detokenizer="d"), **kw)


async def _submit(servicer: SchedulerServicer, *reqs: scheduler_pb2.TokenizedRequest) -> None:
    async def batches() -> AsyncIterator[scheduler_pb2.TokenizedBatch]:
        yield scheduler_pb2.TokenizedBatch(requests=reqs)

    await servicer.Submit(batches(), None)


def _prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 500 for i in range(n)]


async def test_followers_share_the_leaders_prompt(service: tuple[SchedulerServicer, Outputs]):
    servicer, outputs = service
    prompt = _prompt(40)
    await _submit(servicer, _request("p-0", prompt),
                  *(_request(f"p-{i}", prompt, after="p-0") for i in (1, 2)))
    outs = await outputs.finished({"p-0", "p-1", "p-2"})
    cached = [outs[f"p-{i}"][-1].cached_tokens for i in range(3)]
    assert cached[0] == 0 and min(cached[1:]) >= 32, cached
    tokens = {tuple(t for o in outs[f"p-{i}"] for t in o.token_ids) for i in range(3)}
    assert len(tokens) == 1  # greedy: the same sample three times


async def test_embed_requests_answer_with_their_vector(service: tuple[SchedulerServicer, Outputs]):
    servicer, outputs = service
    await _submit(servicer, _request("e", _prompt(10), embed=True))
    [out] = (await outputs.finished({"e"}))["e"]
    assert out.finish_reason == "stop" and not out.token_ids and out.prompt_tokens == 10
    assert len(out.embedding) == servicer.engine.model_config.hidden_size
    assert abs(sum(x * x for x in out.embedding) - 1.0) < 1e-4
    assert out.HasField("header") and not out.header.return_text


async def test_flush_cache_is_refused_while_busy(service: tuple[SchedulerServicer, Outputs]):
    servicer, outputs = service
    flush = scheduler_pb2.FlushCacheRequest()
    prompt = _prompt(40)
    await _submit(servicer, _request("a", prompt))
    await outputs.finished({"a"})
    assert (await servicer.FlushCache(flush, None)).success
    busy = _request("b", prompt)
    busy.sampling.max_new_tokens = 200
    await _submit(servicer, busy)
    reply = await servicer.FlushCache(flush, None)
    assert not reply.success and "running" in reply.message
    await servicer.Abort(scheduler_pb2.AbortRequest(rids=["b"], reason="abort"), None)
    outs = await outputs.finished({"b"})
    assert outs["b"][0].cached_tokens == 0  # the flush emptied what "a" left
    assert (await servicer.FlushCache(flush, None)).success


# 16k positions: "free" must not reach its length limit before "running" passes its deadline,
# however fast the machine steps.
@pytest.mark.parametrize("service", [16384], indirect=True)
async def test_a_request_past_its_deadline_ends_deadline_exceeded(
        service: tuple[SchedulerServicer, Outputs]):
    """The scheduler enforces the client's deadline itself: a request already past it is never
    queued, and a running one is ended (its KV freed) once it passes, while a request without
    a deadline runs on."""
    servicer, outputs = service
    long = {"deadline": time.time() + 0.5}
    late = _request("late", _prompt(8), deadline=time.time() - 1)
    running = _request("running", _prompt(8), **long)
    running.sampling.max_new_tokens = 100_000  # far more than 0.5 s of steps
    free = _request("free", _prompt(8))
    free.sampling.max_new_tokens = 100_000
    await _submit(servicer, late, running, free)
    outs = await outputs.finished({"late", "running"})
    for rid, what in (("late", "before the request reached the scheduler"),
                      ("running", "deadline passed after")):
        final = outs[rid][-1]
        assert final.finish_reason == "error", final
        assert final.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert what in final.error.message
    assert not any(o.token_ids for o in outs["late"])
    assert sum(len(o.token_ids) for o in outs["running"]) > 0
    stats = servicer.engine.stats()
    assert stats["running"] == 1 and "free" in servicer.state.tracked  # only "free" is left
    await servicer.Abort(scheduler_pb2.AbortRequest(rids=["free"], reason="abort"), None)
    assert (await outputs.finished({"free"}))["free"][-1].finish_reason == "abort"


async def test_a_paused_scheduler_still_ends_requests_past_their_deadline(
        service: tuple[SchedulerServicer, Outputs]):
    servicer, outputs = service
    await servicer.Pause(scheduler_pb2.PauseRequest(mode="in_place"), None)
    await _submit(servicer, _request("held", _prompt(8), deadline=time.time() + 0.2))
    final = (await outputs.finished({"held"}))["held"][-1]
    assert final.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    await servicer.Continue(scheduler_pb2.ContinueRequest(), None)


async def test_the_waiting_queue_is_bounded(make_engine: Any):
    """Past max_queued waiting requests a new one ends at once with RESOURCE_EXHAUSTED; once
    the queue drains, requests are taken again."""
    engine = make_engine(max_running=1, block_size=16)
    outputs = Outputs()
    servicer = SchedulerServicer(engine, ThreadPoolExecutor(1), outputs,
                                 common_pb2.ModelInfo(), "s", max_queued=2)
    reqs = [_request(f"q-{i}", _prompt(8)) for i in range(4)]
    await _submit(servicer, *reqs)  # one batch: nothing has run yet, so all wait
    assert engine.num_waiting == 2
    loop = asyncio.create_task(servicer.run_engine())
    try:
        refused = (await outputs.finished({"q-2", "q-3"}))
        for rid in ("q-2", "q-3"):
            final = refused[rid][-1]
            assert final.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "2 requests waiting (limit 2)" in final.error.message
        outs = await outputs.finished({"q-0", "q-1"})
        assert all(outs[r][-1].finish_reason == "length" for r in ("q-0", "q-1"))
        await _submit(servicer, _request("q-4", _prompt(8)))
        assert (await outputs.finished({"q-4"}))["q-4"][-1].finish_reason == "length"
    finally:
        loop.cancel()
        servicer.close()
