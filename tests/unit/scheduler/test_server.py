"""The scheduler's servicer over a real tiny engine, its RPCs called without a gRPC server:
FlushCache answered by the engine loop between steps, GetLoad from the engine's figures."""

from __future__ import annotations

import json

from scheduler_helpers import Outputs, sample_prompt, submit, tokenized

from meshlm.scheduler.server import SchedulerServicer
from meshlm.v1 import scheduler_pb2


async def test_flush_cache_is_refused_while_busy(served: tuple[SchedulerServicer, Outputs]):
    servicer, outputs = served
    flush = scheduler_pb2.FlushCacheRequest()
    prompt = sample_prompt(40)
    await submit(servicer, tokenized("a", prompt))
    await outputs.finished({"a"})
    assert (await servicer.FlushCache(flush, None)).success  # type: ignore[arg-type]
    busy = tokenized("b", prompt)
    busy.meta.sampling.max_new_tokens = 200
    await submit(servicer, busy)
    reply = await servicer.FlushCache(flush, None)  # type: ignore[arg-type]
    assert not reply.success and "running" in reply.message
    await servicer.Abort(scheduler_pb2.AbortRequest(rids=["b"], reason="abort"),
                         None)  # type: ignore[arg-type]
    outs = await outputs.finished({"b"})
    assert outs["b"][0].cached_tokens == 0  # the flush emptied what "a" left
    assert (await servicer.FlushCache(flush, None)).success  # type: ignore[arg-type]


async def test_get_load_reports_the_engines_figures(served: tuple[SchedulerServicer, Outputs]):
    servicer, outputs = served
    await submit(servicer, tokenized("a", sample_prompt(8)))
    await outputs.finished({"a"})
    load = await servicer.GetLoad(scheduler_pb2.GetLoadRequest(), None)  # type: ignore[arg-type]
    assert load.address == "s" and load.running == 0 and load.max_running == 8
    assert load.finished_total == 1 and load.generated_tokens_total == 4
    assert json.loads(load.json_info)["finished_total"] == 1
